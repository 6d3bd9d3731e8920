"""Every rank runs the same plan: one solve on rank 0, checked and broadcast.

Tracing and strategy enumeration are deterministic, so every rank builds the
same problem itself (the executor needs the graph and strategy tables
locally anyway). Only rank 0 solves: a solver with a time limit may return
different incumbents on different ranks, and ranks running different plans
would deadlock or compute garbage. Before the broadcast the ranks compare a
fingerprint of the problem (node names, strategy counts, strategy labels); a
mismatch raises on every rank, naming the first differing node.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch import fx

from torchtitan_autoparallel.planner.problem.build import BuiltProblem
from torchtitan_autoparallel.planner.problem.problem import InfeasibleProblem
from torchtitan_autoparallel.planner.solve.base import Solution, SolverTimeout


class PlanMismatch(RuntimeError):
    """Ranks built different problems, so they cannot share one solution."""


class RemoteSolveError(RuntimeError):
    """Rank 0 failed to solve; raised on the other ranks with rank 0's message."""


@dataclass(frozen=True)
class Fingerprint:
    digest: str
    # One entry per problem node: (name, what it is, number of strategies, hash of their labels).
    entries: tuple[tuple[str, str, int, str], ...]


def fingerprint(built: BuiltProblem) -> Fingerprint:
    problem = built.problem
    entries = tuple(
        (name, _describe(node), len(labels), _sha("\n".join(labels))[:16])
        for name, node, labels in zip(problem.node_names, built.nodes, problem.strategy_labels)
    )
    return Fingerprint(_sha(repr(entries)), entries)


def first_difference(mine: Fingerprint, reference: Fingerprint) -> str | None:
    """None when equal, else a sentence naming the first node that differs."""
    if mine.digest == reference.digest:
        return None
    for i, (a, b) in enumerate(zip(mine.entries, reference.entries)):
        if a != b:
            return (
                f"node #{i}: here {a[0]!r} ({a[1]}) with {a[2]} strategies (labels {a[3]}), "
                f"rank 0 {b[0]!r} ({b[1]}) with {b[2]} strategies (labels {b[3]})"
            )
    return f"{len(mine.entries)} problem nodes here, {len(reference.entries)} on rank 0"


def check_same_problem(built: BuiltProblem, group: dist.ProcessGroup | None = None) -> None:
    """Raise ``PlanMismatch`` on every rank unless all ranks built rank 0's problem."""
    if not _distributed(group):
        return
    mine = fingerprint(built)
    box: list[object] = [mine if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, src=_global(0, group), group=group)
    reference = box[0]
    assert isinstance(reference, Fingerprint)
    diff = first_difference(mine, reference)
    reports: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, diff, group=group)
    bad = [(r, d) for r, d in enumerate(reports) if d is not None]
    if bad:
        rank, detail = bad[0]
        others = f" (and {len(bad) - 1} more ranks)" if len(bad) > 1 else ""
        raise PlanMismatch(
            f"rank {rank}{others} traced a different problem than rank 0: {detail}; "
            "every rank must trace the same model, batch and mesh with the same torch"
        )


def solve_on_rank0(
    built: BuiltProblem, solve: Callable[[], Solution], group: dist.ProcessGroup | None = None
) -> Solution:
    """Rank 0 calls ``solve``; every rank returns its solution (or raises its error)."""
    if not _distributed(group):
        return solve()
    box: list[object] = [None]
    error: BaseException | None = None
    if dist.get_rank(group) == 0:
        try:
            box[0] = solve()
        except Exception as e:  # every rank must learn of it, or the others hang
            error = e
            box[0] = _ErrorReport(type(e).__name__, str(e))
    dist.broadcast_object_list(box, src=_global(0, group), group=group)
    if error is not None:
        raise error
    result = box[0]
    if isinstance(result, _ErrorReport):
        # The planner's own errors keep their type, so callers handle them alike on every rank.
        known = {"InfeasibleProblem": InfeasibleProblem, "SolverTimeout": SolverTimeout}
        raise known.get(result.kind, RemoteSolveError)(f"(on rank 0) {result.message}")
    assert isinstance(result, Solution)
    if len(result.assignment) != built.problem.num_nodes:
        raise PlanMismatch(
            f"rank 0's solution assigns {len(result.assignment)} nodes, this rank's problem has "
            f"{built.problem.num_nodes}"
        )
    return result


def agree_on_solution(
    built: BuiltProblem, solve: Callable[[], Solution], group: dist.ProcessGroup | None = None
) -> Solution:
    """``check_same_problem`` then ``solve_on_rank0``: the one call the trainer needs."""
    check_same_problem(built, group)
    return solve_on_rank0(built, solve, group)


@dataclass(frozen=True)
class _ErrorReport:
    kind: str
    message: str


def _describe(node: fx.Node) -> str:
    """A parameter's FQN, or the op a node calls: what a reader can find in the model."""
    if "fqn" in node.meta:
        return str(node.meta["fqn"])
    return str(node.target) if node.op == "call_function" else node.op


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _global(group_rank: int, group: dist.ProcessGroup | None) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)
