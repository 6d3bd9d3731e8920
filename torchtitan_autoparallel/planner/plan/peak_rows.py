"""The whole per-device peak of a plan, and the memory row that bounds it in the solve.

``memory.walk`` gives each allocation of the planned step its size and its
lifetime. At one graph position the live bytes split into terms, each set by
one node's choice:

* an allocation's bytes are its producer's output under the producer's
  strategy, except while only views keep it alive: then the latest view in
  force decides what is kept, through the placement it reads its input in
  (a view whose input is redistributed owns the redistributed buffer; one
  that reads it as is keeps the producer's). FSDP's ``w.t()``, used by the
  forward matmul and again by the backward's, is the case that matters: read
  gathered, the whole weight lives from one to the other; read sharded, each
  matmul gathers its own transient copy;
* the running op's redistributed inputs are its input placements' bytes;
* each reduced gradient made so far is its parameter's placement's bytes;
* the parameters and the optimizer's two states are three copies of each
  parameter at its placement.

* a collective's buffers (a merged gather's, a backend's scratch) scale with
  the placement of the tensor they hold, under the choice of the node that
  sets it; what no node's choice moves is the row's constant.

The lifetimes and which inputs get redistributed are read from the plan the
row was made from, so the row is exact for that plan and a linear estimate
for the others: the solve
(``planner.solve.rows``) bounds it, and the caller walks the new plan again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
from torch import fx

from torchtitan_autoparallel.planner.plan.buckets import runs_on_gloo
from torchtitan_autoparallel.planner.plan.memory import (
    OPTIMIZER_STATE_COPIES,
    Timeline,
    is_alias,
    live_at,
    live_totals,
    local_bytes,
    output_bytes,
    part_bytes,
    walk,
)
from torchtitan_autoparallel.planner.problem.build import GRAD_EDGE, BuiltProblem, EdgeInfo
from torchtitan_autoparallel.planner.problem.problem import InfeasibleProblem, Problem
from torchtitan_autoparallel.planner.problem.rows import GIB, MemoryRow
from torchtitan_autoparallel.planner.solve.base import Solution
from torchtitan_autoparallel.planner.solve.exact.ilp import IlpSolver
from torchtitan_autoparallel.planner.solve.rows import solve_with_rows
from torchtitan_autoparallel.planner.strategies.rules import VIEW_OPS
from torchtitan_autoparallel.planner.strategies.strategy import Strategy
from torchtitan_autoparallel.planner.trace.trace import TracedStep

log = logging.getLogger("torchtitan_autoparallel.planner")


class StepMemory:
    """One plan's walk: its whole peak, and the row that bounds any position of it."""

    def __init__(self, built: BuiltProblem, traced: TracedStep, assignment: np.ndarray) -> None:
        self.built, self.traced = built, traced
        self.x = np.asarray(assignment, dtype=np.int64)
        self.chosen = {n: built.strategies(n)[int(self.x[i])] for i, n in enumerate(built.nodes)}
        self.mesh = built.table.mesh.sizes
        self.t, _ = walk(traced, self.chosen, built.edge_parts, self.mesh, runs_on_gloo(built.profile.name))
        self.state = (1 + OPTIMIZER_STATE_COPIES) * float(built.problem.memory_used(self.x))
        self.totals = live_totals(self.t) + self.state

    @property
    def at(self) -> int:
        return int(np.argmax(self.totals))

    @property
    def peak(self) -> float:
        return float(self.totals[self.at])

    def row(self, at: int, limit: float) -> MemoryRow:
        """The live bytes at graph position ``at`` as a linear function of the plan."""
        terms: dict[int, np.ndarray] = {}

        def add(node: fx.Node, vector: np.ndarray) -> None:
            v = self.built.index(node)
            terms[v] = terms[v] + vector if v in terms else vector

        t = self.t
        for owner, _ in live_at(t, at):
            holder = _holder(t, owner, at)
            if holder is not owner or (is_alias(owner) and owner.target in VIEW_OPS):
                add(holder, self._read_bytes(holder))
            elif owner in self.chosen:
                add(owner, self._strategy_bytes(owner, lambda node, s: output_bytes(node, s, self.mesh)))
        self._add_transients(t.order[at], add)
        self._add_held(at, add)
        self._add_state(at, add)
        row = MemoryRow(terms=terms, const=0.0, limit=limit, where=t.order[at].name)
        # what no node's choice moves here: the collectives' buffers (and any
        # lifetime the terms above do not see), read from this plan
        return replace(row, const=float(self.totals[at]) - row.value(self.x))

    def _strategy_bytes(self, node: fx.Node, size) -> np.ndarray:  # noqa: ANN001
        return np.array([size(node, s) for s in self.built.strategies(node)])

    def _read_bytes(self, view: fx.Node) -> np.ndarray:
        """Bytes of a view's input in the placement each of its strategies reads it in."""
        val = view.args[0].meta.get("val")
        return self._strategy_bytes(view, lambda node, s: local_bytes(val, s.inputs[0], self.mesh))

    def _add_transients(self, node: fx.Node, add) -> None:  # noqa: ANN001
        """The running op's inputs that this plan redistributes, in each strategy's placement."""
        if node not in self.chosen:
            return
        owned = is_alias(node) and self.t.root.get(node) is node  # its buffer counts as live
        for parts in self.built.edge_parts:
            for part in parts:
                if part.consumer is not node or part.arg_index == GRAD_EDGE or part.producer not in self.chosen:
                    continue
                if (owned and part.arg_index == 0) or not self._moves(part, self.chosen[node], node):
                    continue
                add(node, self._strategy_bytes(node, lambda _, s, p=part: _input_bytes(p, s, self.mesh)))

    def _add_held(self, at: int, add) -> None:  # noqa: ANN001
        """Tensors the merged collectives hold at ``at``: each scaled by the bytes of the
        placement that sizes it under each strategy of the node that sets it (the
        consumer's input for a gather, the producer's output for a reduce-scatter),
        and none where that strategy moves nothing."""
        for span in self.t.spans:
            if not span.first <= at <= span.last:
                continue
            for part, nbytes in span.holds:
                node = part.consumer if span.held_by == "consumer" else part.producer
                if part.consumer not in self.chosen or part.producer not in self.chosen:
                    continue
                size = _input_bytes if span.held_by == "consumer" else _produced_bytes
                now = size(part, self.chosen[node], self.mesh)
                if now:
                    add(node, self._strategy_bytes(node, lambda _, s, p=part: (
                        nbytes * size(p, s, self.mesh) / now if self._moves(p, s, node) else 0.0)))

    def _moves(self, part: EdgeInfo, s: Strategy, node: fx.Node) -> bool:
        """Whether ``part`` is redistributed when ``node`` (one of its ends) takes ``s``
        and the other end keeps this plan's choice."""
        producer = s if node is part.producer else self.chosen[part.producer]
        consumer = s if node is part.consumer else self.chosen[part.consumer]
        src = producer.outputs[part.output_index]
        dst = consumer.outputs[0] if part.arg_index == GRAD_EDGE else consumer.inputs[part.arg_index]
        return dst is not None and src != dst

    def _add_state(self, at: int, add) -> None:  # noqa: ANN001
        """Parameters and optimizer state, and the reduced gradients made by ``at``."""
        problem = self.built.problem
        for fqn, param in self.traced.params.items():
            v = self.built.index(param)
            if problem.memory[v] is not None:
                add(param, (1 + OPTIMIZER_STATE_COPIES) * np.asarray(problem.memory[v], dtype=np.float64))
            grad = self.traced.grads.get(fqn)
            if grad is not None and self.t.position[grad] <= at:
                val = grad.meta["val"]
                add(param, self._strategy_bytes(param, lambda _, s, val=val: local_bytes(val, s.outputs[0], self.mesh)))


def _input_bytes(part: EdgeInfo, s: Strategy, mesh: tuple[int, ...]) -> float:
    """Bytes of ``part`` as its consumer under ``s`` reads it (a gradient: as its parameter)."""
    return part_bytes(part, s.outputs[0] if part.arg_index == GRAD_EDGE else s.inputs[part.arg_index], mesh)


def _produced_bytes(part: EdgeInfo, s: Strategy, mesh: tuple[int, ...]) -> float:
    return part_bytes(part, s.outputs[part.output_index], mesh)


def _holder(t: Timeline, owner: fx.Node, at: int) -> fx.Node:
    """The node whose choice sets what of ``owner``'s allocation is live at ``at``: the
    owner while a non-view reads it at or after ``at``, else the view that keeps it."""
    node = owner
    while True:
        if any(t.position[u] >= at for u in node.users if not _is_view(u)):
            return node
        views = [u for u in node.users if _is_view(u) and t.root.get(u) is owner and t.position[u] <= at]
        keeping = [u for u in views if _reach(t, u) >= at]
        if not keeping:
            return node
        node = max(keeping, key=lambda u: _reach(t, u))


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in VIEW_OPS


def _reach(t: Timeline, node: fx.Node) -> int:
    """The last position that reads ``node`` directly or through views of it."""
    last = t.position[node]
    for u in node.users:
        last = max(last, _reach(t, u) if _is_view(u) else t.position.get(u, last))
    return last



# Rounds of "bound the positions over the limit, solve again" before the planner settles
# for the lowest peak it found: a step's peak moves between a few positions (the start
# of the backward, each block's recomputation), so a few rounds bound them all.
PEAK_ROUNDS = 8
# Stop early when STALL_ROUNDS rounds in a row lowered the lowest peak by less than this share
# while it stayed more than this share over: the rows then chase the linear estimate's error,
# not a plan that fits.
STALL_SHARE = 0.01
STALL_ROUNDS = 3
# After such a round the new rows' limit shrinks by the walk's excess over the rows' estimate,
# and at least by this share of the usable bytes: the plans the rows let through neighbour
# each other and miss by about the same error.
TIGHTEN = 0.01
ROUND_SHARE = 0.1  # of the time limit, the most one round's solve may take (its best plan is kept)
ROWS_PER_ROUND = 4  # the worst positions over the limit, each at least a window apart
WINDOW_SHARE = 1 / 64  # of the graph's length: nearer positions hold nearly the same tensors


def over_limit(totals: np.ndarray, usable: float) -> list[int]:
    """Up to ``ROWS_PER_ROUND`` positions over ``usable``, worst first, spaced apart."""
    window = max(8, int(len(totals) * WINDOW_SHARE))
    picked: list[int] = []
    for at in np.argsort(-totals, kind="stable").tolist():
        if totals[at] <= usable or len(picked) == ROWS_PER_ROUND:
            break
        if all(abs(at - p) > window for p in picked):
            picked.append(at)
    return picked


def fit_peak(
    built: BuiltProblem, traced: TracedStep, solution: Solution, usable: float, *,
    time_limit_s: float | None, solver: IlpSolver, price: Callable[[np.ndarray], float] | None = None,
    problem: Problem | None = None, memory: Callable[[np.ndarray], StepMemory] | None = None,
) -> Solution:
    """``solution``, or when its whole peak exceeds ``usable`` bytes, the cheapest plan the
    solve finds under rows at the positions over it (module docstring). Each round walks
    the new plan and adds the rows of the positions still over, read from it: each is
    exact at the plan it was read from, which it cuts off, so no plan comes back and the
    rounds make progress. Keeps the lowest peak, with a warning, when none fits; either
    way ``memory_fit`` says what was done. The solves under rows minimise the tables'
    step time; ``price`` (default: that) is the objective the plans are reported at
    (``[autoparallel] overlap``'s, with the hidden collectives taken off). ``problem``
    and ``memory`` (default: ``built``'s, and its walk) solve and walk a problem with
    more nodes than the placements' (``recompute_choice``)."""
    problem = problem or built.problem
    walk_of = memory or (lambda x: StepMemory(built, traced, x))
    memory = walk_of(solution.assignment)
    if memory.peak <= usable:
        return solution
    start = time.perf_counter()
    price = price or problem.energy
    unbounded = {"usable_bytes": usable, "unbounded_peak_bytes": memory.peak,
                 "unbounded_objective": float(price(solution.assignment))}
    rows: list[MemoryRow] = []
    best = (memory.peak, solution)
    stalled, limit = 0, usable
    for rounds in range(1, PEAK_ROUNDS + 1):
        rows.extend(memory.row(at, limit) for at in over_limit(memory.totals, usable))
        log.info("peak %.2f GiB per device at %s is over %.2f GiB usable: solving again under %d memory row(s)",
                 memory.peak / GIB, memory.t.order[memory.at].name, usable / GIB, len(rows))
        left = None if time_limit_s is None else max(
            min(time_limit_s - (time.perf_counter() - start), ROUND_SHARE * time_limit_s), 1.0)
        try:
            solution = solve_with_rows(problem, rows, left, solver)
        except InfeasibleProblem as e:
            log.warning("no plan fits: %s", e)
            break
        memory = walk_of(solution.assignment)
        slow = memory.peak > best[0] * (1 - STALL_SHARE)
        if slow:  # the rows' linear estimate misses the walk: the next rows ask for that much more
            estimate = max(row.value(solution.assignment) for row in rows)
            limit -= max(memory.peak - estimate, TIGHTEN * usable)
        # a plan within STALL_SHARE of fitting is what the tightened rows close in on
        stalled = stalled + 1 if slow and memory.peak > usable * (1 + STALL_SHARE) else 0
        if memory.peak < best[0]:
            best = (memory.peak, solution)
        if memory.peak <= usable:
            log.info("the plan fits: peak %.2f GiB per device, step %.1f us (%.1f%% over the plan that does not fit)",
                     memory.peak / GIB, solution.objective, 100 * (solution.objective / unbounded["unbounded_objective"] - 1))
            break
        if stalled == STALL_ROUNDS:
            log.warning("%d rounds of memory rows lowered the peak by less than %.0f%%: stopping", STALL_ROUNDS, 100 * STALL_SHARE)
            break
        if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
            log.warning("the time limit (%s s) stopped the memory rounds", time_limit_s)
            break
    if best[0] > usable:
        log.warning("keeping the plan of the lowest peak found, %.2f GiB per device, over %.2f GiB usable",
                    best[0] / GIB, usable / GIB)
    peak, kept = best
    kept.objective = float(price(kept.assignment))
    kept.memory_fit = {**unbounded, "peak_bytes": peak, "rounds": float(rounds), "rows": float(len(rows)),
                       "fits": float(peak <= usable)}
    return kept
