"""Does a plan train like one device? A self-check runnable under torchrun.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        -m torchtitan_autoparallel.execute.parity --mesh dp_shard=2,tp=2 --out /tmp/parity.json

Every rank plans the LLaMA3 (or Qwen3) debug model (rank 0 solves), places the same
seeded full init as planned, and trains a few AdamW steps on seeded random
batches; rank 0 writes the per-step losses (and, with ``--audit``, the
expected and executed collective counts) as JSON. ``reference_losses`` runs
the same steps unsharded in one process (``model(tokens)`` + the trainer's
loss), for comparison. ``tests/execute/test_execute.py`` drives both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from torchtitan_autoparallel.execute.audit import audit
from torchtitan_autoparallel.execute.compiled import graph_collectives
from torchtitan_autoparallel.execute.optim import build_adamw, optimizer_step
from torchtitan_autoparallel.execute.pipeline import plan_and_build
from torchtitan_autoparallel.execute.step import FullValues
from torchtitan_autoparallel.mesh.runtime import exit_process
from torchtitan_autoparallel.models.loss import cross_entropy_loss
from torchtitan_autoparallel.models.registry import build_meta_model, build_model_config
from torchtitan_autoparallel.planner.cost.profiles import load_profile
from torchtitan_autoparallel.planner.plan.api import FIT_RESERVE
from torchtitan_autoparallel.planner.plan.options import PlannerOptions
from torchtitan_autoparallel.planner.strategies.strided import has_strided


@dataclass(frozen=True)
class ParityConfig:
    family: str = "llama3"  # or "qwen3" (its debug model)
    layers: int = 2
    batch: int = 4
    seq_len: int = 32
    steps: int = 3
    lr: float = 1e-3
    seed: int = 0
    max_norm: float = 1.0
    weight_decay: float = 0.1
    portable_kernels: int = 0  # 1: attention through kernels.py's stand-ins (what a GPU runs)
    local_batch: int = 0  # 1: feed each rank its slice (step_local), as a sharded dataloader does
    compile: int = 0  # 1: re-trace into a local-tensor graph before training (compiled.py)
    overlap_execution: int = 0  # 1: with compile, reorder that graph for overlap (overlap.py)
    bucket_collectives: int = 0  # 1: with compile, merge that graph's collectives (bucketing.py)
    strided_sharding: int = 0  # 1: plan with [autoparallel] strided_sharding
    plan_overlap: int = 0  # 1: plan with [autoparallel] overlap (the savings model)
    solver: str = "ilp"  # [autoparallel] solver; approx keeps a 3-D mesh's plan to seconds
    # the recomputation planned and run: none, selective, full, or one per block ("full,none")
    activation_checkpoint: str = "none"
    # > 0: plan for a device whose usable memory is this share of the unbounded plan's peak
    fit_share: float = 0.0


@dataclass
class ParityResult:
    losses: list[float]
    grad_norms: list[float]
    expected: dict[str, int] = field(default_factory=dict)
    executed: dict[str, int] = field(default_factory=dict)
    compiled_collectives: dict[str, int] = field(default_factory=dict)  # calls in the local graph
    overlap_stats: dict[str, float] = field(default_factory=dict)  # overlap.OverlapStats, when scheduled
    bucket_stats: dict = field(default_factory=dict)  # bucketing.BucketStats, when merged
    local_ops: dict[str, int] = field(default_factory=dict)
    plan_timings: dict[str, float] = field(default_factory=dict)
    step_seconds: list[float] = field(default_factory=list)
    strided_nodes: int = 0  # planned nodes with a _StridedShard input or output
    # with fit_share: the unbounded plan's and the fitted plan's peaks and step costs, the usable bytes
    fit: dict[str, float] = field(default_factory=dict)
    recompute: str = ""  # the recomputation the plan run was traced with (what "auto" chose)


# ---------------------------------------------------------------- shared by both sides


def full_model(cfg: ParityConfig, layers: int | None = None) -> nn.Module:
    """The unsharded model with the trainer's seeded init (``train/setup.py::_materialize``)."""

    config = build_model_config(cfg.family, "debugmodel", layers or cfg.layers)
    torch.manual_seed(cfg.seed)
    with torch.device("cpu"):
        model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def batch(cfg: ParityConfig, step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + 97 * cfg.seed + step)
    tokens = torch.randint(0, vocab, (cfg.batch, cfg.seq_len), generator=g)
    labels = torch.randint(0, vocab, (cfg.batch, cfg.seq_len), generator=g)
    return tokens, labels


def _vocab(model: nn.Module) -> int:
    return model.tok_embeddings.weight.shape[0]


def reference_losses(cfg: ParityConfig) -> list[float]:
    """Per-step losses of the unsharded eager model on one process."""

    model = full_model(cfg)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay, foreach=False
    )
    losses = []
    for step in range(cfg.steps):
        tokens, labels = batch(cfg, step, _vocab(model))
        opt.zero_grad(set_to_none=True)
        loss = cross_entropy_loss(model(tokens), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm, foreach=False)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def plan_parity(cfg: ParityConfig, mesh, full: nn.Module, layers: int | None = None, **planner_kwargs):
    """``cfg``'s model (``layers`` blocks, default ``cfg.layers``) planned on ``mesh`` and
    placed with ``full``'s values: ``pipeline.plan_and_build``'s result."""

    return plan_and_build(
        build_meta_model(cfg.family, "debugmodel", n_layers=cfg.layers if layers is None else layers),
        mesh,
        lambda plan: FullValues.of(full),
        PlannerOptions(
            global_batch_size=cfg.batch,
            seq_len=cfg.seq_len,
            profile=load_profile("h100" if mesh.device_type == "cuda" else "cpu_gloo"),
            strided_sharding=bool(cfg.strided_sharding),
            overlap=bool(cfg.plan_overlap),
            solver=cfg.solver,
            **{**_recompute(cfg.activation_checkpoint), **planner_kwargs},
        ),
        portable_kernels=bool(cfg.portable_kernels),
    )


def _recompute(modes: str) -> dict:
    """Planner options for ``ParityConfig.activation_checkpoint``."""
    blocks = tuple(modes.split(","))
    if len(blocks) == 1:
        return {"activation_checkpoint": modes}
    return {"activation_checkpoint": "full", "block_recompute": blocks}


# ---------------------------------------------------------------- the distributed side


def run_planned(
    cfg: ParityConfig, names: tuple[str, ...], sizes: tuple[int, ...], *, do_audit: bool, mismatch: bool = False
) -> ParityResult:
    """Plan, place and train on the current process group; every rank returns the same result."""

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
    full = full_model(cfg)
    # --mismatch: rank 1 traces one layer fewer, to show the agreement check fires.
    layers = cfg.layers - 1 if mismatch and dist.get_rank() == 1 else cfg.layers
    planned = plan_parity(cfg, mesh, full, layers)
    fit = {}
    if cfg.fit_share:
        free = planned.plan
        usable = cfg.fit_share * free.predicted["peak_bytes_per_device"]
        planned = plan_parity(cfg, mesh, full, layers, device_memory_gib=usable / (1 - FIT_RESERVE) / 2**30)
        fit = {"usable": usable, "free_peak": free.predicted["peak_bytes_per_device"], "free_objective": free.objective,
               "peak": planned.plan.predicted["peak_bytes_per_device"], "objective": planned.plan.objective}
    step = planned.step
    result = ParityResult(losses=[], grad_norms=[], plan_timings=dict(planned.plan.timings), fit=fit,
                          recompute=planned.plan.activation_checkpoint)
    result.strided_nodes = _strided_nodes(planned)
    if do_audit:
        expected, executed = audit(step, planned.plan, *batch(cfg, 0, _vocab(full)))
        result.expected, result.executed = dict(expected), dict(executed)
    if cfg.local_batch:
        # The trainer's path: a meta model holds the planned parameters for the optimizer.
        model = step.bind_to(build_meta_model(cfg.family, "debugmodel", n_layers=layers))
        assert all(a is b for a, b in zip(model.parameters(), step.parameters()))
    if cfg.compile:

        tokens, labels = batch(cfg, 0, _vocab(full))
        step.overlap_execution = bool(cfg.overlap_execution)
        step.bucket_collectives = bool(cfg.bucket_collectives)
        if cfg.local_batch:
            dp_rank, dp_degree = step.data_parallel_coords()
            step.compile_local(tokens.chunk(dp_degree)[dp_rank], labels.chunk(dp_degree)[dp_rank])
        else:
            step.compile(tokens, labels)
        result.compiled_collectives = dict(graph_collectives(step.local_graph))
        result.overlap_stats = asdict(step.overlap_stats) if step.overlap_stats else {}
        result.bucket_stats = asdict(step.bucket_stats) if step.bucket_stats else {}
    opt = build_adamw(step, cfg.lr, weight_decay=cfg.weight_decay)
    dp_rank, dp_degree = step.data_parallel_coords()
    for i in range(cfg.steps):
        start = time.perf_counter()
        tokens, labels = batch(cfg, i, _vocab(full))
        if cfg.local_batch:
            loss, grads = step.step_local(tokens.chunk(dp_degree)[dp_rank], labels.chunk(dp_degree)[dp_rank])
        else:
            loss, grads = step.step(tokens, labels)
        norm = optimizer_step(step, opt, grads, cfg.max_norm)
        result.step_seconds.append(time.perf_counter() - start)
        result.losses.append(float(loss))
        result.grad_norms.append(float(norm) if norm is not None else float("nan"))
    result.local_ops = step.local_ops()
    return result


def _strided_nodes(planned) -> int:

    chosen = planned.executable.chosen.values()
    return sum(any(map(has_strided, (*s.outputs, *s.inputs))) for s in chosen)


def parse_mesh(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """'dp_shard=2,tp=2' -> (('dp_shard', 'tp'), (2, 2))."""
    pairs = [item.split("=") for item in text.split(",") if item]
    return tuple(n for n, _ in pairs), tuple(int(s) for _, s in pairs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", required=True, help="e.g. dp_shard=2,tp=2")
    parser.add_argument("--out", required=True, help="JSON written by rank 0")
    parser.add_argument("--audit", action="store_true")
    parser.add_argument("--mismatch", action="store_true", help="rank 1 traces another model (tests the check)")
    for f in ParityConfig.__dataclass_fields__.values():
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = parser.parse_args(argv)
    cfg = ParityConfig(**{k: getattr(args, k) for k in ParityConfig.__dataclass_fields__})
    names, sizes = parse_mesh(args.mesh)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    if dist.get_world_size() != math.prod(sizes):
        raise SystemExit(f"--mesh {args.mesh} needs {math.prod(sizes)} ranks, launched {dist.get_world_size()}")
    try:
        result: dict = asdict(run_planned(cfg, names, sizes, do_audit=args.audit, mismatch=args.mismatch))
    except Exception as e:  # report the error as data: the test checks its text
        result = {"error": f"{type(e).__name__}: {e}"}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":

    main()
    exit_process(0)
