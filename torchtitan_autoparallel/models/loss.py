"""The training loss, shared by the training loop and the planner's trace."""

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

logger = logging.getLogger("torchtitan_autoparallel")


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32 (logits may be bf16 under mixed precision)."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def build_loss_fn(job) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss of a hand-written plan: torch.compile'd when ``[compile]`` names it, as
    torchtitan does (a planned model's loss is part of its compiled step instead)."""
    c = job.compile
    if c.enable and "loss" in c.components:
        logger.info(f"compile: the loss function is compiled by {c.backend}")
        return torch.compile(cross_entropy_loss, backend=c.backend)
    return cross_entropy_loss
