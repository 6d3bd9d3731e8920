"""A rank's data loader for a job: its tokenizer checked against the model, then its share of the dataset."""

from __future__ import annotations

from torchtitan_autoparallel.config import JobConfig
from torchtitan_autoparallel.data.dataset import build_dataloader
from torchtitan_autoparallel.data.tokenizer import load_tokenizer
from torchtitan_autoparallel.errors import ConfigError


def build_data(
    job: JobConfig,
    model_config,
    dp_rank: int,
    dp_degree: int,
    dataset: str | None = None,
    dataset_path: str | None = None,
    shape: tuple[int, int] | None = None,
):
    """This rank's loader of ``dataset`` (default: ``training.dataset``) at ``shape``
    (local batch, sequence length; default: the training step's)."""
    tokenizer = load_tokenizer(job.model.tokenizer_path)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ConfigError(
            f"tokenizer {job.model.tokenizer_path!r} has {tokenizer.vocab_size} tokens but the "
            f"model's vocabulary is {model_config.vocab_size}; accepted: a tokenizer of at most "
            f"{model_config.vocab_size} tokens"
        )
    t = job.training
    return build_dataloader(
        tokenizer,
        dataset=t.dataset if dataset is None else dataset,
        dataset_path=t.dataset_path if dataset is None else dataset_path,
        seq_len=t.seq_len if shape is None else shape[1],
        local_batch_size=t.local_batch_size if shape is None else shape[0],
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        seed=t.seed,
    )
