"""The files torchtitan 0.2.2's stock trainer reads for the side-by-side Qwen3-1.7B job, and
a check of that job that needs no GPU.

    python experiments/gpu/torchtitan_job.py prepare --out DIR
    python experiments/gpu/torchtitan_job.py check --config experiments/gpu/qwen3_1.7b_torchtitan.toml \
        --assets DIR --out check.json

``prepare`` (standard library only) writes, from the project's own offline assets
(torchtitan_autoparallel/data/assets):

* ``DIR/tokenizer/``: ``tokenizer.json`` and the ``tokenizer_config.json`` torchtitan's
  ``HuggingFaceTokenizer`` reads its BOS and EOS tokens from (``<|bos|>``, ``<|eos|>``);
* ``DIR/c4_test/data.jsonl``: the corpus, one ``{"text": ...}`` line per document
  (documents split as the project's ``text`` source splits them), which torchtitan's
  ``c4_test`` dataset reads with ``datasets.load_dataset(DIR/c4_test, split="train")``
  and the project's ``jsonl`` source reads as it is.

``check`` runs, with the torchtitan on the path (0.2.2 is the one meant), what its
``Trainer.__init__`` does before it touches a device: the TOML through torchtitan's own
``ConfigManager``, the train spec, the tokenizer and the dataloader built by the spec's
builders (one batch read), and the model built on the meta device with its parameter
count and FLOPs per token. It writes what it found as JSON; a failure is recorded there
too (``ok`` false, the error) and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "torchtitan_autoparallel" / "data" / "assets"
BOS, EOS = "<|bos|>", "<|eos|>"  # the shipped tokenizer's special tokens (ids 0 and 1)


def documents(text: str) -> list[str]:
    """Blank lines separate documents (as the project's ``text`` source reads corpus.txt)."""
    return [d.strip() for d in re.split(r"\n\s*\n", text) if d.strip()]


def prepare(out: Path) -> dict:
    tok = out / "tokenizer"
    data = out / "c4_test"
    tok.mkdir(parents=True, exist_ok=True)
    data.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ASSETS / "tokenizer.json", tok / "tokenizer.json")
    added = {t["content"]: t["id"] for t in json.loads((ASSETS / "tokenizer.json").read_text())["added_tokens"]}
    missing = [t for t in (BOS, EOS) if t not in added]
    if missing:
        raise SystemExit(f"error: {ASSETS / 'tokenizer.json'} lacks the special tokens {missing}")
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True,
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}
    (tok / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    docs = documents((ASSETS / "corpus.txt").read_text(encoding="utf-8"))
    with (data / "data.jsonl").open("w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
    return {"tokenizer": str(tok), "dataset_path": str(data), "documents": len(docs)}


def check(config_path: Path, assets: Path, steps: int | None) -> dict:
    import torch
    import torchtitan
    from torchtitan.config import ConfigManager
    from torchtitan.protocols import train_spec as train_spec_module

    found: dict = {"torchtitan": getattr(torchtitan, "__version__", "unknown"), "torch": torch.__version__,
                   "config": str(config_path)}
    args = ["--job.config_file", str(config_path), "--model.hf_assets_path", str(assets / "tokenizer"),
            "--training.dataset_path", str(assets / "c4_test")]
    if steps is not None:
        args += ["--training.steps", str(steps)]
    job = ConfigManager().parse_args(args)
    t = job.training
    found["job"] = {
        "model": f"{job.model.name} {job.model.flavor}", "steps": t.steps, "local_batch_size": t.local_batch_size,
        "seq_len": t.seq_len, "mixed_precision_param": t.mixed_precision_param, "dtype": t.dtype,
        "dataset": t.dataset, "optimizer": f"{job.optimizer.name} lr {job.optimizer.lr} eps {job.optimizer.eps} "
        f"weight_decay {job.optimizer.weight_decay}", "warmup_steps": job.lr_scheduler.warmup_steps,
        "activation_checkpoint": job.activation_checkpoint.mode, "compile": job.compile.enable,
        "data_parallel_shard_degree": job.parallelism.data_parallel_shard_degree,
    }
    spec = train_spec_module.get_train_spec(job.model.name)

    start = time.perf_counter()
    tokenizer = spec.build_tokenizer_fn(job)
    found["tokenizer"] = {"vocab_size": tokenizer.get_vocab_size(), "bos_id": tokenizer.bos_id,
                          "eos_id": tokenizer.eos_id}
    loader = spec.build_dataloader_fn(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, job_config=job)
    inputs, labels = next(iter(loader))
    tokens = inputs["input"] if isinstance(inputs, dict) else inputs
    found["batch"] = {"input_shape": list(tokens.shape), "labels_shape": list(labels.shape),
                      "max_id": int(tokens.max()), "first_id": int(tokens[0, 0]),
                      "read_s": round(time.perf_counter() - start, 2)}

    args_ = spec.model_args[job.model.flavor]
    args_.update_from_config(job)
    with torch.device("meta"):
        model = spec.model_cls(args_)
    params, flops = args_.get_nparams_and_flops(model, t.seq_len)
    found["model"] = {"vocab_size": args_.vocab_size, "dim": args_.dim, "n_layers": args_.n_layers,
                      "parameters": params, "flops_per_token": flops}
    expected = (t.local_batch_size, t.seq_len)
    problems = []
    if tuple(tokens.shape) != expected:
        problems.append(f"batch {tuple(tokens.shape)}, expected {expected}")
    if found["batch"]["max_id"] >= args_.vocab_size:
        problems.append(f"token id {found['batch']['max_id']} out of the model's vocab {args_.vocab_size}")
    if found["torchtitan"] != "0.2.2":
        problems.append(f"torchtitan {found['torchtitan']} on the path; the reference is 0.2.2")
    found["problems"] = problems
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="write the tokenizer folder and the JSON-lines corpus")
    pp.add_argument("--out", type=Path, required=True)
    pc = sub.add_parser("check", help="the torchtitan job's config, tokenizer, data and meta model")
    pc.add_argument("--config", type=Path, required=True)
    pc.add_argument("--assets", type=Path, required=True, help="the folder prepare wrote")
    pc.add_argument("--steps", type=int, help="override training.steps, as check.sh does")
    pc.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    if a.cmd == "prepare":
        print(json.dumps(prepare(a.out)))
        return 0
    try:
        found = check(a.config, a.assets, a.steps)
        found["ok"] = not found["problems"]
    except Exception as e:  # recorded for the summary; the traceback goes to the log
        traceback.print_exc()
        found = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    a.out.write_text(json.dumps(found, indent=2) + "\n")
    print(json.dumps(found, indent=2))
    return 0 if found["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
