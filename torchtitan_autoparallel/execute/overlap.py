"""Overlap communication with compute in a local-tensor step graph (``compiled.py``).

A functional collective (``_c10d_functional.all_gather_into_tensor`` etc.)
starts when it is called and is only waited for by its ``wait_tensor``. The
traced step calls each wait right after its collective, so every collective
runs alone. ``schedule_overlap`` reorders the graph in place so that each
collective is issued as early as its inputs allow and each wait runs just
before the first node that reads its result; the compute in between runs
while the collective is in flight.

Rules (all deterministic functions of the graph, so that every rank, whose
graphs call the same collectives in the same order, schedules alike):

- Compute nodes keep their relative order; only collectives and waits move.
- Collectives keep their relative issue order, and waits theirs: gloo and NCCL
  match collectives across ranks by issue order, so this must not change.
- At most ``prefetch`` collectives are in flight at once (by default
  ``planner/buckets.IN_FLIGHT``, which the memory prediction reads too):
  collective ``i`` is issued no earlier than the wait of collective ``i - prefetch``. With 1, the
  all-gather of layer k+1's weight runs while layer k computes, never all
  layers' at once; this bounds the memory of buffers in flight.
- No collective is issued later, and no wait runs earlier, than in the traced
  graph (relative to the compute nodes): if the bound holds a collective back
  until its original place, the wait that frees the slot is run there. So the
  pass can only lengthen the compute each collective overlaps with.
- A node that mutates a tensor (``copy_``, ``add_``, ...) is a barrier: no
  collective or wait crosses it, since the collective may read or write that
  tensor's memory while in flight (aliasing through views is not tracked).
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass

from torch import fx

from torchtitan_autoparallel.planner.plan.buckets import IN_FLIGHT

_NAMESPACES = ("_c10d_functional.", "c10d_functional.")


@dataclass(frozen=True)
class OverlapStats:
    collectives: int  # collective calls in the graph
    hoisted: int  # collectives issued after fewer compute nodes than before
    sunk: int  # waits run after more compute nodes than before
    mean_gap_before: float  # compute nodes between a collective and its wait, traced order
    mean_gap_after: float  # the same after scheduling

    def summary(self) -> str:
        return (
            f"{self.collectives} collectives, {self.hoisted} issued earlier, {self.sunk} waits later; "
            f"compute nodes between issue and wait {self.mean_gap_before:.1f} -> {self.mean_gap_after:.1f} on average"
        )


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).startswith(_NAMESPACES) and "wait_tensor" in str(node.target)


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).startswith(_NAMESPACES) and not is_wait(node)


def group_name(node: fx.Node) -> str | None:
    """The process group a functional collective names: its last string argument (the
    others name reduce ops)."""
    return next((a for a in reversed(node.args) if isinstance(a, str)), None)


def is_mutating(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def schedule_overlap(gm: fx.GraphModule, prefetch: int = IN_FLIGHT) -> OverlapStats:
    """Reorder ``gm`` in place as the module docstring says; return what moved."""
    if prefetch < 1:
        raise ValueError(f"prefetch must be >= 1 (collectives in flight at once), got {prefetch}")
    nodes = list(gm.graph.nodes)
    before = _positions(nodes)
    order = _Scheduler(nodes, prefetch).run()
    for prev, node in zip(order, order[1:]):
        prev.append(node)  # moves node to right after prev
    gm.graph.lint()
    gm.recompile()
    return _stats(nodes, before, _positions(order))


class _Scheduler:
    """List scheduling over the data edges plus the ordering edges of the rules."""

    def __init__(self, nodes: list[fx.Node], prefetch: int) -> None:
        self.nodes = nodes
        self.index = {n: i for i, n in enumerate(nodes)}
        self.colls = [n for n in nodes if is_collective(n)]
        self.preds: dict[fx.Node, set[fx.Node]] = {n: set(n.all_input_nodes) for n in nodes}
        self.done: set[fx.Node] = set()
        self.order: list[fx.Node] = []
        self.next_coll = 0
        self._add_order_edges(prefetch)

    def _edge(self, a: fx.Node | None, b: fx.Node | None) -> None:
        # Only edges that point forward in the traced order: that order then stays
        # a valid schedule, so the constraints can never form a cycle.
        if a is not None and b is not None and self.index[a] < self.index[b]:
            self.preds[b].add(a)

    def _add_order_edges(self, prefetch: int) -> None:
        waits = [n for n in self.nodes if is_wait(n)]
        for chain in (self.colls, waits):
            for a, b in zip(chain, chain[1:]):
                self._edge(a, b)
        waits_of: dict[fx.Node, list[fx.Node]] = {c: [] for c in self.colls}
        for w in waits:
            if _issuer(w) in waits_of:
                waits_of[_issuer(w)].append(w)
        for i, c in enumerate(self.colls):
            if i >= prefetch and waits_of[self.colls[i - prefetch]]:
                self._edge(waits_of[self.colls[i - prefetch]][-1], c)
            # Reading a collective's buffer other than through its wait reads it unfinished.
            for user in c.users:
                if not is_wait(user) and user.target is not operator.getitem and waits_of[c]:
                    self._edge(waits_of[c][-1], user)
        self._add_barriers(waits)

    def _add_barriers(self, waits: list[fx.Node]) -> None:
        """Keep every collective and wait on its traced side of each mutating node."""
        for m in (n for n in self.nodes if is_mutating(n)):
            for chain in (self.colls, waits):
                # chains are in traced order: the neighbours of m in it suffice
                at = bisect.bisect_left([self.index[n] for n in chain], self.index[m])
                self._edge(chain[at - 1] if at > 0 else None, m)
                self._edge(m, chain[at] if at < len(chain) else None)

    def run(self) -> list[fx.Node]:
        placeholders = [n for n in self.nodes if n.op == "placeholder"]
        for n in placeholders:  # the signature stays first
            self._emit(n)
        for n in self.nodes:
            if n in self.done or is_wait(n):  # waits run when something needs them
                continue
            if n.op == "output":  # whatever is still pending runs before the return
                for pending in self.nodes:
                    if pending not in self.done and pending is not n:
                        self._pull(pending)
            self._pull(n)  # a collective reached here is issued at its traced place at the latest
            self._issue_ready()
        return self.order

    def _emit(self, node: fx.Node) -> None:
        self.done.add(node)
        self.order.append(node)
        while self.next_coll < len(self.colls) and self.colls[self.next_coll] in self.done:
            self.next_coll += 1

    def _pull(self, node: fx.Node) -> None:
        """Emit ``node`` after whatever it still needs, earliest traced first."""
        stack = [node]
        while stack:
            top = stack[-1]
            missing = sorted((p for p in self.preds[top] if p not in self.done), key=self.index.__getitem__)
            if missing:
                stack.append(missing[0])
                continue
            stack.pop()
            if top not in self.done:
                self._emit(top)

    def _issue_ready(self) -> None:
        """Issue the next collectives in order while each has all it needs (the bound included)."""
        while self.next_coll < len(self.colls):
            c = self.colls[self.next_coll]
            if any(p not in self.done for p in self.preds[c]):
                return
            self._emit(c)


def _issuer(wait: fx.Node) -> fx.Node | None:
    """The collective a wait finishes (through ``getitem`` for coalesced collectives)."""
    node = wait.args[0] if wait.args else None
    while isinstance(node, fx.Node) and node.target is operator.getitem:
        node = node.args[0]
    return node if isinstance(node, fx.Node) and is_collective(node) else None


def _positions(order: list[fx.Node]) -> dict[fx.Node, int]:
    """Each node -> how many compute nodes precede it (collectives and waits do not count)."""
    out, count = {}, 0
    for n in order:
        out[n] = count
        if n.op == "call_function" and not (is_collective(n) or is_wait(n)):
            count += 1
    return out


def _stats(nodes: list[fx.Node], before: dict[fx.Node, int], after: dict[fx.Node, int]) -> OverlapStats:
    colls = [n for n in nodes if is_collective(n)]
    waits = [n for n in nodes if is_wait(n)]
    first_wait = {}
    for w in waits:
        first_wait.setdefault(_issuer(w), w)
    paired = [(c, first_wait[c]) for c in colls if c in first_wait]

    def mean_gap(pos: dict[fx.Node, int]) -> float:
        return sum(pos[w] - pos[c] for c, w in paired) / len(paired) if paired else 0.0

    return OverlapStats(
        collectives=len(colls),
        hoisted=sum(after[c] < before[c] for c in colls),
        sunk=sum(after[w] > before[w] for w in waits),
        mean_gap_before=mean_gap(before),
        mean_gap_after=mean_gap(after),
    )


__all__ = ["OverlapStats", "is_collective", "is_wait", "schedule_overlap"]
