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

from torchtitan_autoparallel.planner.solvers.mrf import Mrf

OPTIMAL_RTOL = 1e-9  # energy within this of the bound: proven optimal
GAP_RTOL = 1e-3  # default stop: the plan is proven within 0.1% of the optimum
STALL_RTOL = 1e-7  # bound and energy moving less than this over ``patience`` sweeps: stop
STALL_GAP_SHARE = 0.02  # or the bound closing less than this share of the gap over them
IMPROVE_EVERY = 5  # sweeps between local searches of a new best labeling


@dataclass
class TrwsResult:
    labels: np.ndarray  # the best compact labeling decoded
    energy: float  # its energy under the unary the run used
    bound: float  # a lower bound on that energy's minimum (forbidden pairs at ``big``)
    iterations: int
    timed_out: bool


@dataclass
class _Step:
    """What one sweep does at one node (tables and message views precomputed)."""

    node: int
    incoming: np.ndarray | None  # (degree, k) positions of the messages into the node
    gamma: float
    end: float  # share of gamma * theta_hat held by chains ending here in this sweep
    # (table (k, k_to), the message coming back, the message sent) per neighbour ahead
    sends: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
    # (neighbour, table (k_from, k), the message it sent) per neighbour already swept
    behind: list[tuple[int, np.ndarray, np.ndarray]]


@dataclass
class _Link:
    """One edge seen from one of its ends."""

    other: int
    table: np.ndarray  # (k_self, k_other)
    transposed: np.ndarray  # (k_other, k_self), contiguous: the other end's ``table``
    inbound: np.ndarray  # view of the message other -> self
    outbound: np.ndarray  # view of the message self -> other


class Trws:
    """Message buffers and per-node work lists; messages persist across ``run`` calls,
    so a run with a slightly changed unary (the Lagrangian loop) starts warm."""

    def __init__(self, mrf: Mrf) -> None:
        self.mrf = mrf
        n = mrf.num_nodes
        earlier, later, incoming = self._links(mrf)
        n_fwd = np.array([len(ls) for ls in later])
        n_bwd = np.array([len(ls) for ls in earlier])
        chains = np.maximum(np.maximum(n_fwd, n_bwd), 1)
        gamma = (1.0 / chains).tolist()
        end_fwd = ((chains - n_fwd) / chains).tolist()
        end_bwd = ((chains - n_bwd) / chains).tolist()
        self.forward = [
            _Step(v, incoming[v], gamma[v], end_fwd[v], _sends(later[v]), _behind(earlier[v]))
            for v in range(n)
        ]
        self.backward = [
            _Step(v, incoming[v], gamma[v], end_bwd[v], _sends(earlier[v]), _behind(later[v]))
            for v in range(n - 1, -1, -1)
        ]

    def _links(self, mrf: Mrf) -> tuple[list[list[_Link]], list[list[_Link]], list]:
        """Allocate the message buffer; per node its links to earlier and later
        neighbours, and the buffer positions (degree, k) of its incoming messages."""
        k = mrf.k
        edges = mrf.edges.tolist()
        sizes = [int(k[node]) for a, b in edges for node in (b, a)]
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist()
        self.msg = np.zeros(starts[-1])
        earlier: list[list[_Link]] = [[] for _ in range(mrf.num_nodes)]
        later: list[list[_Link]] = [[] for _ in range(mrf.num_nodes)]
        positions: list[list[int]] = [[] for _ in range(mrf.num_nodes)]
        for e, (a, b) in enumerate(edges):
            to_b = self.msg[starts[2 * e] : starts[2 * e + 1]]
            to_a = self.msg[starts[2 * e + 1] : starts[2 * e + 2]]
            table, flipped = mrf.tables[e], np.ascontiguousarray(mrf.tables[e].T)
            later[a].append(_Link(b, table, flipped, to_a, to_b))
            earlier[b].append(_Link(a, flipped, table, to_b, to_a))
            positions[b].append(starts[2 * e])
            positions[a].append(starts[2 * e + 1])
        incoming = [
            np.stack([np.arange(p, p + k[v]) for p in ps]) if ps else None
            for v, ps in enumerate(positions)
        ]
        return earlier, later, incoming

    def run(
        self,
        unary: list[np.ndarray],
        deadline: float | None,
        improve: Callable[[np.ndarray, bool], np.ndarray] | None = None,
        gap: float = GAP_RTOL,
        max_iters: int = 1000,
        patience: int = 10,
    ) -> TrwsResult:
        """Sweep until the best labeling is within ``gap`` (relative) of the bound,
        the energy and the bound stall (``_stalled``), or the deadline passes (one
        iteration at least). ``improve`` (local search; its flag: the final,
        thorough call) refines a new best labeling every few sweeps and at the end."""
        best = _Best(self.mrf, unary, improve)
        bound, history = -math.inf, []
        it, timed_out = 0, False
        while it < max_iters:
            x_fwd, lb_fwd = self._sweep(self.forward, unary)
            x_bwd, lb_bwd = self._sweep(self.backward, unary)
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

    def _sweep(self, steps: list[_Step], unary: list[np.ndarray]) -> tuple[np.ndarray, float]:
        """One sweep: update messages, decode a labeling, return it with the sweep's bound."""
        msg = self.msg
        add, least = np.add.reduce, np.minimum.reduce
        x = np.zeros(len(unary), dtype=np.int64)
        bound = 0.0
        for step in steps:
            th = unary[step.node]
            if step.incoming is not None:
                th = th + add(msg[step.incoming], axis=0)
            bound += step.end * float(least(th))
            score = th
            for u, table, sent in step.behind:  # the neighbour's label replaces its message
                score = score + (table[x[u]] - sent)
            x[step.node] = int(np.argmin(score))
            weighted = step.gamma * th
            for table, back, out in step.sends:
                m = least(table + (weighted - back)[:, None], axis=0)
                d = float(least(m))
                bound += d
                np.subtract(m, d, out=out)
        np.minimum(msg, self.mrf.big, out=msg)  # see the module doc
        return x, bound


class _Best:
    """The best labeling decoded so far, and whether local search has seen it."""

    def __init__(
        self,
        mrf: Mrf,
        unary: list[np.ndarray],
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
        return self.energy - bound <= gap * max(abs(self.energy), abs(bound), 1.0)


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


def _sends(links: list[_Link]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    return [(link.table, link.inbound, link.outbound) for link in links]


def _behind(links: list[_Link]) -> list[tuple[int, np.ndarray, np.ndarray]]:
    return [(link.other, link.transposed, link.inbound) for link in links]
