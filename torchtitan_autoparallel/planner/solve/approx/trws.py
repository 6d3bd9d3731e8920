"""Sequential tree-reweighted message passing (TRW-S, Kolmogorov 2006) on an ``Mrf``.

Nodes are swept in index order, forward then backward. At node ``s`` the
reparametrised unary is ``theta_hat_s = theta_s + sum of messages into s``;
every message to a neighbour ``t`` further along the sweep becomes

    M_st(x_t) = min_xs  gamma_s * theta_hat_s(x_s) - M_ts(x_s) + theta_st(x_s, x_t)

less its minimum ``delta_st`` (so messages stay bounded), with
``gamma_s = 1 / n_s`` and ``n_s = max(#earlier neighbours, #later neighbours, 1)``.

Lower bound: cover the graph with monotonic chains (paths along which the
node index grows), every edge on exactly one chain and node ``s`` on ``n_s``
of them. Splitting each ``theta_hat_s`` evenly over its chains, the chains'
minima add up to a lower bound for *any* messages. Right after a forward
sweep each forward message is its chain prefix's exact min-marginal, so a
chain's minimum is the sum of the ``delta`` along it plus its last node's
``min gamma_s * theta_hat_s``: the bound comes for free with the sweep (and
likewise after the backward sweep). It holds whatever messages the sweep
starts from, so capping them at ``big`` between sweeps (to keep forbidden
pairs from compounding) leaves it valid.

Decoding follows the paper, in both sweeps: each node takes its best label
given the labels already chosen before it in the sweep and the messages from
the nodes still ahead. A run stops when its best labeling is proven within a
relative ``gap`` of the optimum, when the energy stalls and the bound stalls or
closes the gap too slowly to matter, or at the deadline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from torchtitan_autoparallel import jit
from torchtitan_autoparallel.planner.solve.approx.mrf import Mrf

_jit = jit.jit
_inline = jit.inline

OPTIMAL_RTOL = 1e-9  # energy within this of the bound: proven optimal
GAP_RTOL = 1e-3  # default stop: the plan is proven within 0.1% of the optimum
STALL_RTOL = 1e-7  # bound and energy moving less than this over ``patience`` sweeps: stop
STALL_GAP_SHARE = 0.02  # or the bound closing less than this share of the gap over them
IMPROVE_EVERY = 5  # sweeps between local searches of a new best labeling
ONE = np.uint64(1)


@dataclass
class TrwsResult:
    labels: np.ndarray  # the best compact labeling decoded
    energy: float  # its energy under the unary the run used
    bound: float  # a lower bound on that energy's minimum (forbidden pairs at ``big``)
    iterations: int
    timed_out: bool


class Trws:
    """Message buffers and per-node work lists; messages persist across ``run`` calls,
    so a run with a slightly changed unary (the Lagrangian loop) starts warm."""

    def __init__(self, mrf: Mrf) -> None:
        self.mrf = mrf
        self.starts = mrf.starts
        start, nbr, edge, lower, offset, _ = mrf.adjacency
        size, self.incoming, *plans = _plans(start, nbr, edge, lower, offset, mrf.k)
        self.msg = np.zeros(size)
        self.forward = _SweepPlan(*plans[:3])
        self.backward = _SweepPlan(*plans[3:])

    def run(
        self,
        unary: np.ndarray,
        deadline: float | None,
        improve: Callable[[np.ndarray, bool], np.ndarray] | None = None,
        gap: float = GAP_RTOL,
        max_iters: int = 1000,
        patience: int = 10,
    ) -> TrwsResult:
        """Sweep until the best labeling is within ``gap`` (relative) of the bound,
        the energy and the bound stall (``_stalled``), or the deadline passes (one
        iteration at least). ``unary``: flat, node ``v``'s labels from ``Mrf.starts[v]``.
        ``improve`` (local search; its flag: the final, thorough call) refines a new
        best labeling every few sweeps and at the end."""
        flat = np.asarray(unary, dtype=np.float64)
        best = _Best(self.mrf, flat, improve)
        bound, history = -math.inf, []
        it, timed_out = 0, False
        while it < max_iters:
            x_fwd, lb_fwd = self._sweep(self.forward, flat)
            x_bwd, lb_bwd = self._sweep(self.backward, flat)
            it += 1
            best.offer(x_fwd)
            best.offer(x_bwd)
            bound = max(bound, lb_fwd, lb_bwd)
            if it % IMPROVE_EVERY == 0:
                best.improve(final=False)
            if best.within(bound, gap) or _stalled(history, bound, best.energy, patience):
                break
            if deadline is not None and time.perf_counter() > deadline:
                timed_out = True
                break
        best.improve(final=True)
        return TrwsResult(best.x, best.energy, min(bound, best.energy), it, timed_out)

    def _sweep(self, plan: _SweepPlan, unary: np.ndarray) -> tuple[np.ndarray, float]:
        """One sweep: update messages, decode a labeling, return it with the sweep's bound."""
        return sweep(
            unary, self.starts, self.msg, self.mrf.flat, plan.steps, plan.links,
            self.incoming, plan.weights, self.mrf.big,
        )


@dataclass
class _SweepPlan:
    """One sweep's order and per-node work, as ``sweep`` reads it."""

    steps: np.ndarray  # (n, 5) int64
    links: np.ndarray  # (2E, 6) int64
    weights: np.ndarray  # (n, 2) gamma, share of the bound


@_jit
def _plans(
    start: np.ndarray, nbr: np.ndarray, edge: np.ndarray, lower: np.ndarray,
    offset: np.ndarray, k: np.ndarray,
):
    """Both sweeps' plans from the adjacency (``Mrf.adjacency``: each node's edges in
    edge order). Messages sit in ``Trws.msg`` edge after edge, the one to the higher
    node first; ``incoming`` lists, node after node, where the messages into it start
    (in edge order: the order their sum takes). A sweep visits nodes in index order
    (forward) or backwards; each node's links go first to the neighbours behind it
    (labelled already when it is reached, in edge order: the order decoding adds
    their rows), then to those ahead (sent messages); its weights are ``1 / n_s`` and
    the share of chains ending at it. Returns the messages' size, ``incoming`` and
    (steps, links, weights) of the forward and the backward sweep."""
    n, ends = k.shape[0], nbr.shape[0]
    edges = ends // 2
    labels = np.empty(edges, np.int64)  # each edge's two ends' label counts, added
    for v in range(n):
        for p in range(start[v], start[v + 1]):
            if lower[p]:
                labels[edge[p]] = k[v] + k[nbr[p]]
    to_high = np.empty(edges, np.int64)
    size = 0
    for e in range(edges):  # the message to the higher node, then the one to the lower
        to_high[e] = size
        size += labels[e]
    incoming, msg_out = np.empty(ends, np.int64), np.empty(ends, np.int64)
    later, earlier = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for v in range(n):
        for p in range(start[v], start[v + 1]):
            high = k[nbr[p]] if lower[p] else k[v]
            to_low = to_high[edge[p]] + high
            incoming[p], msg_out[p] = (to_low, to_high[edge[p]]) if lower[p] else (to_high[edge[p]], to_low)
            later[v] += lower[p]
            earlier[v] += not lower[p]
    forward = _sweep_plan(start, nbr, edge, lower, offset, incoming, msg_out, later, earlier, True)
    backward = _sweep_plan(start, nbr, edge, lower, offset, incoming, msg_out, later, earlier, False)
    return size, incoming, forward[0], forward[1], forward[2], backward[0], backward[1], backward[2]


@_jit
def _sweep_plan(
    start: np.ndarray, nbr: np.ndarray, edge: np.ndarray, lower: np.ndarray,
    offset: np.ndarray, incoming: np.ndarray, msg_out: np.ndarray, later: np.ndarray,
    earlier: np.ndarray, forward: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = start.shape[0] - 1
    steps, links, weights = np.empty((n, 5), np.int64), np.empty((nbr.shape[0], 6), np.int64), np.empty((n, 2))
    at = 0
    for i in range(n):
        v = i if forward else n - 1 - i
        steps[i, 0], steps[i, 1], steps[i, 2], steps[i, 3] = v, start[v], start[v + 1], at
        for ahead in (False, True):
            for p in range(start[v], start[v + 1]):
                if (lower[p] == forward) == ahead:  # the neighbour comes later in the sweep
                    links[at, 0], links[at, 1], links[at, 2] = ahead, nbr[p], offset[edge[p]]
                    links[at, 3], links[at, 4], links[at, 5] = incoming[p], msg_out[p], lower[p]
                    at += 1
        steps[i, 4] = at
        chains = max(later[v], earlier[v], 1)
        weights[i, 0] = 1.0 / chains
        weights[i, 1] = (chains - (later[v] if forward else earlier[v])) / chains
    return steps, links, weights


@_inline
def index(i: int) -> np.uint64:
    """``i`` as an unsigned array index. numba wraps a signed index round when it is
    negative: a test and an add on every access, unless the compiler can prove the
    index is not, which it cannot for an offset read from an array. The sweep
    indexes unsigned wherever it reads at such an offset: its sweeps run 1.45x
    faster on LLaMA3-70B and Qwen3-8B 8x8, 2.1x on LLaMA3-8B 8x8x8, same bits."""
    return np.uint64(i)


@_inline
def _add_row(
    score: np.ndarray, kv: int, tables: np.ndarray, link: int, links: np.ndarray,
    ku: int, label: int, msg: np.ndarray,
) -> None:
    """``score[s] += table(s, label) - message[s]`` for the neighbour's ``label``
    (``links[link]`` names the table and the message)."""
    at, inbound = index(links[link, 2]), index(links[link, 3])
    if links[link, 5]:  # rows ours: the label picks a column
        o, step = at + index(label), index(ku)
    else:  # else it picks a row
        o, step = at + index(label * kv), ONE
    for s in range(kv):
        score[s] = score[s] + (tables[o] - msg[inbound])
        o += step
        inbound += ONE


@_inline
def _send(
    th: np.ndarray,
    kv: int,
    gamma: float,
    tables: np.ndarray,
    link: int,
    links: np.ndarray,
    msg: np.ndarray,
    out: np.ndarray,
    ku: int,
    w: np.ndarray,
) -> None:
    """``out[j] = min_s table(s, j) + w[s]`` for ``j < ku``, ``w[s] = gamma * th[s] -
    message[s]`` for ``s < kv`` (``w``: scratch), each entry a running minimum over
    ``s`` in order, whichever way round the table is stored: one store per entry
    (updating the whole message per row compiles to masked stores, slower), several
    entries at a time (their chains of comparisons overlap). Where the table's rows
    are ours, an entry's neighbours in ``j`` are adjacent in memory: eight at a time
    there (6-9% faster sweeps on the 2-D benchmark problems, 12-28% on 3-D)."""
    at, inbound = index(links[link, 2]), index(links[link, 3])
    for s in range(kv):
        w[s] = gamma * th[s] - msg[inbound + index(s)]
    j = 0
    if links[link, 5]:  # entry (s, j) at ``at + s * ku + j``
        row = index(ku)
        while j + 8 <= ku:
            b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = np.inf
            o = at + index(j)
            for s in range(kv):
                ws = w[s]
                b0 = min(b0, tables[o] + ws)
                b1 = min(b1, tables[o + ONE] + ws)
                b2 = min(b2, tables[o + index(2)] + ws)
                b3 = min(b3, tables[o + index(3)] + ws)
                b4 = min(b4, tables[o + index(4)] + ws)
                b5 = min(b5, tables[o + index(5)] + ws)
                b6 = min(b6, tables[o + index(6)] + ws)
                b7 = min(b7, tables[o + index(7)] + ws)
                o += row
            out[j], out[j + 1], out[j + 2], out[j + 3] = b0, b1, b2, b3
            out[j + 4], out[j + 5], out[j + 6], out[j + 7] = b4, b5, b6, b7
            j += 8
        step, stride = ONE, row
    else:  # entry (s, j) at ``at + j * kv + s``
        col = index(kv)
        while j + 4 <= ku:
            b0 = b1 = b2 = b3 = np.inf
            o = at + index(j * kv)
            for s in range(kv):
                ws = w[s]
                b0 = min(b0, tables[o] + ws)
                b1 = min(b1, tables[o + col] + ws)
                b2 = min(b2, tables[o + index(2 * kv)] + ws)
                b3 = min(b3, tables[o + index(3 * kv)] + ws)
                o += ONE
            out[j], out[j + 1], out[j + 2], out[j + 3] = b0, b1, b2, b3
            j += 4
        step, stride = col, ONE
    for j in range(j, ku):
        best = np.inf
        o = at + index(j) * step
        for s in range(kv):
            best = min(best, tables[o] + w[s])
            o += stride
        out[j] = best


@_inline
def _least(a: np.ndarray, n: int) -> float:
    out = np.inf
    for i in range(n):
        out = min(out, a[i])
    return out


@_inline
def _first_least(a: np.ndarray, n: int) -> int:
    """``np.argmin(a[:n])`` (the first of equal minima)."""
    best = 0
    for i in range(1, n):
        if a[i] < a[best]:
            best = i
    return best


@_jit
def sweep(
    theta: np.ndarray,
    starts: np.ndarray,
    msg: np.ndarray,
    tables: np.ndarray,
    plan: np.ndarray,
    links: np.ndarray,
    incoming: np.ndarray,
    weights: np.ndarray,
    big: float,
) -> tuple[np.ndarray, float]:
    """One TRW-S sweep (module docstring): update the messages in ``msg`` in place,
    decode a labeling, and return it with the sweep's lower bound.

    ``theta[starts[v]:starts[v + 1]]`` is node ``v``'s unary. Row ``i`` of ``plan``
    describes the ``i``-th node of the sweep: (node, first and end rows of its
    ``incoming`` positions, first and end rows of its ``links``); ``weights[i]`` its
    (gamma, share of the bound held by chains ending there). A link row is (1 if
    the neighbour is ahead in the sweep, the neighbour, where its table starts in
    ``tables``, where the message from the neighbour starts in ``msg``, where the
    one to it starts, 1 if the table's rows are this node's strategies). Each
    table is read in the orientation it is stored in, so none is copied."""
    n = plan.shape[0]
    kmax = 0
    for v in range(n):
        kmax = max(kmax, starts[v + 1] - starts[v])
    x = np.zeros(n, dtype=np.int64)
    th, score, out, w = np.empty(kmax), np.empty(kmax), np.empty(kmax), np.empty(kmax)
    bound = 0.0
    for i in range(n):
        v, in_lo, in_hi = plan[i, 0], plan[i, 1], plan[i, 2]
        link_lo, link_hi = plan[i, 3], plan[i, 4]
        kv, lo = starts[v + 1] - starts[v], starts[v]
        gamma, end = weights[i, 0], weights[i, 1]
        # messages first, then the unary: numpy's order, kept so that no plan changed
        for s in range(kv):
            th[s] = 0.0
        # element by element: array slices would allocate and count references
        for p in range(in_lo, in_hi):
            at = index(incoming[p])
            for s in range(kv):
                th[s] += msg[at]
                at += ONE
        at = index(lo)
        for s in range(kv):
            th[s] = theta[at] + th[s] if in_hi > in_lo else theta[at]
            at += ONE
        bound += end * _least(th, kv)
        for s in range(kv):
            score[s] = th[s]
        for p in range(link_lo, link_hi):
            if not links[p, 0]:  # a labelled neighbour: its table row replaces its message
                u = links[p, 1]
                _add_row(score, kv, tables, p, links, starts[u + 1] - starts[u], x[u], msg)
        x[v] = _first_least(score, kv)
        for p in range(link_lo, link_hi):
            if links[p, 0]:
                u = links[p, 1]
                ku = starts[u + 1] - starts[u]
                _send(th, kv, gamma, tables, p, links, msg, out, ku, w)
                d = _least(out, ku)
                bound += d
                at = index(links[p, 4])
                for j in range(ku):
                    msg[at] = out[j] - d
                    at += ONE
    for j in range(msg.shape[0]):
        msg[j] = min(msg[j], big)
    return x, bound


class _Best:
    """The best labeling decoded so far, and whether local search has seen it."""

    def __init__(
        self,
        mrf: Mrf,
        unary: np.ndarray,  # flat, as ``Mrf.energy`` takes it
        improve: Callable[[np.ndarray, bool], np.ndarray] | None,
    ) -> None:
        self.mrf, self.unary, self._improve = mrf, unary, improve
        self.x: np.ndarray | None = None
        self.energy = math.inf
        self.fresh = False

    def offer(self, x: np.ndarray) -> None:
        energy = self.mrf.energy(x, self.unary)
        if energy < self.energy:
            self.x, self.energy, self.fresh = x, energy, True

    def improve(self, final: bool) -> None:
        if self._improve is None or not self.fresh:
            return
        self.fresh = False
        y = self._improve(self.x, final)
        energy = self.mrf.energy(y, self.unary)
        if energy <= self.energy:
            self.x, self.energy = y, energy

    def within(self, bound: float, gap: float) -> bool:
        return within_gap(self.energy, bound, gap)


def within_gap(energy: float, bound: float, gap: float) -> bool:
    """Whether ``energy`` is proven within a relative ``gap`` of the optimum by ``bound``."""
    return energy - bound <= gap * max(abs(energy), abs(bound), 1.0)


def _stalled(
    history: list[tuple[float, float]], bound: float, energy: float, patience: int
) -> bool:
    """Over the last ``patience`` sweeps the energy did not improve and the bound either
    did not move or rose by under ``STALL_GAP_SHARE`` of the gap left, so that closing
    the gap at that pace would take hundreds of sweeps more. Where the LP relaxation
    is fractional TRW-S's bound creeps towards it for hundreds of sweeps after the
    plan stopped changing (``experiments/solver_bench``)."""
    history.append((bound, energy))
    if len(history) <= patience:
        return False
    old_bound, old_energy = history[-1 - patience]
    scale = STALL_RTOL * max(abs(energy), abs(bound), 1.0)
    if old_energy - energy > scale:
        return False
    rise = bound - old_bound
    return rise <= scale or rise < STALL_GAP_SHARE * (energy - bound)
