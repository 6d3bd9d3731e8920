"""Dead-end elimination that stays exact for ``energy(x) - savings(x)``.

A node the overlap presolve must keep (``overlap.presolve``) may still drop a
strategy ``s`` when some ``t`` is at least as good for the overlap objective
in every context. Swapping ``s`` for ``t`` changes the energy by the plain
Goldstein difference, and can lower the savings by at most

    sum_e max(0, comm_e(s) - comm_e(t)) + sum_j max(0, c_j(s) - c_j(t))

over the node's overlappable edges ``e`` and its (tied) member nodes ``j``:
a cap lowered by ``d`` costs at most ``d`` of savings (lower that saving), and
compute lowered by ``d`` costs at most ``d`` (lower the savings anchored after
it, earliest first, by ``d`` in total: every budget stays >= 0). So ``s`` goes
when, in every context of the neighbours,

    U[s] - U[t] - loss_free[s, t] + sum_u min_j (T_u[s, j] - T_u[t, j] - loss_u[s, t, j]) >= 0

(and ``t`` uses no more memory). ``loss_free`` gathers the context-free parts:
compute, edges inside the tie group and edges to fixed neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from torchtitan_autoparallel.planner.solve.presolve.reduce import DOMINANCE_MAX_WORK, swap_difference

CHUNK = 4_000_000  # elements of the (rows, k, width) difference block built at once


@dataclass
class NodeOverlap:
    """What one (tie-collapsed) node prices in the savings model, in collapsed strategy indices."""

    compute: np.ndarray | None = None  # (distinct member rows, k) compute
    weight: np.ndarray | None = None  # how many members share each row
    diagonals: list[np.ndarray] = field(default_factory=list)  # edges inside the tie group
    tables: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (other node, this-node-first table)

    @property
    def endpoint(self) -> bool:
        return bool(self.diagonals or self.tables)


def _relu_pairs(values: np.ndarray, weight: np.ndarray | None = None) -> np.ndarray:
    """``sum_m w_m max(0, values[m, s] - values[m, t])`` as a (k, k) matrix."""
    values = np.atleast_2d(values)
    w = np.ones(len(values)) if weight is None else weight
    diff = np.maximum(values[:, :, None] - values[:, None, :], 0.0)
    return np.tensordot(w, diff, axes=1)


def free_loss(node: NodeOverlap, domain: np.ndarray, fixed: dict[int, int]) -> np.ndarray:
    """The context-free part of the loss: compute, edges inside the group, edges to fixed nodes."""
    k = len(domain)
    loss = np.zeros((k, k))
    if node.compute is not None:
        loss += _relu_pairs(_finite(node.compute[:, domain]), node.weight)
    for diag in node.diagonals:
        loss += _relu_pairs(_finite(diag[domain]))
    for other, table in node.tables:
        if other in fixed:
            loss += _relu_pairs(_finite(table[domain, fixed[other]]))
    return loss


def worst_difference_with_loss(table: np.ndarray, losses: list[np.ndarray]) -> np.ndarray:
    """``min_j (table[s, j] - table[t, j] - sum_l max(0, l[s, j] - l[t, j]))`` per ``(s, t)``,
    with ``inf`` entries handled as in ``reduce.swap_difference``."""
    k, width = table.shape
    losses = [_finite(x) for x in losses]
    out = np.empty((k, k))
    rows = max(1, CHUNK // max(1, k * width * (1 + len(losses))))
    for i in range(0, k, rows):
        diff = swap_difference(table[i : i + rows, None, :], table[None, :, :], finite=False)
        for x in losses:
            diff -= np.maximum(x[i : i + rows, None, :] - x[None, :, :], 0.0)
        out[i : i + rows] = diff.min(axis=2)
    return out


def overlap_margin(graph, v: int, node: NodeOverlap) -> np.ndarray | None:  # noqa: ANN001 (reduce.Graph)
    """``margin[s, t]`` of the module docstring for node ``v``; None when not checkable."""
    dom = graph.domain[v]
    k = len(dom)
    fixed = {}
    for other, _ in node.tables:
        if not graph.alive[other]:
            if len(graph.domain[other]) != 1:
                return None  # cannot happen: an edge's ends go only once fixed
            fixed[other] = int(graph.domain[other][0])
    per_neighbour: dict[int, list[np.ndarray]] = {}
    for other, table in node.tables:
        if other not in fixed:
            if other not in graph.adj[v]:
                return None
            per_neighbour.setdefault(other, []).append(table[np.ix_(dom, graph.domain[other])])
    work = sum(t.shape[1] * (1 + len(per_neighbour.get(u, []))) for u, t in graph.adj[v].items())
    if k * k * work > DOMINANCE_MAX_WORK:
        return None
    unary = graph.unary[v]
    margin = unary[:, None] - unary[None, :] - free_loss(node, dom, fixed)
    for u, table in graph.adj[v].items():
        margin += worst_difference_with_loss(table, per_neighbour.get(u, []))
    return margin


def _finite(x: np.ndarray) -> np.ndarray:
    # an inf entry is a forbidden pair: the table itself already prices it
    x = np.asarray(x, dtype=np.float64)
    return np.where(np.isfinite(x), x, 0.0)
