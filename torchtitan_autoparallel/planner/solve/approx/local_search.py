"""Local search on an ``Mrf`` labeling: moves that only ever lower the energy.

* single-node moves (ICM), a colour class at a time: nodes of one class share
  no edge, so their moves are independent and are applied together;
* star-block moves: a node with a set of its neighbours that share no edge
  among themselves is a star, a tree, so its best joint relabeling (everything
  else fixed) is exact by one min-sum pass;
* under a memory budget a move is taken only if the plan still fits, and an
  over-budget labeling is first repaired by the cheapest memory-saving moves.

``LocalState`` keeps every node's cost of each of its labels given its
neighbours' current labels, updated incrementally as nodes move. The moves,
ICM and the star rounds are compiled (``_Moves`` is the state they share):
in Python their bookkeeping took most of the approximate solver's search on
the 2-D meshes. The memory repairs and trades stay in Python; they run only
under a budget that binds, a move at a time.
"""

from __future__ import annotations

import math
import time
from collections import namedtuple
from dataclasses import dataclass

import numpy as np

from torchtitan_autoparallel import jit
from torchtitan_autoparallel.planner.solve.approx import kernels
from torchtitan_autoparallel.planner.solve.approx.mrf import Mrf

GAIN_RTOL = 1e-12  # a move must gain more than this (relative) to count
SKIP_SETTLED = True  # star rounds skip centres whose answer cannot have changed
_jit = jit.jit

# ``counts``: [moves]; ``sums``: [energy, memory]; ``missed[c]``: the move count when
# the star at ``c`` last failed (-1: never), ``missed_slack[c]`` the slack then
_Moves = namedtuple(
    "_Moves",
    ["cost", "mem", "x", "stamp", "counts", "sums", "missed", "missed_slack",
     "k", "flat", "graph", "budget", "bounded"],
)


class LocalState:
    def __init__(self, mrf: Mrf, x: np.ndarray) -> None:
        self.mrf = mrf
        n, k = mrf.num_nodes, mrf.k
        self.unary, self.mem = mrf.padded  # read only
        self.x = np.asarray(x, dtype=np.int64).copy()
        self.cost = np.empty(self.unary.shape)
        self.stamp = np.zeros(n, dtype=np.int64)  # the move count at each node's last move
        self._counts, self._sums = np.zeros(1, dtype=np.int64), np.zeros(2)
        self._m = _Moves(
            self.cost, self.mem, self.x, self.stamp, self._counts, self._sums,
            np.full(n, -1, dtype=np.int64), np.zeros(n), k, mrf.flat, mrf.adjacency,
            float(mrf.budget), mrf.flat_memory is not None,
        )
        self.refresh()

    def refresh(self) -> None:
        """Recompute the cost table, energy and memory from scratch (no drift)."""
        mrf = self.mrf
        self.cost[...] = kernels.neighbour_costs(self.unary, self.x, mrf.k, mrf.flat, mrf.adjacency)
        self._sums[0] = self.mrf.energy(self.x)
        self._sums[1] = self.mrf.memory_used(self.x)

    @property
    def energy(self) -> float:
        return float(self._sums[0])

    @property
    def memory(self) -> float:
        return float(self._sums[1])

    @property
    def moves(self) -> int:
        return int(self._counts[0])

    @property
    def slack(self) -> float:
        return self.mrf.budget - self.memory if self.mrf.flat_memory is not None else math.inf

    def tol(self) -> float:
        return GAIN_RTOL * max(1.0, abs(self.energy))

    def move(self, v: int, label: int) -> None:
        _move(self._m, v, label)

    def neighbours(self, v: int) -> list[int]:
        start, nbr = self.mrf.adjacency[:2]
        return nbr[start[v] : start[v + 1]].tolist()


def polish(
    mrf: Mrf, x: np.ndarray, deadline: float | None, lam: float = 0.0, blocks: bool = True
) -> np.ndarray:
    """Improve ``x`` by single-node and (with ``blocks``) star moves until neither
    helps (or the deadline; one round at least). ``lam`` prices memory in the star
    moves' choice, so that under a tight budget they find moves that still fit."""
    state = LocalState(mrf, x)
    if state.slack < 0:
        repair(state)
    while True:
        icm(state)
        if not blocks:
            break
        moved = stars(state, lam)
        if mrf.flat_memory is not None:
            moved += trades(state)
        if not moved or _late(deadline):
            break
    for depth in (2, 3, 4):  # a forbidden pair left: deeper blocks around it
        if state.energy < state.mrf.big or _late(deadline):
            break
        stars(state, lam, depth, _forbidden_ends(state))
        icm(state)
    return state.x


def _forbidden_ends(state: LocalState) -> list[int]:
    x, big = state.x, state.mrf.big
    ends = set()
    for (a, b), t in zip(state.mrf.edges.tolist(), state.mrf.tables):
        if t[x[a], x[b]] >= big:
            ends.update((a, b))
    return sorted(ends)


def icm(state: LocalState) -> int:
    """Single-node moves, a colour class at a time, until none gains; returns the count."""
    return _icm(state._m, *state.mrf.colour_classes, GAIN_RTOL)


def stars(state: LocalState, lam: float = 0.0, depth: int = 1, centres=None) -> int:
    """One round of block moves (stars, or deeper trees) over ``centres`` (all nodes by
    default); returns how many were taken. A full round of stars skips the centres
    whose move was found not to help and whose surroundings have not moved since."""
    every = centres is None
    nodes = np.arange(state.mrf.num_nodes) if every else np.asarray(centres, dtype=np.int64)
    remember = depth == 1 and every  # the rounds that revisit every centre
    return _stars(
        state._m, float(lam), depth, nodes, remember, remember and SKIP_SETTLED,
        *state.mrf.reach, GAIN_RTOL,
    )


# --- compiled moves ------------------------------------------------------------------


@_jit
def _slack(m: _Moves) -> float:
    return m.budget - m.sums[1] if m.bounded else np.inf


@_jit
def _move(m: _Moves, v: int, label: int) -> None:
    """Relabel ``v``: the energy, memory and every neighbour's costs follow (each
    neighbour's row gains the table's new row less its old one, neighbour by
    neighbour in adjacency order)."""
    cost, x, flat = m.cost, m.x, m.flat
    start, nbr, edge, rows, at, cols = m.graph
    old = x[v]
    if old == label:
        return
    m.sums[0] += cost[v, label] - cost[v, old]
    m.sums[1] += m.mem[v, label] - m.mem[v, old]
    for p in range(start[v], start[v + 1]):
        z, e = nbr[p], edge[p]
        if rows[p]:  # ``v`` indexes the table's rows: its row, across ``z``'s labels
            base, c = at[e], cols[e]
            for j in range(m.k[z]):
                cost[z, j] += flat[base + label * c + j] - flat[base + old * c + j]
        else:
            base, c = at[e], cols[e]
            for j in range(m.k[z]):
                cost[z, j] += flat[base + j * c + label] - flat[base + j * c + old]
    x[v] = label
    m.counts[0] += 1
    m.stamp[v] = m.counts[0]


@_jit
def _icm(m: _Moves, class_at: np.ndarray, class_nodes: np.ndarray, gain_rtol: float) -> int:
    total, changed = 0, True
    while changed:
        changed = False
        for c in range(class_at.shape[0] - 1):
            done = _class_moves(m, class_nodes[class_at[c] : class_at[c + 1]], gain_rtol)
            total += done
            changed |= done > 0
    return total


@_jit
def _class_moves(m: _Moves, nodes: np.ndarray, gain_rtol: float) -> int:
    """Each node's best label within the slack (all found first: the class shares no
    edge), then the moves that gain: those that free memory first, best gain first."""
    cost, mem, x = m.cost, m.mem, m.x
    count, width = nodes.shape[0], cost.shape[1]
    slack, tol = _slack(m), gain_rtol * max(1.0, abs(m.sums[0]))
    best = np.zeros(count, dtype=np.int64)
    gain, growth = np.empty(count), np.empty(count)
    for i in range(count):
        v = nodes[i]
        current = x[v]
        least = np.inf
        for j in range(width):
            c = cost[v, j] if mem[v, j] - mem[v, current] <= slack else np.inf
            if c < least or j == 0:
                least, best[i] = c, j
        gain[i] = cost[v, current] - least
        growth[i] = mem[v, best[i]] - mem[v, current]
    take = np.flatnonzero(gain > tol)
    if take.shape[0] == 0:
        return 0
    # ``np.lexsort((-gain, growth > 0))``: by gain, then (stably) freeing moves first
    by_gain = take[np.argsort(-gain[take], kind="mergesort")]
    order = by_gain[np.argsort((growth[by_gain] > 0).astype(np.int64), kind="mergesort")]
    done = 0
    for i in order:
        if growth[i] > 0 and growth[i] > _slack(m):
            continue
        _move(m, nodes[i], best[i])
        done += 1
    return done


@_jit
def _tree_step(m: _Moves, root: int, depth: int, lam: float, gain_rtol: float) -> bool:
    order, _, _, _, _, new, gain, grow = kernels.tree_block(
        m.cost, m.mem, m.x, m.k, m.flat, m.graph, root, depth, lam
    )
    if gain <= gain_rtol * max(1.0, abs(m.sums[0])) or (grow > 0 and grow > _slack(m)):
        return False
    for i in range(order.shape[0]):
        _move(m, order[i], new[i])
    return True


@_jit
def _stars(
    m: _Moves, lam: float, depth: int, centres: np.ndarray, remember: bool, skip: bool,
    reach_at: np.ndarray, reach: np.ndarray, gain_rtol: float,
) -> int:
    """Block moves around each centre; a centre whose move failed is skipped while no
    node within two edges has moved (its block's labels and their neighbours' costs)
    and the slack has not grown (a move refused for memory might fit now)."""
    start = m.graph[0]
    taken = 0
    for c in centres:
        if start[c + 1] == start[c]:
            continue
        if skip and m.missed[c] >= 0 and _slack(m) <= m.missed_slack[c]:
            latest = 0
            for i in range(reach_at[c], reach_at[c + 1]):
                latest = max(latest, m.stamp[reach[i]])
            if latest <= m.missed[c]:
                continue
        if _tree_step(m, c, depth, lam, gain_rtol):
            taken += 1
        elif remember:
            m.missed[c], m.missed_slack[c] = m.counts[0], _slack(m)
    return taken


@dataclass
class _Block:
    """A tree block's min-sum pass (``kernels.tree_block``): the best relabeling for
    each label of its root, and the best one overall under energy + lam * memory."""

    order: np.ndarray  # root first, parents before children
    parent: np.ndarray  # each node's parent's position in ``order`` (-1: the root)
    picks: np.ndarray  # (nodes, width): each node's best label per parent label
    totals: np.ndarray  # (k_root,) best block energy (+ lam * memory) per root label
    now: float  # the block's energy (memory not priced) at the current labels
    best: np.ndarray  # the best relabeling, by position in ``order``
    gain: float  # energy it saves
    grow: float  # memory it adds (negative: frees)

    def labels(self, root_label: int) -> dict[int, int]:
        new = [root_label]
        for i in range(1, len(self.order)):
            new.append(int(self.picks[i, new[self.parent[i]]]))
        return dict(zip(self.order.tolist(), new))


def _block(state: LocalState, root: int, depth: int, lam: float) -> _Block:
    """The breadth-first block around ``root`` whose induced edges form a tree (a node
    joins only if exactly one of its neighbours is already in; costliest edges
    first, since a forbidden pair is most likely left on one), solved exactly."""
    mrf = state.mrf
    return _Block(
        *kernels.tree_block(
            state.cost, state.mem, state.x, mrf.k, mrf.flat, mrf.adjacency, root, depth, lam
        )
    )


def trades(state: LocalState) -> int:
    """Star moves that need more memory than is free, paid for by the cheapest
    memory-freeing single-node move away from the star; returns how many were taken."""
    holders = np.flatnonzero(np.ptp(state.mem, axis=1) > 0)
    taken = 0
    for v in holders.tolist():
        block = _block(state, v, 1, 0.0)
        need = block.grow - state.slack
        if block.gain <= state.tol() or need <= 0:
            continue  # nothing to gain, or the star move needs no trade
        near = set(block.order.tolist())
        for u in block.order.tolist():
            near.update(state.neighbours(u))
        others = np.array([w for w in holders.tolist() if w not in near], dtype=np.int64)
        if not len(others):
            continue
        current = state.x[others]
        saved = state.mem[others, current][:, None] - state.mem[others]
        extra = state.cost[others] - state.cost[others, current][:, None]
        extra = np.where(saved >= need, extra, np.inf)
        w, label = np.unravel_index(int(np.argmin(extra)), extra.shape)
        if extra[w, label] < block.gain - state.tol():
            state.move(int(others[w]), int(label))
            for u, new in zip(block.order.tolist(), block.best.tolist()):
                state.move(u, new)
            taken += 1
    return taken


def repair(state: LocalState) -> None:
    """Over budget: star moves (a memory holder relabelled, its neighbours
    re-optimised) until the plan fits. Each step takes the move of least energy per
    byte saved, unless one move saving all the excess costs no more than that rate
    times the excess (it finishes at once); single-node moves if no star move saves."""
    holders = np.flatnonzero(np.ptp(state.mem, axis=1) > 0).tolist()
    while state.slack < 0:
        need = -state.slack
        by_rate = (math.inf, None)  # (energy per byte, labels)
        at_once = (math.inf, None)  # (energy, labels) of the cheapest move saving ``need``
        for v in holders:
            block = _block(state, v, 1, 0.0)
            k = len(block.totals)
            saved = state.mem[v, state.x[v]] - state.mem[v, :k]
            for i, leaf in enumerate(block.order[1:].tolist(), start=1):
                saved = saved - state.mem[leaf, block.picks[i, :k]] + state.mem[leaf, state.x[leaf]]
            extra = block.totals - block.now
            rate = np.where(saved > 0, extra / np.where(saved > 0, saved, 1.0), np.inf)
            label = int(np.argmin(rate))
            if rate[label] < by_rate[0]:
                by_rate = (float(rate[label]), block.labels(label))
            enough = np.where(saved >= need, extra, np.inf)
            label = int(np.argmin(enough))
            if enough[label] < at_once[0]:
                at_once = (float(enough[label]), block.labels(label))
        if by_rate[1] is None:
            _repair_single(state)
            return
        take = at_once[1] if at_once[0] <= by_rate[0] * need else by_rate[1]
        for u, label in take.items():
            state.move(u, label)


def _repair_single(state: LocalState) -> None:
    while state.slack < 0:
        saving = state.mem[np.arange(len(state.x)), state.x][:, None] - state.mem
        delta = state.cost - state.cost[np.arange(len(state.x)), state.x][:, None]
        ratio = np.where(saving > 0, delta / np.where(saving > 0, saving, 1.0), np.inf)
        v, label = np.unravel_index(int(np.argmin(ratio)), ratio.shape)
        if not np.isfinite(ratio[v, label]):
            return  # no move saves memory: the caller finds the plan does not fit
        state.move(int(v), int(label))


def _late(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() > deadline

