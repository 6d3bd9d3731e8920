"""The sharding problem as plain arrays: the contract every solver reads.

A plan is one strategy index per node. Its cost is a pairwise energy

    E(x) = sum_v unary[v][x_v] + sum_e pairwise[e][x_u(e), x_v(e)]

in microseconds, subject to

    * pins: ``x_v == pins[v]`` for pinned nodes;
    * ties: nodes in one tie group choose the same strategy index (repeated
      transformer blocks share one solution; every member has the same number
      of strategies);
    * memory: ``sum_v memory[v][x_v] <= memory_budget`` (bytes per device),
      where ``memory[v]`` is None for nodes that hold no parameter.

Edges that ask the same question (repeated layers: same shapes, same
strategies) may share one read-only table object (``share_tables``): a
LLaMA3-70B problem on an 8x8x8 mesh holds 135 distinct tables for its 18868
edges, 8 MB instead of 1.5 GB. Solvers read tables and never write them.

``inf`` in a unary or pairwise table marks a forbidden choice. Solvers never
return an assignment with infinite energy; if none exists they raise
``InfeasibleProblem``.

Keeping the problem as arrays (not solver variables) means it is built in
vectorised form once and every solver is scored on exactly the same objective.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FORMAT_VERSION = 2  # 2: each distinct pairwise table stored once
READABLE_VERSIONS = (1, 2)
_item = np.ndarray.item  # ``_item(table, i, j)``: a Python float, no numpy scalar


class InfeasibleProblem(ValueError):
    """No assignment satisfies the constraints (pins, ties, forbidden pairs, memory)."""


@dataclass
class Problem:
    node_names: list[str]
    strategy_labels: list[list[str]]
    unary: list[np.ndarray]
    edges: np.ndarray  # shape (E, 2), int64: (producer, consumer) node indices
    pairwise: list[np.ndarray]  # pairwise[e].shape == (k[u], k[v])
    memory: list[np.ndarray | None] = field(default_factory=list)
    memory_budget: float | None = None
    pins: dict[int, int] = field(default_factory=dict)
    ties: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.edges = np.asarray(self.edges, dtype=np.int64).reshape(-1, 2)
        if not self.memory:
            self.memory = [None] * len(self.node_names)
        self.validate()

    @property
    def num_nodes(self) -> int:
        return len(self.node_names)

    @property
    def num_strategies(self) -> np.ndarray:
        return np.fromiter(map(len, self.unary), dtype=np.int64, count=len(self.unary))

    def validate(self) -> None:
        n = self.num_nodes
        if not (len(self.strategy_labels) == len(self.unary) == len(self.memory) == n):
            raise ValueError("node_names, strategy_labels, unary and memory differ in length")
        k = self.num_strategies
        if len(self.pairwise) != len(self.edges):
            raise ValueError("one pairwise table per edge is required")
        # tuples of Python ints: a tenth of the time of comparing numpy rows per edge
        wanted = zip(k[self.edges[:, 0]].tolist(), k[self.edges[:, 1]].tolist())
        for e, (table, shape) in enumerate(zip(self.pairwise, wanted)):
            if table.shape != shape:
                u, v = self.edges[e]
                raise ValueError(
                    f"edge {e} ({self.node_names[u]} -> {self.node_names[v]}): table "
                    f"{table.shape} != {shape}"
                )
        for v, s in self.pins.items():
            if not 0 <= s < k[v]:
                raise ValueError(f"pin of {self.node_names[v]} to {s} is out of range")
        for group in self.ties:
            if len({int(k[v]) for v in group}) > 1:
                raise ValueError(f"tie group {group} mixes strategy counts")

    def energy(self, assignment: np.ndarray) -> float:
        """The objective of an assignment, recomputed from the tables."""
        x = np.asarray(assignment, dtype=np.int64)
        # ``item`` over lists of Python ints yields Python floats: no numpy scalar per
        # term and no index tuple per edge (40% less time than ``getitem`` on
        # LLaMA3-70B), and the same additions in the same order
        total = sum(map(_item, self.unary, x.tolist()), 0.0)
        ends = x[self.edges[:, 0]].tolist(), x[self.edges[:, 1]].tolist()
        total += sum(map(_item, self.pairwise, *ends), 0.0)
        return float(total)

    def memory_used(self, assignment: np.ndarray) -> float:
        x = np.asarray(assignment, dtype=np.int64).tolist()
        return sum(float(m[s]) for m, s in zip(self.memory, x) if m is not None)

    def is_feasible(
        self, assignment: np.ndarray, tol: float = 1e-6, energy: float | None = None
    ) -> bool:
        """Finite energy, pins and ties kept, memory within budget. ``energy``: the
        assignment's ``energy`` where the caller has it already (it is the costly part)."""
        x = np.asarray(assignment, dtype=np.int64)
        if not np.isfinite(self.energy(x) if energy is None else energy):
            return False
        if any(x[v] != s for v, s in self.pins.items()):
            return False
        groups = [g for g in self.ties if len(g)]
        if groups:  # every member picks what its group's first member picks
            members = np.fromiter(itertools.chain.from_iterable(groups), dtype=np.int64)
            first = np.repeat([g[0] for g in groups], [len(g) for g in groups])
            if (x[members] != x[first]).any():
                return False
        if self.memory_budget is not None:
            return self.memory_used(x) <= self.memory_budget * (1 + tol)
        return True

    # --- export / import (documented in docs/problem_format.md) -------------

    def save(self, path: str | Path) -> None:
        """Write the problem as one ``.npz`` file that anyone can re-solve."""
        arrays: dict[str, np.ndarray] = {
            "format_version": np.array(FORMAT_VERSION),
            "node_names": np.array(self.node_names, dtype=object),
            "strategy_labels": np.array(
                ["\x1f".join(labels) for labels in self.strategy_labels], dtype=object
            ),
            "num_strategies": self.num_strategies,
            "unary": _concat(self.unary),
            "edges": self.edges,
            **_table_arrays(self.pairwise),
            "memory_nodes": np.array(
                [v for v, m in enumerate(self.memory) if m is not None], dtype=np.int64
            ),
            "memory": _concat([m for m in self.memory if m is not None]),
            "memory_budget": np.array(
                np.nan if self.memory_budget is None else self.memory_budget
            ),
            "pins": np.array(sorted(self.pins.items()), dtype=np.int64).reshape(-1, 2),
            "tie_nodes": _concat([np.asarray(g, dtype=np.int64) for g in self.ties]),
            "tie_sizes": np.array([len(g) for g in self.ties], dtype=np.int64),
        }
        np.savez_compressed(path, **arrays)

    @classmethod
    def load(cls, path: str | Path) -> Problem:
        with np.load(path, allow_pickle=True) as f:
            version = int(f["format_version"])
            if version not in READABLE_VERSIONS:
                raise ValueError(
                    f"{path}: problem format {version}, expected one of {READABLE_VERSIONS}"
                )
            k = f["num_strategies"]
            edges = f["edges"].reshape(-1, 2)
            unary = _split(f["unary"], k)
            shapes = np.stack([k[edges[:, 0]], k[edges[:, 1]]], axis=1)
            if version == 1:  # every edge's table, in edge order
                flat = _split(f["pairwise"], shapes.prod(axis=1))
                pairwise = share_tables([t.reshape(s) for t, s in zip(flat, shapes)])
            else:
                pairwise = _shared_tables(f["pairwise"], f["table_of_edge"], shapes)
            memory: list[np.ndarray | None] = [None] * len(k)
            mem_nodes = f["memory_nodes"]
            for v, m in zip(mem_nodes, _split(f["memory"], k[mem_nodes])):
                memory[int(v)] = m
            budget = float(f["memory_budget"])
            ties = [g.tolist() for g in _split(f["tie_nodes"], f["tie_sizes"])]
            return cls(
                node_names=[str(s) for s in f["node_names"]],
                strategy_labels=[str(s).split("\x1f") for s in f["strategy_labels"]],
                unary=unary,
                edges=edges,
                pairwise=pairwise,
                memory=memory,
                memory_budget=None if np.isnan(budget) else budget,
                pins={int(v): int(s) for v, s in f["pins"]},
                ties=ties,
            )


def share_tables(tables: list[np.ndarray]) -> list[np.ndarray]:
    """The same tables, equal ones (same shape and bytes) as one read-only object."""
    distinct, of_edge = _distinct_tables(tables)
    for t in distinct:
        t.flags.writeable = False
    return [distinct[i] for i in of_edge.tolist()]


def _distinct_tables(tables: list[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray]:
    """The distinct tables (float64, C order) in order of first use, and each one's index.

    Tables that already are one object are compared once, so a builder that
    reuses its tables pays only for the ones it made twice."""
    by_id: dict[int, int] = {}
    by_content: dict[tuple, int] = {}
    distinct: list[np.ndarray] = []
    of_edge = np.empty(len(tables), dtype=np.int64)
    for e, t in enumerate(tables):
        i = by_id.get(id(t))
        if i is None:
            table = np.ascontiguousarray(t, dtype=np.float64)
            i = by_content.setdefault((table.shape, table.tobytes()), len(distinct))
            if i == len(distinct):
                distinct.append(table)
            by_id[id(t)] = i
        of_edge[e] = i
    return distinct, of_edge


def _table_arrays(tables: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Each distinct table once (``pairwise``) and which one each edge reads."""
    distinct, of_edge = _distinct_tables(tables)
    return {"pairwise": _concat([t.ravel() for t in distinct]), "table_of_edge": of_edge}


def _shared_tables(flat: np.ndarray, of_edge: np.ndarray, shapes: np.ndarray) -> list[np.ndarray]:
    used, first = np.unique(of_edge, return_index=True)  # one edge per distinct table
    if not np.array_equal(used, np.arange(len(used))):
        raise ValueError("table_of_edge must name every stored table, numbered from 0")
    sizes = shapes[first].prod(axis=1)
    distinct = [t.reshape(s) for t, s in zip(_split(flat, sizes), shapes[first])]
    for t in distinct:
        t.flags.writeable = False
    return [distinct[i] for i in of_edge.tolist()]


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0)


def _split(flat: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    bounds = np.cumsum(sizes)[:-1] if len(sizes) else []
    return list(np.split(flat, bounds)) if len(sizes) else []
