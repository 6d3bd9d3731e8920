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

from torchtitan_autoparallel.planner.solvers import kernels
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


class Trws:
    """Message buffers and per-node work lists; messages persist across ``run`` calls,
    so a run with a slightly changed unary (the Lagrangian loop) starts warm."""

    def __init__(self, mrf: Mrf) -> None:
        self.mrf = mrf
        self.starts = mrf.starts
        ends = _Ends(mrf)
        self.msg = np.zeros(int(ends.msg_end))
        # per node, the messages into it in edge order: the order their sum takes
        into = np.lexsort((ends.edge, ends.node))
        self.incoming = ends.msg_in[into]
        self.forward = _sweep_plan(ends, forward=True)
        self.backward = _sweep_plan(ends, forward=False)

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
        return kernels.trws_sweep(
            unary, self.starts, self.msg, self.mrf.flat, plan.steps, plan.links,
            self.incoming, plan.weights, self.mrf.big,
        )


@dataclass
class _SweepPlan:
    """One sweep's order and per-node work, as ``kernels.trws_sweep`` reads it."""

    steps: np.ndarray  # (n, 5) int64
    links: np.ndarray  # (2E, 6) int64
    weights: np.ndarray  # (n, 2) gamma, share of the bound


class _Ends:
    """Each edge seen from both of its nodes (first every edge from its lower node,
    then from its higher one): the node, the neighbour, the edge, where the
    messages into and out of the node sit in ``Trws.msg`` (the one to the higher
    node of edge ``e``, then the one to its lower node, edge after edge), where
    the table starts, and whether the node indexes its rows (the lower one does)."""

    def __init__(self, mrf: Mrf) -> None:
        low, high = mrf.edges[:, 0], mrf.edges[:, 1]
        count = len(low)
        sizes = np.stack([mrf.k[high], mrf.k[low]], axis=1).ravel()
        msg_at = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        to_high, to_low = msg_at[:-1:2], msg_at[1::2]
        self.msg_end = msg_at[-1]
        self.node = np.concatenate([low, high])
        self.other = np.concatenate([high, low])
        self.edge = np.tile(np.arange(count, dtype=np.int64), 2)
        self.msg_in = np.concatenate([to_low, to_high])
        self.msg_out = np.concatenate([to_high, to_low])
        self.table_at = np.tile(np.asarray(mrf.offset, dtype=np.int64), 2)
        self.rows = np.repeat(np.array([1, 0], dtype=np.int64), count)
        n = mrf.num_nodes
        self.later = np.bincount(low, minlength=n)  # neighbours after the node
        self.earlier = np.bincount(high, minlength=n)
        self.chains = np.maximum(np.maximum(self.later, self.earlier), 1)


def _sweep_plan(ends: _Ends, forward: bool) -> _SweepPlan:
    """The sweep visiting nodes in index order (``forward``) or backwards: per node
    its incoming messages (laid out by node in ``Trws.incoming``), then its links,
    first to the neighbours behind it (labelled already when it is reached, in
    edge order: the order decoding adds their rows), then to those ahead (sent
    messages), and its weights (``1 / n_s`` and the share of chains ending at it)."""
    n = len(ends.chains)
    ahead_is_higher = ends.rows == 1  # ends whose neighbour comes later in index order
    ahead = ahead_is_higher if forward else ~ahead_is_higher
    position = ends.node if forward else n - 1 - ends.node
    order = np.lexsort((ends.edge, ahead, position))
    links = np.stack(
        [ahead.astype(np.int64), ends.other, ends.table_at, ends.msg_in, ends.msg_out, ends.rows],
        axis=1,
    )[order]
    nodes = np.arange(n, dtype=np.int64) if forward else np.arange(n - 1, -1, -1, dtype=np.int64)
    degree = ends.later + ends.earlier
    in_at = np.concatenate([[0], np.cumsum(degree)]).astype(np.int64)
    link_at = np.concatenate([[0], np.cumsum(degree[nodes])]).astype(np.int64)
    steps = np.stack([nodes, in_at[nodes], in_at[nodes + 1], link_at[:-1], link_at[1:]], axis=1)
    n_ahead = (ends.later if forward else ends.earlier)[nodes]
    chains = ends.chains[nodes]
    weights = np.stack([1.0 / chains, (chains - n_ahead) / chains], axis=1)
    return _SweepPlan(steps.reshape(-1, 5), links.reshape(-1, 6), weights.reshape(-1, 2))


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
