"""Weights & Biases logging (``metrics.enable_wandb``, as torchtitan): rank 0 starts one run.

The project is ``$WANDB_PROJECT`` (default ``torchtitan_autoparallel``), the run
name ``$WANDB_RUN_NAME`` or the job's description, and its files go under the
dump folder. Without network or login, ``WANDB_MODE=offline`` keeps the run on
disk for ``wandb sync`` later. ``MetricsLogger`` logs the same values as to
TensorBoard, under torchtitan's names where torchtitan logs them
(``loss_metrics/global_avg_loss``, ``throughput(tps)``, ``mfu(%)``,
``validation_metrics/loss``, ...) and ours under ``train/`` for the rest.
"""

from __future__ import annotations

import os
from pathlib import Path

from torchtitan_autoparallel.config import JobConfig
from torchtitan_autoparallel.errors import UserError

DEFAULT_PROJECT = "torchtitan_autoparallel"


def start_run(job: JobConfig):
    """The started wandb run; a failure to start (no login, no network) is one line."""
    import wandb

    folder = Path(job.job.dump_folder)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return wandb.init(
            project=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT),
            name=os.environ.get("WANDB_RUN_NAME") or job.job.description,
            dir=str(folder),
            config=job.to_dict(),
        )
    except Exception as e:  # wandb raises its own errors and plain ones alike
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"metrics.enable_wandb: wandb could not start a run ({first}); accepted: `wandb login` "
            f"(or WANDB_API_KEY), WANDB_MODE=offline to keep the run on disk, or enable_wandb = false"
        ) from None
