"""``activation_checkpoint = "auto"``: each transformer block's recomputation, chosen by
the same solve that fits the step's peak.

Each block ``b`` whose trace does not yet recompute all of it adds one node ``y_b`` to
the problem; its strategies are the block's traced mode and each heavier one of
``RECOMPUTE_ORDER`` (none < selective < full), strategy 0 the mode traced. Priced at
the plan the choice is made from (placements ``x0``):

    unary[y_b][o]  = sum over the forward ops of b that ``o`` recomputes and the trace
                     does not, of their op time and the redistributions into them
    row_p[y_b][o]  = - freed_b(o, p): the bytes of b's saved activations that ``o``
                     no longer keeps for the backward, live at position p of the
                     plan, before the backward reaches b (from there the
                     recomputation makes them again)

so a memory row reads ``const + sum_v bytes_v(x_v) - sum_b freed_b(y_b, p) <= limit``
and the solve weighs each block's recomputation time against what resharding
would cost instead, with the energy ``E(x) + sum_b unary[y_b][y_b]``. A saved
activation is a forward op's allocation a backward op reads; under ``selective``
the policy's saved ops stay (``recompute.selective_saves``), under ``full`` only the
block's output (the next block's saved input). The walk of a joint plan is the
trace's walk less the freed bytes of every block's choice (``JointMemory``), which
is exact where the trace is; once the choice differs from the trace, the caller
traces the chosen modes and plans again (``api.plan_fitting``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import numpy as np
from torch import fx

from torchtitan_autoparallel.planner.plan.memory import Timeline
from torchtitan_autoparallel.planner.plan.peak_rows import StepMemory, fit_peak
from torchtitan_autoparallel.planner.problem.build import BuiltProblem
from torchtitan_autoparallel.planner.problem.problem import Problem
from torchtitan_autoparallel.planner.problem.rows import MemoryRow
from torchtitan_autoparallel.planner.solve.base import Solution
from torchtitan_autoparallel.planner.trace.recompute import BLOCK, RECOMPUTE_ORDER, block_modes, selective_saves
from torchtitan_autoparallel.planner.trace.trace import TracedStep


@dataclass(frozen=True)
class BlockForward:
    """One block's forward ops in the trace, and which of them each mode recomputes and keeps."""

    block: int
    traced: str  # the block's mode in the trace
    ops: tuple[fx.Node, ...]  # in graph order
    saved: frozenset[fx.Node]  # ops a backward op reads: kept for the backward in this trace
    kept: dict[str, frozenset[fx.Node]]  # mode -> the saved ops it still keeps
    resume: int  # where the backward first reads them: a recomputation runs there
    forward_read: dict[fx.Node, int]  # each op's last reader in the forward (its own position if none)

    @property
    def options(self) -> tuple[str, ...]:
        return RECOMPUTE_ORDER[RECOMPUTE_ORDER.index(self.traced):]

    def recomputed(self, mode: str) -> set[fx.Node]:
        """The forward ops ``mode`` runs again in the backward."""
        if mode == "none":
            return set()
        if mode == "full":
            return set(self.ops)
        return set(self.ops) - self.kept["selective"]


def block_forwards(traced: TracedStep) -> list[BlockForward]:
    """The blocks whose trace a heavier mode would change, from ``node.meta[BLOCK]``."""
    order = list(traced.graph.graph.nodes)
    position = {n: i for i, n in enumerate(order)}
    loss = position[traced.loss]
    ops: dict[int, list[fx.Node]] = {}
    for n in order:
        if n.op == "call_function" and BLOCK in n.meta and position[n] < loss:
            ops.setdefault(n.meta[BLOCK], []).append(n)
    modes = block_modes(traced.block_recompute or traced.activation_checkpoint, len(ops)) if ops else ()
    forwards = []
    for b, nodes in sorted(ops.items()):
        read_later = {n: [position[u] for u in n.users if position[u] > loss] for n in nodes}
        saved = frozenset(n for n, later in read_later.items() if later)
        if modes[b] == "full" or not saved:
            continue
        # the block's output is the next block's input (or the final norm's): kept in every mode
        output = {n for n in saved if any(position[u] < loss and u.meta.get(BLOCK) != b for u in n.users)}
        selective = _with_items(selective_saves(nodes)) | output
        # by op, not by what the backward reads: a saved view keeps its input op's buffer
        kept = {"none": saved, "selective": frozenset(selective if modes[b] == "none" else saved),
                "full": frozenset(output)}
        forward_read = {n: max([position[n], *(position[u] for u in n.users if position[u] < loss)]) for n in nodes}
        forwards.append(BlockForward(b, modes[b], tuple(nodes), saved, kept,
                                     min(min(later) for later in read_later.values() if later), forward_read))
    return forwards


def _with_items(nodes: set[fx.Node]) -> set[fx.Node]:
    """``nodes`` and the items taken from their tuple outputs (attention's)."""
    return nodes | {u for n in nodes for u in n.users if u.target is operator.getitem}


@dataclass(frozen=True)
class RecomputeChoice:
    """The problem with one node per block that may recompute more, and its prices."""

    blocks: list[BlockForward]
    problem: Problem  # the placements' nodes, then one per block
    cost_us: list[np.ndarray]  # per block, per option: step time added

    def modes(self, assignment: np.ndarray, n_blocks: int, traced: TracedStep) -> tuple[str, ...]:
        """Each block's mode under ``assignment`` (of ``problem``), the heavier modes moved to
        the first of the blocks priced alike: an earlier block's activations live from an
        earlier forward to a later backward, so it frees as much at every position, for
        the same time; and "full 0-1, none 2-5" reads better than an arbitrary order."""
        modes = list(block_modes(traced.block_recompute or traced.activation_checkpoint, n_blocks))
        first = self.problem.num_nodes - len(self.blocks)
        chosen = [block.options[int(assignment[first + i])] for i, block in enumerate(self.blocks)]
        for alike in self._alike():
            heaviest_first = sorted((chosen[i] for i in alike), key=RECOMPUTE_ORDER.index, reverse=True)
            for i, mode in zip(alike, heaviest_first):
                chosen[i] = mode
        for block, mode in zip(self.blocks, chosen):
            modes[block.block] = mode
        return tuple(modes)

    def _alike(self) -> list[list[int]]:
        """Groups of blocks (indices into ``blocks``, in order) with the same options and prices."""
        groups: dict[tuple, list[int]] = {}
        for i, (block, cost) in enumerate(zip(self.blocks, self.cost_us)):
            groups.setdefault((block.options, tuple(np.round(cost, 6)), len(block.saved)), []).append(i)
        return list(groups.values())


def recompute_choice(built: BuiltProblem, traced: TracedStep, assignment: np.ndarray) -> RecomputeChoice:
    """``built``'s problem with each block's recomputation as a node, priced at ``assignment``."""
    blocks = block_forwards(traced)
    x = np.asarray(assignment, dtype=np.int64)
    problem = built.problem
    into: dict[int, list[int]] = {}
    for e, v in enumerate(problem.edges[:, 1].tolist()):
        into.setdefault(v, []).append(e)

    def op_time(node: fx.Node) -> float:
        if node not in built:
            return 0.0
        v = built.index(node)
        edges = into.get(v, [])
        return float(problem.unary[v][x[v]]) + sum(
            float(problem.pairwise[e][x[problem.edges[e, 0]], x[v]]) for e in edges)

    costs = []
    for block in blocks:
        traced_ops = block.recomputed(block.traced)
        costs.append(np.array([sum(op_time(n) for n in block.recomputed(o) - traced_ops) for o in block.options]))
    labels = [[f"recompute {o}" for o in block.options] for block in blocks]
    joint = replace(
        problem,
        node_names=[*problem.node_names, *(f"block {block.block} recomputation" for block in blocks)],
        strategy_labels=[*problem.strategy_labels, *labels],
        unary=[*problem.unary, *costs],
        memory=[*problem.memory, *([None] * len(blocks))],
    )
    return RecomputeChoice(blocks, joint, costs)


def freed(block: BlockForward, option: str, t: Timeline) -> np.ndarray:
    """Per graph position, the bytes of ``block``'s saved activations ``option`` no
    longer keeps, as the walk ``t`` sizes them: from after their last forward reader
    (through any view of them) to where the backward reaches the block."""
    out = np.zeros(len(t.order))
    root = {n: t.root.get(n, n) for n in block.ops}
    dropped = {root[n] for n in block.saved - block.kept[option]} - {root[n] for n in block.kept[option]}
    for owner in dropped:
        if owner.meta.get(BLOCK) != block.block or owner not in t.size:
            continue
        read = max(block.forward_read[n] for n in block.ops if root[n] is owner)
        out[read + 1:min(t.last_use[owner] + 1, block.resume)] += t.size[owner]
    return out


class JointMemory(StepMemory):
    """The walk of a joint plan: the trace's, less what each block's choice frees."""

    def __init__(self, built: BuiltProblem, traced: TracedStep, assignment: np.ndarray,
                 choice: RecomputeChoice) -> None:
        n = len(built.nodes)
        super().__init__(built, traced, np.asarray(assignment, dtype=np.int64)[:n])
        self.choice, self.y = choice, np.asarray(assignment, dtype=np.int64)[n:]
        self.freed = [np.stack([freed(b, o, self.t) for o in b.options]) for b in choice.blocks]
        for i, by_option in enumerate(self.freed):
            self.totals = self.totals - by_option[self.y[i]]

    def row(self, at: int, limit: float) -> MemoryRow:
        row = super().row(at, limit)
        n = len(self.built.nodes)
        terms = dict(row.terms)
        for i, by_option in enumerate(self.freed):
            terms[n + i] = -by_option[:, at]
        joint = replace(row, terms=terms, const=0.0)
        x = np.concatenate([self.x, self.y])
        return replace(joint, const=float(self.totals[at]) - joint.value(x))


def fit_with_recompute(built: BuiltProblem, traced: TracedStep, solution: Solution, usable: float,
                       n_blocks: int, **fit) -> Solution:
    """``peak_rows.fit_peak`` over placements and each block's recomputation together.
    The solution's assignment is the placements'; ``block_recompute`` the modes chosen,
    and ``memory_fit`` adds ``recompute_us`` (the step time they add) and
    ``recompute_freed_bytes`` (what they free where the unbounded plan peaks)."""
    choice = recompute_choice(built, traced, solution.assignment)
    if not choice.blocks:
        return fit_peak(built, traced, solution, usable, **fit)
    n = len(built.nodes)
    start = replace(solution, assignment=np.concatenate([solution.assignment, np.zeros(len(choice.blocks), np.int64)]))
    price = fit.pop("price", None) or built.problem.energy
    walks: dict[bytes, JointMemory] = {}  # each plan walked once: the fit's walks are read again below

    def walk_of(x: np.ndarray) -> JointMemory:
        key = np.asarray(x, dtype=np.int64).tobytes()
        if key not in walks:
            walks[key] = JointMemory(built, traced, x, choice)
        return walks[key]

    fitted = fit_peak(built, traced, start, usable, problem=choice.problem, memory=walk_of,
                      price=lambda x: price(x[:n]) + _choice_cost(choice, x[n:]), **fit)
    if fitted is start:
        return solution
    y = fitted.assignment[n:]
    at = walk_of(start.assignment).at  # where the plan without recomputation peaks
    walk = walk_of(fitted.assignment)
    fitted.memory_fit["recompute_us"] = _choice_cost(choice, y)
    fitted.memory_fit["recompute_freed_bytes"] = float(sum(f[y[i], at] for i, f in enumerate(walk.freed)))
    return replace(fitted, assignment=fitted.assignment[:n], block_recompute=choice.modes(fitted.assignment, n_blocks, traced))


def _choice_cost(choice: RecomputeChoice, y: np.ndarray) -> float:
    return float(sum(cost[int(k)] for cost, k in zip(choice.cost_us, y)))
