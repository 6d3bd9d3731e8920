"""Linear memory rows beside a ``Problem``: the bytes live at one moment of the step.

A row reads ``const + sum_v bytes[v][x_v] <= limit``: each term is what node
``v``'s choice puts in memory at that moment (its output, a buffer it
redistributes into, a gradient kept at its parameter's placement), in bytes per
device. ``planner.plan.peak_rows`` writes one from a walk of the planned step;
``planner.solve.rows`` solves a problem under any number of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GIB = float(2**30)


@dataclass(frozen=True, kw_only=True)
class MemoryRow:
    """The bytes live per device at ``where`` (a graph node), as a function of the plan."""

    terms: dict[int, np.ndarray]  # problem node -> bytes per strategy
    const: float  # bytes no choice moves (collective buffers of the plan it was read from)
    limit: float  # bytes per device it may reach
    where: str

    def value(self, assignment: np.ndarray) -> float:
        x = np.asarray(assignment, dtype=np.int64)
        return self.const + sum(float(vec[x[v]]) for v, vec in self.terms.items())

    def least(self) -> float:
        """The least this row can be (every node at its smallest term)."""
        return self.const + sum(float(vec.min()) for vec in self.terms.values())

    def describe(self) -> str:
        return f"at {self.where}: {self.limit / GIB:.2f} GiB per device"
