"""Convert a saved checkpoint to Hugging Face safetensors, after training, on one machine.

    python -m torchtitan_autoparallel.train.to_hf <dump_folder>/checkpoint/step-N OUT_DIR [--dtype bfloat16]

For runs that did not export with ``checkpoint.last_save_in_hf``: reads the
weights of any of our DCP checkpoints (full or weights-only, saved under any
plan or mesh) into one process, renames them with torchtitan's state-dict
adapter of the model (``hf_checkpoint.adapter``), and writes
``OUT_DIR/model.safetensors`` and its ``config.json``. The whole model is
held in this process's memory once, in float32 while reading. Bad input ends
in one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

from torchtitan_autoparallel.config.validate import EXPORT_DTYPES
from torchtitan_autoparallel.errors import UserError
from torchtitan_autoparallel.models.registry import build_model_config
from torchtitan_autoparallel.train import checkpoint_files, hf_checkpoint
from torchtitan_autoparallel.train.checkpoint import CheckpointError, parse_model_id


def convert(checkpoint_dir: Path, out_dir: Path, dtype: torch.dtype) -> Path:
    """Write ``out_dir/model.safetensors`` from the checkpoint in ``checkpoint_dir``."""
    import json

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file


    state_file = checkpoint_dir / "train_state.json"
    if not state_file.is_file():
        raise CheckpointError(
            f"{str(checkpoint_dir)!r} is not a complete checkpoint (no train_state.json); "
            f"accepted: a <dump_folder>/checkpoint/step-N folder"
        )
    state = json.loads(state_file.read_text())
    if state.get("format") == "hf":
        raise CheckpointError(f"{str(checkpoint_dir)!r} holds Hugging Face safetensors already")
    family, flavor, n_layers = parse_model_id(state["model_id"])
    config = build_model_config(family, flavor, n_layers)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    weights = {"model": model.state_dict()}
    if (damaged := checkpoint_files.verify(checkpoint_dir)) is not None:
        raise CheckpointError(f"checkpoint {checkpoint_dir} is damaged: {damaged}; accepted: the files as they were saved")
    # DCP's own reader would unpickle .metadata unrestricted; this one reads DCP's classes only
    reader = checkpoint_files.CheckedReader(checkpoint_dir, checkpoint_files.read_metadata(checkpoint_dir))
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(weights, storage_reader=reader, no_dist=True)
    adapter = hf_checkpoint.adapter(family, config)
    hf = adapter.to_hf(weights["model"])
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "model.safetensors"
    save_file(
        {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in hf.items()},
        str(out),
        metadata={"format": "pt", "model_id": state["model_id"], "step": str(state["step"])},
    )
    hf_checkpoint.write_config(out_dir, adapter, dtype)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a step folder of a saved checkpoint")
    parser.add_argument("out", type=Path, help="the folder to write model.safetensors into")
    parser.add_argument("--dtype", default="float32", choices=EXPORT_DTYPES)
    args = parser.parse_args(argv)
    try:
        out = convert(args.checkpoint, args.out, getattr(torch, args.dtype))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
