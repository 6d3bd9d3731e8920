"""Training-shaped bf16 matmuls on this GPU against the cost model's price for them.

The shapes of LLaMA3-8B and 70B projections (8192 local tokens; every weight whole
and cut 2, 4 and 8 ways as tensor parallelism cuts it, on its output or its input
dim), forward only: the backward's two matmuls per projection have the same sizes
transposed. Priced by ``cost_model.compute_time_us`` with the built-in profile of
this GPU (``h100`` where it has none; the JSON's ``profile`` names it); timed with
CUDA events over 20 calls after 3 warm-ups.

    python3 experiments/gpu/gemm_shapes.py --out gemm_shapes.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from matmul_precision import mm_us  # beside this script

from torchtitan_autoparallel.planner.cost.cost_model import compute_time_us
from torchtitan_autoparallel.planner.cost.profiles import default_profile_name, load_profile

TOKENS = 8192
MODELS = {"8B": (4096, 14336, 1024), "70B": (8192, 28672, 1024)}  # dim, ffn hidden, kv dim


def projections(dim: int, hidden: int, kv: int) -> dict[str, tuple[int, int]]:
    """(in, out) features of each weight."""
    return {"wq": (dim, dim), "wkv": (dim, 2 * kv), "wo": (dim, dim), "w1": (dim, hidden), "w2": (hidden, dim)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    # This GPU's own numbers (an H200's memory is faster than an H100's), as the trainer picks them.
    profile_name = default_profile_name("cuda", False, torch.cuda.get_device_name())
    profile = load_profile(profile_name)
    rows = []
    for model, dims in MODELS.items():
        for name, (k_full, n_full) in projections(*dims).items():
            for tp in (1, 2, 4, 8):
                for cut, (k, n) in (("out", (k_full, n_full // tp)), ("in", (k_full // tp, n_full))):
                    if tp == 1 and cut == "in":
                        continue
                    flops, nbytes = 2.0 * TOKENS * k * n, 2.0 * (TOKENS * k + k * n + TOKENS * n)
                    measured = mm_us(TOKENS, k, n, torch.bfloat16)
                    predicted = compute_time_us(flops, nbytes, torch.bfloat16, profile)
                    rows.append({"model": model, "weight": name, "tp": tp, "cut": cut, "m": TOKENS, "k": k, "n": n,
                                 "measured_us": round(measured, 2), "predicted_us": round(predicted, 2),
                                 "tflops": round(flops / measured / 1e6, 1), "ratio": round(measured / predicted, 3)})
                    print(rows[-1], flush=True)
    ratios = [r["ratio"] for r in rows]
    summary = {"rows": len(rows), "median_ratio": statistics.median(ratios), "min_ratio": min(ratios),
               "max_ratio": max(ratios)}
    print(summary)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "profile": profile_name,
                   "summary": summary, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
