"""fp32 matmul throughput on this GPU under torch's default precision and with TF32, beside bf16.

The built-in ``h100`` profile priced float32 matmuls at TF32 rates; the trainer keeps
torch's default ``float32_matmul_precision`` ("highest"), which runs them on the FP32
cores. This measures both, so the profile can say what a run gets.

    python3 experiments/gpu/matmul_precision.py --out matmul_precision.json
"""

from __future__ import annotations

import argparse
import json

import torch


def mm_us(m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 20) -> float:
    """Microseconds per (m x k) @ (k x n) matmul, by CUDA events over ``repeats`` calls after 3 warm-ups."""
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    for _ in range(3):
        torch.mm(a, b)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        torch.mm(a, b)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats


def tflops(n: int, dtype: torch.dtype, precision: str) -> float:
    torch.set_float32_matmul_precision(precision)
    return 2 * n**3 / mm_us(n, n, n, dtype) / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rows = []
    for n in (4096, 8192):
        for dtype, precision in ((torch.float32, "highest"), (torch.float32, "high"), (torch.bfloat16, "highest")):
            rows.append({"n": n, "dtype": str(dtype).removeprefix("torch."), "float32_matmul_precision": precision,
                         "tflops": round(tflops(n, dtype, precision), 1)})
            print(rows[-1], flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
