"""Local search on an ``Mrf`` labeling: moves that only ever lower the energy.

* single-node moves (ICM), a colour class at a time: nodes of one class share
  no edge, so their moves are independent and are applied together;
* star-block moves: a node with a set of its neighbours that share no edge
  among themselves is a star, a tree, so its best joint relabeling (everything
  else fixed) is exact by one min-sum pass;
* under a memory budget a move is taken only if the plan still fits, and an
  over-budget labeling is first repaired by the cheapest memory-saving moves.

``LocalState`` keeps every node's cost of each of its labels given its
neighbours' current labels, updated incrementally as nodes move.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from torchtitan_autoparallel.planner.solvers import kernels
from torchtitan_autoparallel.planner.solvers.mrf import Mrf

GAIN_RTOL = 1e-12  # a move must gain more than this (relative) to count


class LocalState:
    def __init__(self, mrf: Mrf, x: np.ndarray) -> None:
        self.mrf = mrf
        n, k = mrf.num_nodes, mrf.k
        width = int(k.max(initial=1))
        self.unary = np.full((n, width), np.inf)
        self.mem = np.zeros((n, width))
        self.unary[mrf.cells] = mrf.flat_unary
        if mrf.memory is not None:
            self.mem[mrf.cells] = mrf.flat_memory
        # neighbour, table, whether this node indexes the table's rows
        self.adj: list[list[tuple[int, np.ndarray, bool]]] = [[] for _ in range(n)]
        for (a, b), t in zip(mrf.edges.tolist(), mrf.tables):
            self.adj[a].append((b, t, True))
            self.adj[b].append((a, t, False))
        self.classes = _colour_classes(self.adj)
        self.x = np.asarray(x, dtype=np.int64).copy()
        self.moves = 0
        self.stamp = np.zeros(n, dtype=np.int64)  # the move count at each node's last move
        self._reach: list[np.ndarray] | None = None
        self._quiet: dict[int, tuple[int, float]] = {}  # star centre -> (moves, slack) at a miss
        self.refresh()

    def refresh(self) -> None:
        """Recompute the cost table, energy and memory from scratch (no drift)."""
        mrf = self.mrf
        self.cost = kernels.neighbour_costs(self.unary, self.x, mrf.k, mrf.flat, mrf.adjacency)
        self.energy = self.mrf.energy(self.x)
        self.memory = self.mrf.memory_used(self.x)

    @property
    def slack(self) -> float:
        return self.mrf.budget - self.memory if self.mrf.memory is not None else math.inf

    def tol(self) -> float:
        return GAIN_RTOL * max(1.0, abs(self.energy))

    def move(self, v: int, label: int) -> None:
        old = int(self.x[v])
        if old == label:
            return
        self.energy += self.cost[v, label] - self.cost[v, old]
        self.memory += self.mem[v, label] - self.mem[v, old]
        for z, t, rows in self.adj[v]:
            if rows:
                self.cost[z, : t.shape[1]] += t[label] - t[old]
            else:
                self.cost[z, : t.shape[0]] += t[:, label] - t[:, old]
        self.x[v] = label
        self.moves += 1
        self.stamp[v] = self.moves

    def star_settled(self, centre: int) -> bool:
        """The star move at ``centre`` was found not to help, and nothing it reads has
        changed since: no node within two edges moved (its block's labels and their
        neighbours' costs) and the slack did not grow (a move refused for memory
        might fit now)."""
        seen = self._quiet.get(centre)
        if seen is None:
            return False
        if self._reach is None:
            self._reach = _within_two(self.adj)
        moves, slack = seen
        return self.slack <= slack and int(self.stamp[self._reach[centre]].max()) <= moves

    def star_missed(self, centre: int) -> None:
        self._quiet[centre] = (self.moves, self.slack)


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
        if mrf.memory is not None:
            moved += trades(state)
        if not moved or _late(deadline):
            break
    for depth in (2, 3, 4):  # a forbidden pair left: deeper blocks around it
        if state.energy < state.mrf.big or _late(deadline):
            break
        stars(state, lam, depth, _forbidden_ends(state))
        icm(state)
    state.refresh()
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
    moves, changed = 0, True
    while changed:
        changed = False
        for nodes in state.classes:
            done = _class_moves(state, nodes)
            moves += done
            changed |= done > 0
    return moves


def _class_moves(state: LocalState, nodes: np.ndarray) -> int:
    cost = state.cost[nodes]
    current = state.x[nodes]
    rows = np.arange(len(nodes))
    extra = state.mem[nodes] - state.mem[nodes, current][:, None]
    slack = state.slack
    cost = np.where(extra <= slack, cost, np.inf)
    best = np.argmin(cost, axis=1)
    gain = state.cost[nodes, current] - cost[rows, best]
    take = np.flatnonzero(gain > state.tol())
    if not len(take):
        return 0
    growth = extra[take, best[take]]
    # moves that free memory always fit; the others share the slack, best gain first
    order = np.lexsort((-gain[take], growth > 0))
    done = 0
    for i in take[order].tolist():
        if extra[i, best[i]] > 0 and extra[i, best[i]] > state.slack:
            continue
        state.move(int(nodes[i]), int(best[i]))
        done += 1
    return done


def stars(state: LocalState, lam: float = 0.0, depth: int = 1, centres=None) -> int:
    """One round of block moves (stars, or deeper trees) over ``centres`` (all nodes by
    default); returns how many were taken."""
    taken = 0
    stars_only = depth == 1 and centres is None  # the rounds that revisit every centre
    for c in range(state.mrf.num_nodes) if centres is None else centres:
        if not state.adj[c] or (stars_only and state.star_settled(c)):
            continue
        if _tree_move(state, int(c), depth, lam):
            taken += 1
        elif stars_only:
            state.star_missed(c)
    return taken


def _tree_move(state: LocalState, root: int, depth: int, lam: float) -> bool:
    """Relabel a tree block around ``root`` optimally (everything else fixed), if that
    lowers the energy and the plan still fits."""
    block = _block(state, root, depth, lam)
    if block.gain <= state.tol() or (block.grow > 0 and block.grow > state.slack):
        return False
    for v, label in zip(block.order.tolist(), block.best.tolist()):
        state.move(v, label)
    return True


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
            near.update(z for z, _, _ in state.adj[u])
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


def _within_two(adj: list[list[tuple[int, np.ndarray, bool]]]) -> list[np.ndarray]:
    """Per node, itself and the nodes one or two edges away."""
    near = [{v, *(z for z, _, _ in nbrs)} for v, nbrs in enumerate(adj)]
    return [
        np.fromiter(set().union(*(near[z] for z in near[v])), dtype=np.int64)
        for v in range(len(adj))
    ]


def _colour_classes(adj: list[list[tuple[int, np.ndarray, bool]]]) -> list[np.ndarray]:
    colour = np.full(len(adj), -1, dtype=np.int64)
    for v, nbrs in enumerate(adj):
        used = {int(colour[z]) for z, _, _ in nbrs}
        c = 0
        while c in used:
            c += 1
        colour[v] = c
    return [np.flatnonzero(colour == c) for c in range(int(colour.max(initial=-1)) + 1)]


def _late(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() > deadline

