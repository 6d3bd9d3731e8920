"""The training loss, shared by the training loop and the planner's trace."""

import torch
import torch.nn.functional as F


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32 (logits may be bf16 under mixed precision)."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
