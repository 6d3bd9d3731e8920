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

if [ -n "${CALIBRATE:-}" ]; then
  entry=(-m torchtitan_autoparallel.calibrate)
else
  entry=(-m torchtitan_autoparallel.launch.main --job.config_file "$CONFIG_FILE")
fi

NNODES=${NNODES:-1}
if [ "$NNODES" -gt 1 ]; then
  rdzv=(--nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK}" --rdzv-backend c10d
        --rdzv-endpoint "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port}" --rdzv-id "${RDZV_ID:-tap}")
else
  rdzv=(--standalone)  # the launcher keeps its stores and gloo's sockets on 127.0.0.1
fi

# One process counts the GPUs (NGPU defaults to them, or 4 CPU ranks), checks the job
# once before any rank starts (bad input gives one line), and runs torchrun's main.
export COMM_MODE
exec "$PYTHON" -m torchtitan_autoparallel.launch.launch --ngpu "${NGPU:-auto}" "${rdzv[@]}" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 -- \
  "${entry[@]}" "$@"
