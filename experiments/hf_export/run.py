#!/usr/bin/env python
"""Do Hugging Face transformers read our exported weights as the same model?

For each model (LLaMA3 and Qwen3 debug models) a training job runs as a user
would: the automatic plan with tensor parallelism on 2 CPU ranks, 3 steps,
``[validation]`` on its own first training batch after the last step, and the
last save exported with ``--checkpoint.last_save_in_hf true``. Then, in this
process, transformers' ``AutoModelForCausalLM.from_pretrained`` loads the
export folder as it is (our ``config.json``, the safetensors and their index)
and scores the same batch. The export is right when transformers' loss equals
the loss the job logged for those weights: names, the rotary permutation of
the query/key weights, tied embeddings and the config (sizes, norms, RoPE
scaling) all show in it.

transformers is not a dependency of the project: this script installs it
into a scratch folder (``--target``) on first use, so it needs the package
registry.

    .venv/bin/python experiments/hf_export/run.py

Writes ``results.json`` and ``README.md`` beside this file.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests"))

from _run import CONFIGS, read_metrics, run_launcher  # noqa: E402

TRANSFORMERS = "transformers==5.24.0"
SCRATCH = Path(tempfile.gettempdir()) / "tap_hf_export_transformers"
STEPS, SEQ_LEN, BATCH = 3, 64, 4
TOLERANCE = 1e-5  # relative; fp32 weights, the same batch, two implementations


def ensure_transformers() -> None:
    if not (SCRATCH / "transformers").is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(SCRATCH), "--no-deps",
             TRANSFORMERS, "regex", "typing_extensions"],
            check=True,
        )
    sys.path.insert(0, str(SCRATCH))


def train_and_export(model: str, dump: Path) -> tuple[Path, float]:
    args = [
        "--model.name", f"{model}_auto_parallel", "--parallelism.tensor_parallel_degree", "2",
        "--job.dump_folder", str(dump), "--training.steps", str(STEPS), "--training.seq_len", str(SEQ_LEN),
        "--training.local_batch_size", str(BATCH), "--metrics.peak_tflops", "1",
        "--metrics.enable_tensorboard", "false",
        "--checkpoint.enable", "true", "--checkpoint.last_save_model_only", "true",
        "--checkpoint.last_save_in_hf", "true",
        "--validation.enable", "true", "--validation.freq", str(STEPS), "--validation.steps", "1",
    ]
    run = run_launcher(args, ngpu=2, config=CONFIGS[model])
    if run.returncode != 0:
        raise SystemExit(run.tail())
    validated = [r["validation_loss"] for r in read_metrics(dump) if r.get("step") == STEPS and "validation_loss" in r]
    return dump / "checkpoint" / f"step-{STEPS}", validated[0]


def first_batch(model: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The job's first global batch (what its validation scored)."""
    from torchtitan_autoparallel.data.dataset import build_dataloader
    from torchtitan_autoparallel.data.tokenizer import load_tokenizer

    loader = build_dataloader(load_tokenizer("default"), seq_len=SEQ_LEN, local_batch_size=BATCH, seed=0)
    return next(iter(loader))


def hf_loss(model: str, export: Path) -> float:
    """transformers' loss on the job's first batch, from the export folder as it is
    (our config.json, the safetensors and their index)."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    expected = {"llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model]
    if type(hf_model).__name__ != expected:
        raise SystemExit(f"{model}: transformers built {type(hf_model).__name__}, not {expected}")
    inputs, labels = first_batch(model)
    with torch.no_grad():
        logits = hf_model(input_ids=inputs).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()))


def main() -> int:
    ensure_transformers()
    import transformers

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in ("llama3", "qwen3"):
            export, logged = train_and_export(model, Path(tmp) / model)
            got = hf_loss(model, export)
            rel = abs(got - logged) / abs(logged)
            rows.append({"model": f"{model} debugmodel", "logged_validation_loss": logged,
                         "transformers_loss": got, "relative_difference": rel, "ok": rel <= TOLERANCE})
            print(json.dumps(rows[-1]), flush=True)
    result = {
        "transformers": transformers.__version__, "torch": torch.__version__, "tolerance": TOLERANCE,
        "job": f"auto plan, TP 2 on 2 CPU ranks, {STEPS} steps, seq_len {SEQ_LEN}, batch {BATCH}",
        "command": ".venv/bin/python experiments/hf_export/run.py", "rows": rows,
    }
    (HERE / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# Hugging Face export check", "",
        f"Command: `{result['command']}` (transformers {result['transformers']}, torch {result['torch']}; "
        f"{result['job']}).", "",
        "Each row: the validation loss the training job logged after its last step (its first batch, "
        "scored by torchtitan's model under the automatic plan) and the loss of the model transformers' "
        "`AutoModelForCausalLM.from_pretrained` builds from the export folder as it is (our config.json "
        "and safetensors) on that batch.", "",
        "| model | logged loss | transformers loss | relative difference | within 1e-5 |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['logged_validation_loss']:.6f} | {r['transformers_loss']:.6f} | "
                     f"{r['relative_difference']:.1e} | {'yes' if r['ok'] else 'no'} |")
    (HERE / "README.md").write_text("\n".join(lines) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
