#!/usr/bin/env bash
# Launch a training job in torchtitan's style.
#
#   NGPU=4 CONFIG_FILE=train_configs/llama3_debugmodel.toml ./run_train.sh --training.steps 20
#
# Environment:
#   NGPU         ranks on this node (default 4 on a CPU machine, else the GPU count)
#   CONFIG_FILE  the TOML job file (default: the LLaMA3 debug model)
#   LOG_RANK     comma-separated ranks whose output is shown (default 0)
#   COMM_MODE    "fake_backend": one process plays rank 0 of NGPU ranks on a
#                fake process group (check configs, plan for clusters you don't have)
#   NNODES, NODE_RANK, RDZV_ENDPOINT (host:port), RDZV_ID: multi-node runs through
#                torchrun's c10d rendezvous (see scripts/slurm_train.sbatch)
#   CALIBRATE=1  measure this cluster and write a cost profile instead of training;
#                the arguments are the calibrator's (--out profile.json, see
#                python -m torchtitan_autoparallel.calibrate --help)
# Every other argument is a --section.key value override of the TOML file.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
CONFIG_FILE=${CONFIG_FILE:-train_configs/llama3_debugmodel.toml}
LOG_RANK=${LOG_RANK:-0}
COMM_MODE=${COMM_MODE:-}

gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$gpus" -gt 0 ]; then NGPU=${NGPU:-$gpus}; else NGPU=${NGPU:-4}; fi

if [ -n "${CALIBRATE:-}" ]; then
  entry=(-m torchtitan_autoparallel.calibrate)
else
  entry=(-m torchtitan_autoparallel.train.main --job.config_file "$CONFIG_FILE")
  # Check the configuration once, before any rank starts: bad input gives one line.
  "$PYTHON" -m torchtitan_autoparallel.train.preflight --ngpu "$NGPU" --job.config_file "$CONFIG_FILE" "$@"
fi

if [ "$COMM_MODE" = "fake_backend" ] && [ -z "${CALIBRATE:-}" ]; then
  NGPU=$NGPU COMM_MODE=$COMM_MODE exec "$PYTHON" -m torchtitan_autoparallel.train.main \
    --job.config_file "$CONFIG_FILE" "$@"
fi

if [ "$gpus" -eq 0 ]; then
  # CPU ranks share the cores: give each an equal slice so they don't thrash.
  cores=$(nproc)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / NGPU > 0 ? cores / NGPU : 1 ))}
fi

NNODES=${NNODES:-1}
if [ "$NNODES" -gt 1 ]; then
  rdzv=(--nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK}" --rdzv-backend c10d
        --rdzv-endpoint "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port}" --rdzv-id "${RDZV_ID:-tap}")
else
  rdzv=(--standalone)
fi

exec "$PYTHON" -m torch.distributed.run --nproc-per-node "$NGPU" "${rdzv[@]}" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  "${entry[@]}" "$@"
