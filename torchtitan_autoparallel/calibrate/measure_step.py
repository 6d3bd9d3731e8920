"""Timings of the step's costs outside the planned graph: host time per node, and the optimizer.

The cost model prices the planned graph's kernels and collectives; a training
step also pays

* host time per node: the compiled step (``execute/compiled.py``) is an FX
  GraphModule whose generated Python calls one ATen op per node. On small
  shapes that call, not the kernel, is the time, and where ranks share CPU
  cores each rank gets only its share of one. ``measure_host`` runs such
  graphs of small ops on every rank at once, so the sharing is in the timing;
* first touch of fresh outputs: an activation-sized output (hundreds of KiB)
  is a new allocation that the CPU allocator maps from the OS, and each of
  its 4 KiB pages faults on first write (~2 us alone, ~4 us with four ranks
  on two cores: more than the kernel's own traffic). ``measure_host`` also
  runs chains of activation-sized ops whose outputs stay alive, as forward
  activations do until the backward uses them;
* the optimizer: clipping by the global norm (one all-reduce of a scalar)
  and AdamW over each rank's parameter shards, run by the trainer's own
  functions on DTensor parameters over the live mesh, so DTensor's per-op
  dispatch (a cost per tensor) and the all-reduce are in the timing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from torchtitan_autoparallel.calibrate.fit import HostSample, OptimizerSample
from torchtitan_autoparallel.calibrate.measure import time_us
from torchtitan_autoparallel.execute.optim import clip_grad_norm

# ATen ops of a typical compiled step on small tensors: views, transposes and
# elementwise math, one node each (six per round of _host_graph).
_SIDE = 16


@dataclass(frozen=True)
class StepSettings:
    host_nodes: tuple[int, ...]  # graph sizes, in call_function nodes
    alloc_graphs: tuple[tuple[int, int], ...]  # (nodes, float32 elements per output), outputs kept alive
    optimizer: tuple[tuple[int, int], ...]  # (tensors, local elements per tensor)

    @property
    def steps(self) -> int:
        return len(self.host_nodes) + len(self.alloc_graphs) + len(self.optimizer)


def default_step_settings() -> StepSettings:
    # Around the debug models' ~2,000 nodes and ~50 tensors of 10^4-10^6 elements.
    # Activations of those models at seq 128: 64 KiB to 1 MiB per output, tens of MiB alive at once.
    return StepSettings(
        (300, 1200, 2400),
        ((120, 16384), (60, 65536), (30, 262144)),
        ((8, 4096), (32, 4096), (8, 65536), (32, 65536), (16, 262144)),
    )


def host_graph(nodes: int) -> fx.GraphModule:
    """A chain of ``nodes`` ATen calls (rounded down to whole rounds of six) on a 16x16 tensor."""
    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    for _ in range(max(1, nodes // 6)):
        flat = g.call_function(aten.view.default, (x, [_SIDE * _SIDE]))
        added = g.call_function(aten.add.Tensor, (flat, flat))
        scaled = g.call_function(aten.mul.Scalar, (added, 0.5))
        square = g.call_function(aten.view.default, (scaled, [_SIDE, _SIDE]))
        turned = g.call_function(aten.t.default, (square,))
        x = g.call_function(aten.t.default, (turned,))
    g.output(x)
    return fx.GraphModule(nn.Module(), g)


def alloc_graph(nodes: int) -> fx.GraphModule:
    """A chain of ``nodes`` out-of-place ops that returns every output, so all stay allocated to the end."""
    g = fx.Graph()
    x = g.placeholder("x")
    outs = []
    for _ in range(nodes):
        x = g.call_function(torch.ops.aten.mul.Scalar, (x, 0.5))
        outs.append(x)
    g.output(tuple(outs))
    return fx.GraphModule(nn.Module(), g)


def graph_nodes(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


def measure_host(
    settings: StepSettings, device: torch.device, repeats: int, progress, window_s: float = 0.0
) -> list[HostSample]:
    """Graphs of small ops, and of activation-sized ones kept alive; ``window_s`` as ``measure.time_us``'s."""

    x = torch.randn(_SIDE, _SIDE, device=device)
    samples = []
    for size in settings.host_nodes:
        gm = host_graph(size)
        nodes = graph_nodes(gm)
        with torch.no_grad():
            us = time_us(lambda: gm(x), repeats, device, window_s)
        samples.append(HostSample(nodes, us, fresh_bytes=2.0 * nodes / 6 * x.numel() * 4.0))  # add, mul per round
        progress.step(f"FX graph of {nodes} small ops ({us / nodes:.1f} us/node)", us)
    for nodes, elements in settings.alloc_graphs:
        samples.append(_time_alloc_graph(nodes, elements, device, repeats, window_s))
        progress.step(f"FX graph of {nodes} ops on {elements * 4 // 1024} KiB outputs, kept alive "
                      f"({samples[-1].us / nodes:.1f} us/node)", samples[-1].us)
    return samples


def _time_alloc_graph(
    nodes: int, elements: int, device: torch.device, repeats: int, window_s: float
) -> HostSample:

    gm, x = alloc_graph(nodes), torch.randn(elements, device=device)
    with torch.no_grad():
        # Returned outputs are dropped inside the timed call: their release is part of a step too.
        us = time_us(lambda: gm(x), repeats, device, window_s)
    fresh = nodes * elements * 4.0
    return HostSample(nodes, us, fresh_bytes=fresh, moved_bytes=2.0 * fresh)


def measure_optimizer(settings: StepSettings, mesh, device: torch.device, repeats: int, progress) -> list[OptimizerSample]:

    samples = []
    for tensors, per_tensor in settings.optimizer:
        step = _optimizer_step(mesh, device, tensors, per_tensor)
        us = time_us(step, repeats, device)
        samples.append(OptimizerSample(tensors, tensors * per_tensor, us))
        progress.step(f"clip + AdamW, {tensors} tensors x {per_tensor:,} local elements", us)
    return samples


def _optimizer_step(mesh, device: torch.device, tensors: int, per_tensor: int):
    """One training step's clipping and AdamW over DTensor shards, as ``execute/optim.optimizer_step`` runs them."""
    from torch.distributed.tensor import DTensor, Shard


    placements = [Shard(0)] * mesh.ndim  # sharded like FSDP's parameters: the common case

    def sharded() -> DTensor:
        return DTensor.from_local(torch.randn(per_tensor, device=device), mesh, placements, run_check=False)

    params = [nn.Parameter(sharded()) for _ in range(tensors)]
    grads = [sharded() for _ in range(tensors)]
    # As train/optim.build_optimizer builds it: per-parameter (foreach=False) AdamW.
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=False)

    def step() -> None:
        for p, g in zip(params, grads):
            p.grad = g
        clip_grad_norm(params, mesh, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step
