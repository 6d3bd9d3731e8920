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

``Problem.arrays`` holds the same data as flat arrays (``ProblemArrays``, the
layout of the problem file): the presolve and the scoring read those, as a walk
over the per-node lists costs a Python step per node. They are made once, when
first read (``Problem.load`` has them already), and made again after any field
they come from is replaced or its list changed; the arrays in those lists are
read-only by contract.
"""

from __future__ import annotations

import itertools
from dataclasses import InitVar, dataclass, field
from pathlib import Path

import numpy as np

from torchtitan_autoparallel.planner.problem import sums

# 2: each distinct pairwise table stored once; 3: names and labels as fixed-width
# unicode arrays, so a file loads with allow_pickle=False (1 and 2 stored them as
# pickled objects, which a shared file must not be trusted with)
FORMAT_VERSION = 3
READABLE_VERSIONS = (3,)


class InfeasibleProblem(ValueError):
    """No assignment satisfies the constraints (pins, ties, forbidden pairs, memory)."""


@dataclass(frozen=True)
class ProblemArrays:
    """A problem's vectors and tables as flat arrays (``Problem.arrays``)."""

    k: np.ndarray  # (n,) strategies per node
    starts: np.ndarray  # (n + 1,) where node v's entries start in ``unary``
    unary: np.ndarray  # every node's unary, node after node
    memory_nodes: np.ndarray  # the nodes with a memory vector, ascending
    memory_starts: np.ndarray  # where each one's vector starts in ``memory`` (and the end)
    memory: np.ndarray  # their vectors, one after another
    tables: list[np.ndarray] | None  # the distinct pairwise tables (None: read ``flat_tables``)
    table_of_edge: np.ndarray  # (E,) which of ``tables`` each edge reads
    flat_tables: np.ndarray  # ``tables`` raveled, one after another
    table_at: np.ndarray  # where each starts in ``flat_tables``
    table_shapes: np.ndarray  # (T, 2) their shapes
    table_cols: np.ndarray  # (T,) their columns
    tie_nodes: np.ndarray  # every tie group's members, group after group
    tie_sizes: np.ndarray  # the groups' sizes
    tie_first: np.ndarray  # for each entry of ``tie_nodes``, its group's first member

    @classmethod
    def build(
        cls, k: np.ndarray, unary: np.ndarray, memory_nodes: np.ndarray, memory: np.ndarray,
        tables: list[np.ndarray], table_of_edge: np.ndarray, ties: list[list[int]],
    ) -> ProblemArrays:
        starts = _starts(k)
        shapes = np.array([t.shape for t in tables], dtype=np.int64).reshape(-1, 2)
        flat = _concat([np.asarray(t, dtype=np.float64).ravel() for t in tables])
        sizes = np.fromiter(map(len, ties), dtype=np.int64, count=len(ties))
        members = np.fromiter(
            itertools.chain.from_iterable(ties), dtype=np.int64, count=int(sizes.sum())
        )
        heads = (np.cumsum(sizes) - sizes)[sizes > 0]
        unary, memory = np.asarray(unary, dtype=np.float64), np.asarray(memory, dtype=np.float64)
        for a in (unary, memory, flat):  # as ``packed``'s: one compiled signature for both
            a.flags.writeable = False
        return cls(
            k, starts, unary, memory_nodes,
            _starts(k[memory_nodes]), memory, tables,
            table_of_edge, flat, _starts(shapes.prod(axis=1))[:-1], shapes,
            shapes[:, 1].copy(), members, sizes, np.repeat(members[heads], sizes[sizes > 0]),
        )

    @classmethod
    def packed(
        cls, k: np.ndarray, unary: np.ndarray, memory_nodes: np.ndarray, memory: np.ndarray,
        flat_tables: np.ndarray, table_shapes: np.ndarray, table_of_edge: np.ndarray,
    ) -> ProblemArrays:
        """A tie-free problem's arrays from its tables laid out one after another (as
        the presolve makes them), all made read-only."""
        table_at = _starts(table_shapes.prod(axis=1))
        for a in (unary, memory, flat_tables):
            a.flags.writeable = False
        none = np.zeros(0, dtype=np.int64)
        return cls(
            k, _starts(k), unary, memory_nodes, _starts(k[memory_nodes]), memory, None,
            table_of_edge, flat_tables, table_at[:-1], table_shapes, table_shapes[:, 1].copy(),
            none, none, none,
        )

    def distinct_tables(self) -> list[np.ndarray]:
        """The distinct tables, as views of ``flat_tables`` where none were given."""
        if self.tables is not None:
            return self.tables
        ends = (self.table_at + self.table_shapes.prod(axis=1)).tolist()
        return [
            self.flat_tables[a:b].reshape(shape)
            for a, b, shape in zip(self.table_at.tolist(), ends, self.table_shapes.tolist())
        ]

    def node_lists(self) -> tuple[list[np.ndarray], list[np.ndarray | None], list[np.ndarray]]:
        """The per-node unaries and memory, and each edge's table, as views of these."""
        spans = list(zip(self.starts[:-1].tolist(), self.starts[1:].tolist()))
        unary = [self.unary[a:b] for a, b in spans]
        memory: list[np.ndarray | None] = [None] * len(spans)
        bounds = zip(self.memory_starts[:-1].tolist(), self.memory_starts[1:].tolist())
        for v, (a, b) in zip(self.memory_nodes.tolist(), bounds):
            memory[v] = self.memory[a:b]
        tables = self.distinct_tables()
        return unary, memory, [tables[t] for t in self.table_of_edge.tolist()]

    @classmethod
    def of(cls, problem: Problem) -> ProblemArrays:
        """From the per-node lists; tables that are one object are stored once. The
        lists' arrays become read-only: an edit now would not reach these copies."""
        k = np.fromiter(map(len, problem.unary), dtype=np.int64, count=len(problem.unary))
        holders = [v for v, m in enumerate(problem.memory) if m is not None]
        ids = np.fromiter(map(id, problem.pairwise), dtype=np.int64, count=len(problem.pairwise))
        _, first, of_edge = np.unique(ids, return_index=True, return_inverse=True)
        for part in (problem.unary, problem.pairwise, [problem.memory[v] for v in holders]):
            for a in part:
                if isinstance(a, np.ndarray):
                    a.flags.writeable = False
        return cls.build(
            k,
            _concat(problem.unary),
            np.array(holders, dtype=np.int64),
            _concat([problem.memory[v] for v in holders]),
            [problem.pairwise[e] for e in first.tolist()],
            of_edge.reshape(-1).astype(np.int64),
            problem.ties,
        )


@dataclass
class FlatProblem:
    """A tie-free problem as flat arrays alone: what the presolve's stages hand on to
    each other (a ``Problem`` adds the names, labels and per-node lists)."""

    arrays: ProblemArrays
    edges: np.ndarray  # (E, 2)
    memory_budget: float | None = None
    pins: dict[int, int] = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        return len(self.arrays.k)


_SOURCES = ("unary", "pairwise", "memory", "ties")  # lists the flat arrays are made from


class _Watched(list):
    """A list field of a ``Problem`` that tells it when it changes, so that its
    flat arrays are made again (``Problem.arrays``)."""

    __slots__ = ("_owner",)

    def _changed(self) -> None:
        owner = getattr(self, "_owner", None)  # unset while unpickling
        if owner is not None:
            object.__setattr__(owner, "_arrays", None)


def _watching(name: str):
    def method(self, *args, **kwargs):
        out = getattr(list, name)(self, *args, **kwargs)
        self._changed()
        return self if name.startswith("__i") else out

    method.__name__ = name
    return method


for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend",
              "insert", "pop", "remove", "clear", "sort", "reverse"):
    setattr(_Watched, _name, _watching(_name))


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
    # the flat arrays where the caller has them already (``load``), else made when read
    flat: InitVar[ProblemArrays | None] = None
    _arrays: ProblemArrays | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self, flat: ProblemArrays | None) -> None:
        self.edges = np.asarray(self.edges, dtype=np.int64).reshape(-1, 2)
        if not self.memory:
            self.memory = [None] * len(self.node_names)
        self._arrays = flat
        self.validate()

    def __setattr__(self, name: str, value: object) -> None:
        if name in _SOURCES:
            watched = _Watched(value)
            watched._owner = self
            value = watched
        if name in _SOURCES or name == "edges":
            object.__setattr__(self, "_arrays", None)
        object.__setattr__(self, name, value)

    @classmethod
    def from_arrays(
        cls, node_names: list[str], strategy_labels: list[list[str]], arrays: ProblemArrays,
        edges: np.ndarray, memory_budget: float | None = None, pins: dict[int, int] | None = None,
    ) -> Problem:
        """A tie-free problem over flat arrays it keeps (``ProblemArrays.packed``), its
        lists views of them."""
        unary, memory, pairwise = arrays.node_lists()
        return cls(
            node_names=node_names, strategy_labels=strategy_labels, unary=unary, edges=edges,
            pairwise=pairwise, memory=memory, memory_budget=memory_budget, pins=pins or {},
            flat=arrays,
        )

    @property
    def flat_problem(self) -> FlatProblem:
        """This problem's flat arrays, edges, budget and pins (its ties left out)."""
        return FlatProblem(self.arrays, self.edges, self.memory_budget, self.pins)

    @property
    def arrays(self) -> ProblemArrays:
        if self._arrays is None:
            self._arrays = ProblemArrays.of(self)
        return self._arrays

    @property
    def num_nodes(self) -> int:
        return len(self.node_names)

    @property
    def num_strategies(self) -> np.ndarray:
        return self.arrays.k

    def validate(self) -> None:
        n = self.num_nodes
        if not (len(self.strategy_labels) == len(self.unary) == len(self.memory) == n):
            raise ValueError("node_names, strategy_labels, unary and memory differ in length")
        if len(self.pairwise) != len(self.edges):
            raise ValueError("one pairwise table per edge is required")
        # from the lists, not ``arrays``: a problem is often edited before it is solved
        k = np.fromiter(map(len, self.unary), dtype=np.int64, count=n)
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
        """The objective of an assignment, recomputed from the tables (``sum_v`` of the
        unaries from 0.0 node after node, plus ``sum_e`` of the tables edge after edge)."""
        x = np.ascontiguousarray(assignment, dtype=np.int64)
        flat = self.arrays
        return sums.energy(
            flat.unary, flat.starts, x, self.edges, flat.flat_tables, flat.table_at,
            flat.table_cols, flat.table_of_edge,
        )

    def memory_used(self, assignment: np.ndarray) -> float:
        x = np.ascontiguousarray(assignment, dtype=np.int64)
        flat = self.arrays
        return sums.memory_used(flat.memory, flat.memory_starts, flat.memory_nodes, x)

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
        flat = self.arrays
        if not sums.ties_kept(x, flat.tie_nodes, flat.tie_first):
            return False
        if self.memory_budget is not None:
            return self.memory_used(x) <= self.memory_budget * (1 + tol)
        return True

    # --- export / import (documented in docs/problem_format.md) -------------

    def save(self, path: str | Path) -> None:
        """Write the problem as one ``.npz`` file that anyone can re-solve."""
        flat = self.arrays  # the file's layout; tables equal in content are stored once (below)
        arrays: dict[str, np.ndarray] = {
            "format_version": np.array(FORMAT_VERSION),
            "node_names": np.array(self.node_names, dtype=np.str_),
            "strategy_labels": np.array(
                ["\x1f".join(labels) for labels in self.strategy_labels], dtype=np.str_
            ),
            "num_strategies": flat.k,
            "unary": flat.unary,
            "edges": self.edges,
            **_table_arrays(self.pairwise),
            "memory_nodes": flat.memory_nodes,
            "memory": flat.memory,
            "memory_budget": np.array(
                np.nan if self.memory_budget is None else self.memory_budget
            ),
            "pins": np.array(sorted(self.pins.items()), dtype=np.int64).reshape(-1, 2),
            "tie_nodes": flat.tie_nodes,
            "tie_sizes": flat.tie_sizes,
        }
        np.savez_compressed(path, **arrays)

    @classmethod
    def load(cls, path: str | Path) -> Problem:
        """The problem ``save`` wrote; ValueError for another format. Nothing is unpickled."""
        try:
            return cls._read(path)
        except ValueError as e:
            if "allow_pickle" not in str(e):
                raise
            raise ValueError(  # numpy's own words name no file and no way out
                f"{path}: holds pickled objects, which are not loaded (unpickling can run code); "
                f"accepted: a problem file written by Problem.save (--autoparallel.export_problem)"
            ) from None

    @classmethod
    def _read(cls, path: str | Path) -> Problem:
        with np.load(path, allow_pickle=False) as f:
            version = int(f["format_version"])
            if version not in READABLE_VERSIONS:
                raise ValueError(
                    f"{path}: problem format {version}, expected one of {READABLE_VERSIONS}"
                    + (" (older files store names as pickled objects; export the problem again)"
                       if version < FORMAT_VERSION else "")
                )
            k = f["num_strategies"]
            edges = f["edges"].reshape(-1, 2)
            unary = _split(f["unary"], k)
            shapes = np.stack([k[edges[:, 0]], k[edges[:, 1]]], axis=1)
            distinct, pairwise = _shared_tables(f["pairwise"], f["table_of_edge"], shapes)
            memory: list[np.ndarray | None] = [None] * len(k)
            mem_nodes = f["memory_nodes"]
            for v, m in zip(mem_nodes, _split(f["memory"], k[mem_nodes])):
                memory[int(v)] = m
            budget = float(f["memory_budget"])
            ties = [g.tolist() for g in _split(f["tie_nodes"], f["tie_sizes"])]
            arrays = ProblemArrays.build(  # the file's own layout: nothing to gather again
                k.astype(np.int64), f["unary"], mem_nodes.astype(np.int64), f["memory"],
                distinct, f["table_of_edge"].astype(np.int64), ties,
            )
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
                flat=arrays,
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


def _shared_tables(
    flat: np.ndarray, of_edge: np.ndarray, shapes: np.ndarray
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The distinct tables, and each edge's."""
    used, first = np.unique(of_edge, return_index=True)  # one edge per distinct table
    if not np.array_equal(used, np.arange(len(used))):
        raise ValueError("table_of_edge must name every stored table, numbered from 0")
    sizes = shapes[first].prod(axis=1)
    distinct = [t.reshape(s) for t, s in zip(_split(flat, sizes), shapes[first])]
    for t in distinct:
        t.flags.writeable = False
    return distinct, [distinct[i] for i in of_edge.tolist()]


def _starts(sizes: np.ndarray) -> np.ndarray:
    out = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=out[1:])
    return out


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0)


def _split(flat: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    bounds = np.cumsum(sizes)[:-1] if len(sizes) else []
    return list(np.split(flat, bounds)) if len(sizes) else []
