"""The predicted step time, term by term: the planned graph plus what a step pays outside it.

The planner's objective prices the planned graph: kernels (compute) and
collectives (communication). A training step also pays host time per node of
the graph the executor runs, and the optimizer (clipping's global norm and
AdamW over each rank's parameter shards). Both come from a calibrated
profile's fields (``calibrate/measure_step.py``; 0 in the built-in ones).

They are added to the prediction, not to the ILP objective: the optimizer's
per-element term already favours sharded parameters through the memory
term's choices, and the node count of the executed graph is only known once
the executor has traced it (a redistribution becomes several nodes there).
At plan time ``host_us`` counts the planned graph's nodes and ``alloc_us``
(first touch of the fresh memory the nodes' outputs take, page faults on
CPU) is 0; the trainer's plan check replaces both, and the communication, by
what the compiled graph runs (``execute/graph_cost.py``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from torchtitan_autoparallel.planner.cost.profiles import HardwareProfile
from torchtitan_autoparallel.planner.strategies.placement import parse_placements


@dataclass(frozen=True)
class StepTerms:
    """Microseconds per step on one device; ``total_us`` is the predicted step time."""

    compute_us: float
    comm_us: float
    overlap_savings_us: float
    host_us: float
    optimizer_us: float
    alloc_us: float = 0.0  # first touch of fresh output memory; known once the executed graph is

    @property
    def total_us(self) -> float:
        return (self.compute_us + self.comm_us - self.overlap_savings_us + self.host_us + self.optimizer_us
                + self.alloc_us)

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total_us": self.total_us}


def host_us(nodes: int, profile: HardwareProfile) -> float:
    return nodes * profile.host_us_per_node


def alloc_us(fresh_bytes: float, profile: HardwareProfile) -> float:
    return fresh_bytes * profile.alloc_us_per_byte


def optimizer_us(tensors: int, elements: float, profile: HardwareProfile) -> float:
    """Clipping plus AdamW over ``tensors`` parameter tensors holding ``elements`` local elements."""
    if tensors == 0:
        return 0.0
    return (
        tensors * profile.optimizer_us_per_tensor
        + elements * profile.optimizer_us_per_element
        + profile.optimizer_fixed_us
    )


def local_elements(shape: tuple[int, ...], placements: list[str], mesh_sizes: list[int]) -> float:
    """Elements of one rank's shard of a parameter placed as ``placements`` (e.g. ["S(0)", "R"])."""
    shards = 1
    for p, size in zip(parse_placements(",".join(placements)), mesh_sizes):
        if hasattr(p, "dim"):  # Shard and _StridedShard split the tensor; Replicate does not
            shards *= size
    return math.prod(shape) / shards


def add_step_terms(plan, param_shapes: dict[str, tuple[int, ...]], graph_nodes: int, profile: HardwareProfile) -> None:
    """Record host and optimizer time, and what they count, in ``plan.predicted``."""
    sizes = plan.mesh["sizes"]
    elements = sum(local_elements(param_shapes[f], ps, sizes) for f, ps in plan.parameters.items())
    tensors = len(plan.parameters)
    plan.predicted["graph_nodes"] = float(graph_nodes)
    plan.predicted["host_us"] = host_us(graph_nodes, profile)
    plan.predicted["optimizer_tensors"] = float(tensors)
    plan.predicted["optimizer_elements"] = float(elements)
    plan.predicted["optimizer_us"] = optimizer_us(tensors, elements, profile)


def plan_terms(plan) -> StepTerms:
    """The plan's own prediction; plans written before host and optimizer terms give 0 for them."""
    p = plan.predicted
    return StepTerms(
        compute_us=p["compute_us"],
        comm_us=p["comm_us"],
        overlap_savings_us=p.get("overlap_savings_us", 0.0),
        host_us=p.get("host_us", 0.0),
        optimizer_us=p.get("optimizer_us", 0.0),
        alloc_us=p.get("alloc_us", 0.0),
    )
