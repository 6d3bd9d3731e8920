"""Redistribution cost tables: every (source, target) pair of one tensor shape at once.

``cost_model`` prices one pair of placements with a Dijkstra over per-mesh-dim
moves. A cost table on a 3-D mesh asks for hundreds of thousands of pairs (a
LLaMA3-70B step on 8x8x8: about a million), and run pair by pair in Python
those searches were nine tenths of building the problem. ``Pricer`` shares
what the pairs of one shape have in common:

* a state is an int, one base-``RADIX`` digit per mesh dim, each digit
  numbering a placement code; each move (state, mesh dim, new code) is priced
  once per shape by ``cost_model``'s own rules and kept for every pair;
* a whole table is filled by one compiled loop (``_fill``), which stops at
  the first move not priced yet: Python prices it, with the other moves out of
  the same state that search is about to relax, and the loop resumes at that
  pair. A shape has few moves (tens of thousands in all on LLaMA3-70B 8x8x8)
  next to its pairs, so the loop rarely stops.

The searches take the same moves, add their prices left to right along a path
and keep the least, as ``cost_model._plan`` does, so every time equals
``cost_model.redistribute_time_us`` bit for bit (tests/planner/test_cost_model.py).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from torch.distributed.tensor.placement_types import Placement

from torchtitan_autoparallel import jit
from torchtitan_autoparallel.planner.cost import cost_model
from torchtitan_autoparallel.planner.cost.cost_model import (
    Code,
    _codes,
    _options,
    _step_cost,
    _supported,
    _time_cached,
    _transition,
    mesh_dim_links,
)
from torchtitan_autoparallel.planner.cost.profiles import HardwareProfile

RADIX = 64  # placement codes one pricer can number (one digit of a state)
_EMPTY = -1  # a free slot of a ``_Prices`` table (keys are >= 0)
_jit = jit.jit
_inline = jit.inline
# run as Python (``jit.compiled(False)``), numpy warns where the hash's products wrap, as
# they do compiled: the wrap is the hash
warnings.filterwarnings("ignore", "overflow encountered in scalar multiply", RuntimeWarning, __name__)


class _Prices:
    """Key -> price, an open-addressing hash table in two arrays that the compiled
    loop reads and adds to in place (numba's typed dict costs half a second to
    set up in each process)."""

    def __init__(self, capacity: int = 1 << 10) -> None:
        self.keys = np.full(capacity, _EMPTY, dtype=np.int64)
        self.prices = np.zeros(capacity)
        self.size = 0

    def reserve(self, more: int) -> None:
        """Room for ``more`` keys, the table staying at most half full (short probes)."""
        capacity = len(self.keys)
        while 2 * (self.size + more) > capacity:
            capacity *= 2
        if capacity > len(self.keys):
            keys, prices = self.keys, self.prices
            self.keys = np.full(capacity, _EMPTY, dtype=np.int64)
            self.prices = np.zeros(capacity)
            _rehash(keys, prices, self.keys, self.prices)

    def put(self, key: int, price: float) -> None:
        self.reserve(1)
        self.size += _put(self.keys, self.prices, key, price)


class Pricer:
    """Redistribution times of one (shape, dtype, mesh, profile), for any placements."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype_bytes: int,
        mesh_shape: tuple[int, ...],
        profile: HardwareProfile,
    ) -> None:
        self.shape, self.dtype_bytes = shape, dtype_bytes
        self.mesh_shape, self.profile = mesh_shape, profile
        self.links = mesh_dim_links(mesh_shape, profile)
        self.radix = RADIX
        self.powers = np.array([RADIX**i for i in range(len(mesh_shape))], dtype=np.int64)
        self.codes: list[Code] = []
        self.number: dict[Code, int] = {}
        # what a search may pass through besides a pair's ends (``cost_model._options``)
        self.replicate = self._num(cost_model._R)
        self.partial_sum = self._num(("P", "sum"))
        self.shards = np.array([self._num(("S", d)) for d in range(len(shape))], dtype=np.int64)
        self.supported = np.zeros((0, 0), dtype=np.bool_)  # [s, t]: one mesh dim's s -> t
        self.moves = _Prices()
        self.priced: set[int] = set()  # the keys in ``moves``, for Python's look-ups
        # (start, goal) -> time, keyed start * states + goal while that fits an int64
        self.states = RADIX ** len(mesh_shape)
        self.times = _Prices() if self.states < 2**31 else None
        self.work = _work_buffers(len(mesh_shape), 3 + len(shape))

    def _num(self, c: Code) -> int:
        if c not in self.number:
            self.number[c] = len(self.codes)
            self.codes.append(c)
        return self.number[c]

    def encode(self, codes: tuple[Code, ...]) -> int:
        """The state of ``codes``; -1 once the codes outgrow a digit."""
        if len(self.codes) + len(codes) > self.radix:
            return -1
        return sum(self._num(c) * int(p) for c, p in zip(codes, self.powers))

    def table(self, srcs: list[tuple[Code, ...]], dsts: list[tuple[Code, ...]]) -> np.ndarray:
        """``out[a, b]``: the time of ``srcs[a] -> dsts[b]`` (``inf`` when impossible)."""
        starts = np.array([self.encode(src) for src in srcs], dtype=np.int64)
        goals = np.array([self.encode(dst) for dst in dsts], dtype=np.int64)
        self._number_supported()
        out = np.empty((len(srcs), len(dsts)), dtype=np.float64)
        todo = np.ones(out.shape, dtype=np.bool_)
        for a, b in zip(*np.nonzero((starts[:, None] < 0) | (goals[None, :] < 0))):
            args = (self.shape, self.dtype_bytes, srcs[a], dsts[b], self.mesh_shape, self.profile)
            out[a, b] = _time_cached(*args)
            todo[a, b] = False
        self._fill(out, todo, starts, goals)
        return out

    def _number_supported(self) -> None:
        n = len(self.codes)
        if self.supported.shape[0] < n:
            self.supported = np.array(
                [[_supported(s, t) for t in self.codes] for s in self.codes], dtype=np.bool_
            )

    def _fill(self, out: np.ndarray, todo: np.ndarray, starts: np.ndarray, goals: np.ndarray) -> None:
        """Search the ``todo`` pairs, pricing each move a search asks for as it asks."""
        times = self.times if self.times is not None else _Prices(capacity=2)
        memo = self.times is not None
        if memo:
            times.reserve(int(todo.sum()))
        at = 0  # the flat index of the pair to go on from
        while True:
            added, at, key = _fill(
                out, todo, at, starts, goals, self.supported, self.powers, self.radix,
                self.states if memo else 0, self.replicate, self.partial_sum, self.shards,
                self.moves.keys, self.moves.prices, times.keys, times.prices, *self.work,
            )
            times.size += added
            if key == _EMPTY:
                return
            a, b = divmod(at, out.shape[1])
            self._price_state(key // self.radix // len(self.powers), int(starts[a]), int(goals[b]))

    def _price_state(self, state: int, start: int, goal: int) -> None:
        """Price every move out of ``state`` that the search from ``start`` to ``goal``
        may take: it stopped at one of them while expanding the state, and it relaxes
        them all there (but those to states it settled), so one stop, not several."""
        for i, power in enumerate(self.powers.tolist()):
            cur = state // power % self.radix
            src, dst = (self.codes[end // power % self.radix] for end in (start, goal))
            for code in _options(src, dst, len(self.shape)):
                new = self.number[code]
                key = (state * len(self.powers) + i) * self.radix + new
                if new != cur and key not in self.priced:
                    self._price(key)

    def _price(self, key: int) -> None:
        """Price the move ``key`` names (``_search``'s numbering) by cost_model's rules."""
        rest, new = divmod(key, self.radix)
        state, i = divmod(rest, len(self.powers))
        codes = tuple(self.codes[state // int(p) % self.radix] for p in self.powers)
        move = _transition(self.shape, self.dtype_bytes, codes, i, self.codes[new], self.mesh_shape)
        if move is None:
            cost = math.inf
        elif move[0] == "free":
            cost = 0.0
        else:
            cost = _step_cost(move[0], move[1], self.mesh_shape[i], self.links[i])
        self.moves.put(key, cost)
        self.priced.add(key)


@lru_cache(maxsize=16)
def _work_buffers(ndims: int, width: int) -> tuple[np.ndarray, ...]:
    """A search's scratch arrays (``_search``): per mesh dim up to ``width`` options
    (its two ends, Replicate and every Shard), so up to ``width ** ndims`` states,
    each relaxing every other option of every dim once at most. Shared by every
    pricer of that size (one search runs at a time), not made per shape."""
    states = width**ndims
    pushes = states * ndims * width + 1
    return (
        np.empty((ndims, width), np.int64),  # options
        np.empty(ndims, np.int64),  # option count
        np.empty(ndims, np.int64),  # stride of a dim's digit in a local state
        np.empty(states),  # distance
        np.empty(states, np.bool_),  # settled
        np.empty(pushes),  # heap: cost
        np.empty(pushes, np.int64),  # heap: local state
    )


# ---------------------------------------------------------------- compiled loops


@_inline
def _slot(keys, key):
    """Where ``key`` is in the table, or the free slot where it would go."""
    mask = len(keys) - 1  # the capacity is a power of two
    # splitmix64's finaliser (arithmetic shifts, wrapping products): every bit of the
    # key reaches the low bits the mask keeps; keys differ mostly in their high digits
    x = (key ^ (key >> 30)) * -4658895280553007687
    x = (x ^ (x >> 27)) * -7723592293110705685
    at = (x ^ (x >> 31)) & mask
    while keys[at] != _EMPTY and keys[at] != key:
        at = (at + 1) & mask
    return at


@_jit
def _put(keys, prices, key, price):
    """Set ``key``'s price; 1 if the key is new, else 0."""
    at = _slot(keys, key)
    new = keys[at] == _EMPTY
    keys[at] = key
    prices[at] = price
    return 1 if new else 0


@_jit
def _rehash(old_keys, old_prices, keys, prices):
    for i in range(len(old_keys)):
        if old_keys[i] != _EMPTY:
            _put(keys, prices, old_keys[i], old_prices[i])


@_jit
def _fill(
    out, todo, at, starts, goals, supported, powers, radix, states, replicate, partial_sum,
    shards, move_keys, move_prices, time_keys, time_prices, opts, count, stride, dist,
    settled, heap_cost, heap_node,
):
    """Each ``todo`` pair's time into ``out``, from the flat index ``at`` on, until a
    search meets a move not priced yet. ``states`` > 0: found times are kept in (and
    read from) the times table under ``start * states + goal``. Returns (times added,
    the pair to go on from, the move's key or ``_EMPTY`` when all are done). The
    arrays from ``opts`` on are scratch (``_work_buffers``)."""
    ndims = len(powers)
    cols = out.shape[1]
    added, slot = 0, 0
    for flat in range(at, out.size):
        a, b = flat // cols, flat % cols
        if not todo[a, b]:
            continue
        start, goal = starts[a], goals[b]
        if start == goal:
            out[a, b] = 0.0
            continue
        ok = True
        for i in range(ndims):
            ok = ok and supported[start // powers[i] % radix, goal // powers[i] % radix]
        if not ok:
            out[a, b] = np.inf
            continue
        if states > 0:
            slot = _slot(time_keys, start * states + goal)
            if time_keys[slot] != _EMPTY:
                out[a, b] = time_prices[slot]
                continue
        cost, key = _search(
            start, goal, powers, radix, replicate, partial_sum, shards, move_keys,
            move_prices, opts, count, stride, dist, settled, heap_cost, heap_node,
        )
        if key != _EMPTY:
            return added, flat, key
        out[a, b] = cost
        if states > 0:
            time_keys[slot] = start * states + goal
            time_prices[slot] = cost
            added += 1
    return added, out.size, _EMPTY


@_inline
def _search(
    start, goal, powers, radix, replicate, partial_sum, shards, move_keys, move_prices,
    opts, count, stride, dist, settled, heap_cost, heap_node,
):
    """(least time from ``start`` to ``goal``, ``_EMPTY``), or (nan, the first move key
    ``(state * ndims + dim) * radix + code`` not priced yet).

    The search space is ``cost_model._options`` per mesh dim: the dim's two ends
    and Replicate, plus every Shard when it ends in Partial(sum). A local state
    numbers the option picked in each dim (mixed radix; the start is 0)."""
    ndims = len(powers)
    states, target = 1, 0
    for i in range(ndims):
        src = start // powers[i] % radix
        dst = goal // powers[i] % radix
        opts[i, 0] = src
        c = _add_option(opts, i, 1, dst)
        c = _add_option(opts, i, c, replicate)
        if dst == partial_sum:
            for d in range(len(shards)):
                c = _add_option(opts, i, c, shards[d])
        for m in range(c):
            if opts[i, m] == dst:
                target += m * states
        count[i] = c
        stride[i] = states
        states *= c
    for s in range(states):
        dist[s] = np.inf
        settled[s] = False
    dist[0] = 0.0
    heap_cost[0], heap_node[0], size = 0.0, 0, 1
    while size > 0:
        cost, node = heap_cost[0], heap_node[0]
        size -= 1
        if size > 0:  # the last entry sifts down from the root
            last_cost, last_node, at = heap_cost[size], heap_node[size], 0
            while 2 * at + 1 < size:
                child = 2 * at + 1
                if child + 1 < size and heap_cost[child + 1] < heap_cost[child]:
                    child += 1
                if heap_cost[child] >= last_cost:
                    break
                heap_cost[at], heap_node[at] = heap_cost[child], heap_node[child]
                at = child
            heap_cost[at], heap_node[at] = last_cost, last_node
        if node == target:
            return cost, _EMPTY
        if settled[node]:
            continue
        settled[node] = True
        state = 0
        for i in range(ndims):
            state += opts[i, node // stride[i] % count[i]] * powers[i]
        for i in range(ndims):
            digit = node // stride[i] % count[i]
            for j in range(count[i]):
                nxt = node + (j - digit) * stride[i]
                if j == digit or settled[nxt]:
                    continue
                key = (state * ndims + i) * radix + opts[i, j]
                slot = _slot(move_keys, key)
                if move_keys[slot] != key:
                    return np.nan, key
                total = cost + move_prices[slot]
                if total < dist[nxt]:
                    dist[nxt] = total
                    at = size  # sift up
                    size += 1
                    while at > 0 and heap_cost[(at - 1) // 2] > total:
                        heap_cost[at], heap_node[at] = heap_cost[(at - 1) // 2], heap_node[(at - 1) // 2]
                        at = (at - 1) // 2
                    heap_cost[at], heap_node[at] = total, nxt
    return np.inf, _EMPTY


@_inline
def _add_option(opts, i, count, code):
    """``opts[i, :count]`` plus ``code`` unless it is there already; the new count."""
    for m in range(count):
        if opts[i, m] == code:
            return count
    opts[i, count] = code
    return count + 1


# ---------------------------------------------------------------- entry points


@lru_cache(maxsize=256)
def pricer(shape: tuple[int, ...], dtype_bytes: int, mesh_shape: tuple[int, ...], profile: HardwareProfile) -> Pricer:
    return Pricer(shape, dtype_bytes, mesh_shape, profile)


def redistribute_cost_matrix(
    shape: tuple[int, ...],
    dtype_bytes: int,
    srcs: Sequence[tuple[Placement, ...]],
    dsts: Sequence[tuple[Placement, ...]],
    mesh_shape: tuple[int, ...],
    profile: HardwareProfile,
) -> np.ndarray:
    """``out[a, b] = cost_model.redistribute_time_us(..., srcs[a], dsts[b], ...)`` (float64)."""
    shape_t, mesh_t = tuple(map(int, shape)), tuple(map(int, mesh_shape))
    src_cs = [_codes(p, shape_t, mesh_t) for p in srcs]
    dst_cs = [_codes(p, shape_t, mesh_t) for p in dsts]
    return pricer(shape_t, int(dtype_bytes), mesh_t, profile).table(src_cs, dst_cs)


def clear_caches() -> None:
    """Forget memoised pricers and ``cost_model``'s plans (tests, or a changed profile)."""
    pricer.cache_clear()
    cost_model.clear_caches()
