"""AdamW and the warm-up / stable / decay learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from torchtitan_autoparallel.config.job_config import LRScheduler, Optimizer


def build_optimizer(model: nn.Module, cfg: Optimizer) -> torch.optim.Optimizer:
    cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    # foreach=False keeps DTensor parameters on the per-parameter path, which
    # gives bitwise the same update as an unsharded run.
    return cls(
        model.parameters(),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=False,
    )


def lr_factor(step: int, total_steps: int, cfg: LRScheduler) -> float:
    """Multiplier of the base lr at 1-based ``step``: linear warm-up, flat, then decay."""
    warmup = cfg.warmup_steps
    if step <= warmup:
        return step / (warmup + 1)
    after = max(total_steps - warmup, 1)
    decay_steps = after if cfg.decay_ratio is None else max(round(after * cfg.decay_ratio), 1)
    decay_start = total_steps - decay_steps
    if step <= decay_start:
        return 1.0
    progress = min((step - decay_start) / decay_steps, 1.0)
    if cfg.decay_type == "linear":
        shape = 1.0 - progress
    elif cfg.decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, cfg: LRScheduler, done_steps: int = 0
) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule positioned for training step ``done_steps + 1`` (resume passes the saved step)."""
    # LambdaLR takes one step at construction, so last_epoch ends at done_steps;
    # its lambda sees k = steps already taken, and step k + 1 is the one to run.
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: lr_factor(k + 1, total_steps, cfg), last_epoch=done_steps - 1
    )
