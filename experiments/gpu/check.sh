#!/usr/bin/env bash
# Training on one GPU, planned automatically, against torchtitan 0.2.2's own trainer on the
# same GPU, model and batch. Stages (arguments pick some; none: the training ones):
#   debug_auto                the LLaMA3 debug model planned automatically, fp32, 20 steps (8 on a CPU)
#   qwen_eager                Qwen3-1.7B bf16 (seq 4096, local batch 4) planned automatically
#   qwen_compiled             the same with compile.enable (inductor)
#   qwen_torchtitan           the same job through `torchrun -m torchtitan.train` and its TOML
#   qwen_torchtitan_compiled  the same, compiled as torchtitan compiles (per block, and the loss)
#   calibrate precision gemm  the cost profile's rates (calibrator, fp32/TF32 matmuls, training-shaped
#                             bf16 matmuls against the cost model)
# Then experiments/gpu/training.py writes $OUT/training.json and $OUT/training.md: tokens/s, MFU,
# peak memory and step time, measured and as the plan predicted them.
#
# Made for a one-GPU machine with its own torch 2.11, Python 3.12 and no network: run
# experiments/gpu/fetch_wheels.sh here first, carry .whl, and pass OUT. Each stage has its own
# time limit and log ($OUT/<stage>.log); a failed stage does not stop the next, and all of them
# together stop within DEADLINE seconds (default 560: one device call). On an 80 GB GPU both
# trainers' Qwen3 runs recompute every block (the job's predicted peak without it is 105 GiB).
# With no GPU (no nvidia-smi) it runs what a CPU can: debug_auto on one CPU rank, Qwen3-1.7B
# planned for an H100 on a fake process group (qwen_plan), and the torchtitan job's config,
# tokenizer, data and meta model checked (qwen_torchtitan_check); training.py then has the
# CPU row only.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to the folder for the logs}
RUNS=${RUNS:-/tmp/gpu_runs}
ASSETS=$RUNS/assets
mkdir -p "$OUT" "$RUNS"
export PYTHON=${PYTHON:-python3} PYTHONUNBUFFERED=1 NGPU=1
PY=$PYTHON
if compgen -G ".whl/*.whl" > /dev/null; then  # fetch_wheels.sh's, for a machine with no network
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl ||
    { echo "error: the wheels in .whl do not install on $("$PY" --version) (fetch_wheels.sh makes them for Python 3.12)" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
fi
GPU_MODE=$(command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1 && echo 1 || echo 0)

{
  [ "$GPU_MODE" = 1 ] && nvidia-smi -L
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  "$PY" -m pip list 2>/dev/null | grep -Ei '^(torch|torchtitan|numpy|numba|datasets|tensorboard|tokenizers) '
  "$PY" -c "import torchtitan.train, torchtitan_autoparallel.launch.main; print('imports: ok')"
} > "$OUT/env.txt" 2>&1

AC=()
if [ "$GPU_MODE" = 1 ]; then
  DEFAULT="debug_auto qwen_eager qwen_compiled qwen_torchtitan qwen_torchtitan_compiled"
  DEBUG_STEPS=20
  # Without recomputation the Qwen3 job's plan predicts a 105 GiB peak (qwen_plan on a CPU):
  # it fits an H200, not an 80 GB card; there both trainers recompute every block.
  GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -n1)
  [ "${GPU_MIB%%.*}" -lt 120000 ] && AC=(--activation_checkpoint.mode full)
else  # a CPU step of the debug model takes seconds, not milliseconds
  DEFAULT="debug_auto qwen_plan qwen_torchtitan_check"
  DEBUG_STEPS=8
fi
STAGES=${*:-$DEFAULT}
wanted() { [[ " $STAGES " == *" $1 "* ]]; }

DEADLINE=${DEADLINE:-560}  # seconds for all stages: one device call is at most 600
run_stage() {  # name seconds command...: the command's output to $OUT/<name>.log, its exit to env.txt
  local name=$1 limit=$2
  shift 2
  wanted "$name" || return 0
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 30 ]; then
    echo "$name: skipped, ${left} s left of DEADLINE=$DEADLINE" >> "$OUT/env.txt"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - start)) s" >> "$OUT/env.txt"
}

ours() {  # name seconds [VAR=value ...] -- run_train.sh args...: a run of ours, dumped to $RUNS/<name>
  local name=$1 limit=$2 vars=()
  shift 2
  wanted "$name" || return 0
  while [ "$1" != "--" ]; do vars+=("$1"); shift; done
  shift
  rm -rf "${RUNS:?}/$name"
  run_stage "$name" "$limit" env "${vars[@]}" ./run_train.sh --job.dump_folder "$RUNS/$name" "$@"
}

QWEN=experiments/gpu/qwen3_1.7b.toml
# One GPU is a 1-D mesh: the planner runs its loops as Python, so no stage pays a compile.
ours debug_auto 150 -- --model.name llama3_auto_parallel --training.steps "$DEBUG_STEPS"
ours qwen_eager 120 CONFIG_FILE=$QWEN -- "${AC[@]}"
# No GPU: the GPU job's plan, priced for an H100, on a fake process group (no training).
ours qwen_plan 300 CONFIG_FILE=$QWEN COMM_MODE=fake_backend -- --autoparallel.cost_profile h100

# torchtitan's own trainer reads the project's tokenizer and corpus from files it expects.
if wanted qwen_torchtitan || wanted qwen_torchtitan_compiled || wanted qwen_torchtitan_check; then
  "$PY" experiments/gpu/torchtitan_job.py prepare --out "$ASSETS" > "$OUT/assets.log" 2>&1
fi
TT_JOB=(--job.config_file experiments/gpu/qwen3_1.7b_torchtitan.toml --model.hf_assets_path "$ASSETS/tokenizer"
        --training.dataset_path "$ASSETS/c4_test")
titan() {  # name seconds torchtitan args...
  local name=$1 limit=$2
  shift 2
  wanted "$name" || return 0
  rm -rf "${RUNS:?}/$name"
  run_stage "$name" "$limit" "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m torchtitan.train \
    "${TT_JOB[@]}" --job.dump_folder "$RUNS/$name" "$@"
}
titan qwen_torchtitan 100 "${AC[@]}"
titan qwen_torchtitan_compiled 130 --compile.enable "${AC[@]}"
# Last: Inductor compiles our whole step (28 blocks, forward and backward) as one graph.
ours qwen_compiled 200 CONFIG_FILE=$QWEN -- --compile.enable true "${AC[@]}"
run_stage qwen_torchtitan_check 120 "$PY" experiments/gpu/torchtitan_job.py check \
  --config experiments/gpu/qwen3_1.7b_torchtitan.toml --assets "$ASSETS" --out "$OUT/torchtitan_check.json"

if wanted calibrate; then
  GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null |
        grep -oE '\b[A-Z]{1,2}[0-9]{2,3}[A-Z]?\b' | head -n1 | tr '[:upper:]' '[:lower:]')
  run_stage calibrate 60 env CALIBRATE=1 ./run_train.sh --out "$OUT/${GPU:-gpu}_profile.json" --repeats 5
fi
run_stage precision 60 "$PY" experiments/gpu/matmul_precision.py --out "$OUT/matmul_precision.json"
run_stage gemm 90 "$PY" experiments/gpu/gemm_shapes.py --out "$OUT/gemm_shapes.json"

"$PY" experiments/gpu/training.py --runs "$RUNS" --logs "$OUT" --out "$OUT" >> "$OUT/env.txt" 2>&1
(cd "$RUNS" && tar czf "$OUT/runs.tgz" --exclude='*.pt' --exclude='plan_cache' --exclude='assets' .)
