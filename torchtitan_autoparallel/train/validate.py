"""Validation as torchtitan's ``[validation]``: the mean loss over a fixed set of
batches, after step 1 and after every ``validation.freq``-th step.

Every validation reads the same batches (the loader is rewound to its start),
so its losses are comparable across steps. Batches have the training step's
shape (``local_batch_size`` x ``seq_len`` per data-parallel rank) unless
``[validation]`` sets its own for a hand-written plan: a planned step is
planned for one shape, so the automatic path computes the loss with
the compiled planned step less what only the gradients need
(``execute.compiled.loss_only_graph``; interpreted, the whole step runs and
its gradients are dropped). The hand-written path runs the forward only,
under ``no_grad``.

Validation time is kept out of the step timings (tokens/s, MFU, the plan
check): ``MetricsLogger.log_validation`` moves their clocks past it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from torchtitan_autoparallel.config import JobConfig
from torchtitan_autoparallel.config.validate import validation_shape
from torchtitan_autoparallel.data.loader import build_data
from torchtitan_autoparallel.errors import ConfigError

logger = logging.getLogger("torchtitan_autoparallel")
PROGRESS_MIN_BATCHES = 20  # a validation this long logs its progress
PROGRESS_PARTS = 5  # ... every fifth of the way


@dataclass
class ValidationResult:
    step: int
    loss: float  # mean over the batches of each batch's global mean token loss
    batches: int
    seconds: float


class Validator:
    def __init__(self, loader, batches: int, freq: int) -> None:
        self.loader = loader
        self.batches = batches
        self.freq = freq
        self._start = loader.state_dict()

    def due(self, step: int) -> bool:
        return step == 1 or step % self.freq == 0

    def run(self, training, step: int) -> ValidationResult:
        """Mean validation loss of ``training`` (a ``setup.Training``) at ``step``."""
        start = time.perf_counter()
        self.loader.load_state_dict(self._start)
        training.model.eval()
        losses = []
        every = self.batches // PROGRESS_PARTS if self.batches >= PROGRESS_MIN_BATCHES else 0
        try:
            for i in range(1, self.batches + 1):
                losses.append(training.validation_loss(next(self.loader)))
                if every and i % every == 0 and i < self.batches:  # a long pass shows it is moving
                    logger.info(f"validate step: {step:2d}  {i}/{self.batches} batches ({time.perf_counter() - start:.0f} s)")
        finally:
            training.model.train()
        loss = float(torch.stack(losses).mean())  # one host sync for the whole pass
        return ValidationResult(step, loss, self.batches, time.perf_counter() - start)


def build_validator(job: JobConfig, model_config, dp_rank: int, dp_degree: int) -> Validator | None:
    """The job's validator, or None when ``validation.enable`` is off."""
    v = job.validation
    if not v.enable:
        return None
    t = job.training
    if (v.dataset, v.dataset_path) == (t.dataset, t.dataset_path):
        logger.warning(
            "validation reads the training dataset: its loss is not a held-out loss "
            "(set validation.dataset and validation.dataset_path to other data)"
        )
    shape = validation_shape(job)
    loader = build_data(job, model_config, dp_rank, dp_degree, v.dataset, v.dataset_path, shape)
    batches = v.steps if v.steps != -1 else _batches_per_pass(loader, v.dataset_path or v.dataset)
    logger.info(
        f"validation: {batches} batch(es) of {loader.global_batch_size} x {loader.seq_len} tokens "
        f"after step 1 and every {v.freq} steps"
    )
    return Validator(loader, batches, v.freq)


def _batches_per_pass(loader, source: str) -> int:
    batches = loader.batches_per_pass()
    if not batches:  # validate.py refuses a stream with steps = -1: here the corpus is short
        raise ConfigError(
            f"validation.steps = -1: {source!r} holds less than one global batch "
            f"({loader.global_batch_size} samples of {loader.seq_len + 1} tokens); "
            f"accepted: a larger validation dataset, or validation.steps >= 1 (batches wrap around)"
        )
    return batches
