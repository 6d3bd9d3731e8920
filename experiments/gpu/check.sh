#!/usr/bin/env bash
# The CUDA + NCCL path on one GPU, through ./run_train.sh as a user runs it:
#   1. the LLaMA3 debug model, planned automatically (fp32, 20 steps);
#   2. LLaMA3-1B in bf16, planned automatically, then through torchtitan's own parallelize;
#   3. the calibrator (matmuls per dtype and copies; one GPU has no link to time), its profile
#      written as $OUT/<gpu>_profile.json (h100, h200, ...: from the GPU's name; gpu if none);
#   4. fp32 matmuls under torch's default precision and with TF32 (matmul_precision.py);
#   5. training-shaped bf16 matmuls against the cost model's price (gemm_shapes.py).
# Arguments name the stages to run (debug_auto 1b_auto 1b_torchtitan calibrate precision gemm);
# none: all of them.
# Made for a one-GPU H100 or H200 machine with its own PyTorch, Python 3.12 and no network: run
# experiments/gpu/fetch_wheels.sh here first, carry .whl, and pass OUT. Each stage has its
# own time limit and log; a failed stage does not stop the next.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to the folder for the logs}
RUNS=/tmp/gpu_runs
mkdir -p "$RUNS"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHON=python3 PYTHONUNBUFFERED=1 NGPU=1

{
  nvidia-smi -L
  python3 -c "import torch, sys; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name())"
  python3 -m pip list 2>/dev/null | grep -Ei '^(numpy|numba|llvmlite|huggingface.hub|fsspec|pyarrow|tokenizers|safetensors|tensorboard) '
  python3 -c "import torchtitan.trainer, torchtitan_autoparallel.train.main; print('imports: ok')"
} > "$OUT/env.txt" 2>&1

# The GPU's model as a lowercase tag ("NVIDIA H200" -> h200), so profiles of different GPUs do not mix.
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null |
      grep -oE '\b[A-Z]{1,2}[0-9]{2,3}[A-Z]?\b' | head -n1 | tr '[:upper:]' '[:lower:]')
GPU=${GPU:-gpu}

STAGES=${*:-debug_auto 1b_auto 1b_torchtitan calibrate precision gemm}
wanted() { [[ " $STAGES " == *" $1 "* ]]; }

stage() {  # name seconds args...
  local name=$1 limit=$2
  shift 2
  wanted "$name" || return 0
  local start=$SECONDS
  timeout "$limit" ./run_train.sh --job.dump_folder "$RUNS/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - start)) s" >> "$OUT/env.txt"
}

stage debug_auto 100 --model.name llama3_auto_parallel --training.steps 20
BIG=(--model.flavor 1B --training.seq_len 2048 --training.local_batch_size 4 --training.steps 15
     --training.mixed_precision_param bfloat16 --metrics.enable_tensorboard false)
stage 1b_auto 150 --model.name llama3_auto_parallel "${BIG[@]}"
stage 1b_torchtitan 80 --model.name llama3 "${BIG[@]}"
if wanted calibrate; then
  start=$SECONDS
  CALIBRATE=1 timeout 60 ./run_train.sh --out "$OUT/${GPU}_profile.json" --repeats 5 > "$OUT/calibrate.log" 2>&1
  echo "calibrate: exit $? after $((SECONDS - start)) s" >> "$OUT/env.txt"
fi
if wanted precision; then
  timeout 60 python3 experiments/gpu/matmul_precision.py --out "$OUT/matmul_precision.json" >> "$OUT/env.txt" 2>&1
  echo "precision: exit $?" >> "$OUT/env.txt"
fi
if wanted gemm; then
  timeout 90 python3 experiments/gpu/gemm_shapes.py --out "$OUT/gemm_shapes.json" > "$OUT/gemm_shapes.log" 2>&1
  echo "gemm: exit $?" >> "$OUT/env.txt"
fi
(cd "$RUNS" && tar czf "$OUT/runs.tgz" --exclude='*.pt' --exclude='plan_cache' --exclude='tb' .)
