#!/usr/bin/env bash
# torchtitan's own job files, run as a torchtitan user would (README.md here has the table).
#   experiments/tt_configs/run.sh [NAME ...]   from the repository root; logs/NAME.log each
# Each case: NGPU, COMM_MODE, the job file, and the arguments added to it.
set -u
cd "$(dirname "$0")/../.."
T=experiments/tt_configs/torchtitan
OUT=${OUT:-/tmp/tt_configs}
mkdir -p experiments/tt_configs/logs "$OUT"

declare -A CASES=(
  [debug02_load]="1|check|$T/llama3_debug_model_0.2.toml|"
  [debug02_plan8]="8|fake_backend|$T/llama3_debug_model_0.2.toml|--model.name llama3_auto_parallel"
  [debug02_train2]="2||$T/llama3_debug_model_0.2.toml|--model.name llama3_auto_parallel"
  [debug02_titan2]="2||$T/llama3_debug_model_0.2.toml|--training.steps 2"
  [debug_mid2025_plan8]="8|fake_backend|$T/llama3_debug_model_mid2025.toml|--model.name llama3_auto_parallel"
  [debug_mid2025_train2]="2||$T/llama3_debug_model_mid2025.toml|--model.name llama3_auto_parallel --training.steps 2"
  [debug_mid2025_c4]="1||$T/llama3_debug_model_mid2025.toml|--training.dataset c4 --training.steps 1"
  [llama3_70b_plan64]="64|fake_backend|$T/llama3_70b_mid2025.toml|--model.name llama3_auto_parallel"
  [llama3_70b_train2]="2||$T/llama3_70b_mid2025.toml|"
  [qwen3_0.6b_plan8]="8|fake_backend|$T/qwen3_0.6b.toml|--model.name qwen3_auto_parallel"
  [qwen3_0.6b_train2]="2||$T/qwen3_0.6b.toml|"
  [qwen3_1.7b_plan8]="8|fake_backend|$T/qwen3_1.7b.toml|--model.name qwen3_auto_parallel"
)

for name in "${@:-${!CASES[@]}}"; do
  IFS='|' read -r ngpu mode file extra <<<"${CASES[$name]}"
  log=experiments/tt_configs/logs/$name.log
  start=$(date +%s.%N)
  if [ "$mode" = check ]; then  # the file alone: what loading it says
    .venv/bin/python -c "import sys; from torchtitan_autoparallel.config import load_config; load_config(sys.argv[1:])" \
      --job.config_file "$file" >"$log" 2>&1
  else
    # shellcheck disable=SC2086  # the added arguments split on spaces
    NGPU=$ngpu COMM_MODE=$mode CONFIG_FILE=$file ./run_train.sh $extra --job.dump_folder "$OUT/$name" >"$log" 2>&1
  fi
  rc=$?
  printf '%s: NGPU=%s COMM_MODE=%s %s %s -> exit %s in %.1f s\n' "$name" "$ngpu" "$mode" "$file" "$extra" "$rc" \
    "$(echo "$(date +%s.%N) - $start" | bc)" | tee -a "$log"
done
