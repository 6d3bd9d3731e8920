"""bf16 mixed precision and activation checkpointing on the automatic path.

In process (no launches):

* the bf16 trace computes with bf16 casts of fp32 master weights, takes the
  loss in fp32 and returns fp32 gradients; on a 2-rank fake process group the
  plan and the executed step reduce every parameter gradient in fp32 and
  gather the weights in bf16 (FSDP2's MixedPrecisionPolicy);
* AC traces hold the recomputation as graph nodes and keep fewer activations.

Launched (``./run_train.sh``, gloo; 6 runs of 25-80 s, shared between tests):

* bf16 runs on 2 ranks (FSDP) and 4 ranks (FSDP 2 x TP 2) track a 1-rank
  bf16 run of the same model and batch, and the loss falls;
* with AC "full" and "selective", 5-step losses equal the AC-off run.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from _run import FEW_LAYERS, RunCache
from torch.distributed.tensor import DTensor, Partial
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_autoparallel.models.registry import build_meta_model
from torchtitan_autoparallel.planner.problem.build import GRAD_EDGE
from torchtitan_autoparallel.planner.trace.trace import TracedStep, trace_training_step

aten = torch.ops.aten
SEQ_LEN = 64
GLOBAL_BATCH = 4
STEPS = 5
# bf16 keeps 8 mantissa bits (2^-9 ~ 2e-3 relative rounding per element). A
# sharded plan rounds partial sums (row-parallel matmuls, their reductions)
# in another order than one rank, but the loss averages 256 tokens x 2048
# classes, so it moves little: observed at most 2.1e-5 (2 ranks) and 6.1e-5
# (2 x 2) relative over 5 steps. 1e-3 leaves 16x headroom for other plans
# and is far below what a wrong placement does (the first loss alone is off
# by >1e-2 then).
BF16_LOSS_REL = 1e-3
# Observed <= 1.2e-4 (a sum of squares of bf16-computed gradients).
BF16_GRAD_NORM_REL = 2e-3
# Recomputation repeats the same ops on the same inputs: losses agree to fp32
# rounding (observed <= 6e-8 relative).
AC_LOSS_REL = 1e-5


# ---------------------------------------------------------------- in process: bf16


@pytest.fixture(scope="module")
def bf16_traced() -> TracedStep:
    model = build_meta_model("llama3", "debugmodel", n_layers=2)
    return trace_training_step(model, 4, 32, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _calls(traced: TracedStep, op) -> list:
    return [n for n in traced.graph.graph.nodes if n.target is op]


def test_bf16_trace_computes_in_bf16_from_fp32_masters(bf16_traced):
    t = bf16_traced
    assert all(p.meta["val"].dtype == torch.float32 for p in t.params.values())
    assert all(g.meta["val"].dtype == torch.float32 for g in t.grads.values())
    mms = _calls(t, aten.mm.default)
    assert mms and all(n.meta["val"].dtype == torch.bfloat16 for n in mms)
    # The loss as torchtitan takes it: bf16 logits cast up, log-softmax in fp32.
    assert t.loss.meta["val"].dtype == torch.float32
    softmax = _calls(t, aten._log_softmax.default)
    assert len(softmax) == 1 and softmax[0].meta["val"].dtype == torch.float32
    # Each weight is cast once; each gradient is cast up to fp32 before it leaves.
    assert set(t.grad_casts) == set(t.params)


@pytest.fixture(scope="module")
def fsdp_bf16():
    """An FSDP-sized bf16 plan on a 2-rank fake process group, and one executed step's collectives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan_autoparallel.execute.parity import ParityConfig, batch, full_model, plan_parity

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        # A batch large enough that the planner shards weights and splits the
        # batch (FSDP) rather than sharding activations: gradients get reduced.
        cfg = ParityConfig(batch=16, seq_len=128)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
        full = full_model(cfg)
        planned = plan_parity(cfg, mesh, full, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        recorder = _CollectiveDtypes()
        with recorder:
            out = planned.step.run_graph(*planned.step.distribute_batch(*batch(cfg, 0, 2048)))
        yield planned, recorder.seen, out
    finally:
        if owned:
            dist.destroy_process_group()


_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


class _CollectiveDtypes(TorchDispatchMode):
    """(collective name, input dtype) -> calls; the fake group's results are garbage, dtypes are not."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in _COLLECTIVES:
            self.seen[(name, args[0].dtype)] += 1
        return func(*args, **(kwargs or {}))


def _planned_reductions(planned) -> list[tuple[torch.dtype, bool]]:
    """(dtype, reduces a parameter gradient) of every planned edge that reduces a Partial."""
    traced, chosen = planned.executable.traced, planned.step.chosen
    grad_only = _feeds_only_gradients(traced)
    found = []
    for parts in planned.executable.built.edge_parts:
        for part in parts:
            src = chosen[part.producer].outputs[part.output_index]
            s = chosen[part.consumer]
            dst = s.outputs[0] if part.arg_index == GRAD_EDGE else s.inputs[part.arg_index]
            if src is None or dst is None:
                continue
            reduced = {i for i, p in enumerate(src) if isinstance(p, Partial)} - {
                i for i, p in enumerate(dst) if isinstance(p, Partial)
            }
            if reduced:
                found.append((part.dtype, part.producer in grad_only))
    return found


def _feeds_only_gradients(traced: TracedStep) -> set:
    grads = set(traced.grads.values())
    only: set = set()
    for node in reversed(list(traced.graph.graph.nodes)):
        users = [u for u in node.users if u.op != "output"]
        if node in grads or (users and all(u in only for u in users)):
            only.add(node)
    return only


def test_bf16_plan_reduces_gradients_in_fp32(fsdp_bf16):
    planned, _, _ = fsdp_bf16
    grad_reductions = [dtype for dtype, is_grad in _planned_reductions(planned) if is_grad]
    assert len(grad_reductions) >= len(planned.executable.traced.params) // 2, "expected an FSDP plan that reduces gradients"
    assert set(grad_reductions) == {torch.float32}


def test_bf16_step_gathers_bf16_and_reduce_scatters_fp32(fsdp_bf16):
    planned, seen, out = fsdp_bf16
    print(f"\nexecuted collectives: {dict(seen)}")
    scatters = {dtype: n for (name, dtype), n in seen.items() if name == "reduce_scatter_tensor"}
    assert scatters and set(scatters) == {torch.float32}, scatters
    assert seen[("all_gather_into_tensor", torch.bfloat16)] > 0, "weights are not gathered in bf16"
    # fp32 masters (what the optimizer updates) and fp32 gradients in their placements.
    for fqn, param in planned.step.params.items():
        assert param.dtype == torch.float32, fqn
        assert isinstance(out.grads[fqn], DTensor) and out.grads[fqn].dtype == torch.float32, fqn
    assert out.loss.dtype == torch.float32


# ---------------------------------------------------------------- in process: AC


@pytest.fixture(scope="module")
def ac_traces() -> dict[str, TracedStep]:
    model = build_meta_model("llama3", "debugmodel", n_layers=3)
    modes = ("none", "full", "selective")
    return {mode: trace_training_step(model, 4, 128, activation_checkpoint=mode) for mode in modes}


def _nbytes(node) -> int:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def _peak_live_bytes(traced: TracedStep) -> int:
    """Peak bytes of op results alive at once when nodes run in order and die at their last use.

    This is the executor's memory schedule: the interpreter drops each value
    after its last user.
    """
    nodes = list(traced.graph.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    dies: dict[int, list] = {}
    live = peak = 0
    for n in nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            live += _nbytes(n)
            dies.setdefault(max((pos[u] for u in n.users), default=pos[n]), []).append(n)
        peak = max(peak, live)
        live -= sum(_nbytes(m) for m in dies.pop(pos[n], []))
    return peak


def _forward(traced: TracedStep) -> set:
    seen, stack = set(), [traced.loss]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _saved_bytes(traced: TracedStep) -> int:
    """Bytes of forward op results the backward reads (what autograd would save)."""
    fwd = _forward(traced)
    return sum(
        _nbytes(n)
        for n in fwd
        if n.op == "call_function" and any(u not in fwd and u.op != "output" for u in n.users)
    )


def _recomputed(traced: TracedStep, op) -> int:
    """Calls of a forward op that run in the backward: not on the way to the loss."""
    fwd = _forward(traced)
    return sum(1 for n in _calls(traced, op) if n not in fwd)


def test_full_ac_recomputes_every_block_and_saves_less(ac_traces):
    none, full = ac_traces["none"], ac_traces["full"]
    assert full.activation_checkpoint == "full"
    assert _recomputed(none, aten.mm.default) == 2 * 5 * 3 + 2  # only the backward's own matmuls
    # Each block's attention and its matmuls (but the last, whose output the backward never reads) rerun.
    assert _recomputed(full, aten._scaled_dot_product_flash_attention_for_cpu.default) == 3
    assert _recomputed(full, aten.mm.default) == _recomputed(none, aten.mm.default) + 3 * 4
    assert _saved_bytes(full) < _saved_bytes(none) / 3
    assert _peak_live_bytes(full) < 0.6 * _peak_live_bytes(none)


def test_selective_ac_keeps_attention_and_every_other_matmul(ac_traces):
    none, sel, full = ac_traces["none"], ac_traces["selective"], ac_traces["full"]
    assert _recomputed(sel, aten._scaled_dot_product_flash_attention_for_cpu.default) == 0
    assert _recomputed(sel, aten.mm.default) == _recomputed(none, aten.mm.default) + 3 * 2
    assert _saved_bytes(full) < _saved_bytes(sel) < _saved_bytes(none)
    assert _peak_live_bytes(sel) < _peak_live_bytes(none)


def test_ac_per_block_recomputes_only_the_blocks_given(ac_traces):
    """What "auto" plans between two modes: the first blocks recompute, the others not."""
    none, full = ac_traces["none"], ac_traces["full"]
    model = build_meta_model("llama3", "debugmodel", n_layers=3)
    mixed = trace_training_step(model, 4, 128, activation_checkpoint=("full", "none", "none"))
    assert mixed.activation_checkpoint == "full 0, none 1-2" and mixed.block_recompute == ("full", "none", "none")
    assert _recomputed(mixed, aten._scaled_dot_product_flash_attention_for_cpu.default) == 1
    assert _recomputed(mixed, aten.mm.default) == _recomputed(none, aten.mm.default) + 4
    assert _saved_bytes(full) < _saved_bytes(mixed) < _saved_bytes(none)
    assert all("forward" not in block.__dict__ for block in model.layers.children())
    with pytest.raises(ValueError, match="modes for 2 blocks; the model has 3"):
        trace_training_step(model, 2, 16, activation_checkpoint=("full", "none"))


def test_ac_leaves_the_plain_model_untouched():
    model = build_meta_model("llama3", "debugmodel", n_layers=1)
    names = [n for n, _ in model.named_parameters()]
    trace_training_step(model, 2, 16, activation_checkpoint="full")
    assert [n for n, _ in model.named_parameters()] == names
    assert all("forward" not in block.__dict__ for block in model.layers.children())


def test_ac_needs_transformer_blocks():
    with pytest.raises(ValueError, match="needs transformer blocks under model.layers"):
        trace_training_step(torch.nn.Linear(4, 4, device="meta"), 2, 4, activation_checkpoint="full")
    model = build_meta_model("llama3", "debugmodel", n_layers=1)
    with pytest.raises(ValueError, match="'partial' is not accepted; accepted: none, full, selective"):
        trace_training_step(model, 2, 16, activation_checkpoint="partial")


# ---------------------------------------------------------------- launched runs


class Runs(RunCache):
    """Automatic-plan runs: the llama3 debug model cut to two blocks, 5 steps, global batch 4 x 64."""

    def auto(self, key: str, ngpu: int, *overrides: str, dp: int | None = None) -> list[dict]:
        return self.get(
            key, "--model.name", "llama3_auto_parallel", *overrides,
            ngpu=ngpu, steps=STEPS, seq_len=SEQ_LEN, local_batch_size=GLOBAL_BATCH // (dp or ngpu),
        )  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("auto_precision"), n_layers=FEW_LAYERS)


BF16 = ("--training.mixed_precision_param", "bfloat16")
BF16_PLANS = {
    "bf16_fsdp": (2, (), 2),
    "bf16_fsdp_tp": (4, ("--parallelism.tensor_parallel_degree", "2"), 2),
}


def _losses(records: list[dict]) -> list[float]:
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(x) for x in losses), losses
    return losses


@pytest.mark.multirank
@pytest.mark.parametrize("plan", list(BF16_PLANS))
def test_bf16_auto_run_tracks_one_rank(runs: Runs, plan: str) -> None:
    ngpu, extra, dp = BF16_PLANS[plan]
    ref = runs.auto("bf16_1", 1, *BF16)
    got = runs.auto(plan, ngpu, *BF16, *extra, dp=dp)
    print(f"\n{plan} losses {_losses(got)}\n1-rank losses {_losses(ref)}")
    assert _losses(got) == pytest.approx(_losses(ref), rel=BF16_LOSS_REL)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=BF16_GRAD_NORM_REL)
    assert _losses(got)[-1] < _losses(got)[0] - 0.1, "the loss does not fall"


@pytest.mark.multirank
def test_bf16_flag_changes_the_numerics(runs: Runs) -> None:
    # bf16 must not be silently dropped: runs are deterministic, so an ignored
    # flag would give the fp32 losses bit for bit (observed: 1.6e-4 apart).
    bf16 = _losses(runs.auto("bf16_fsdp", 2, *BF16))
    fp32 = _losses(runs.auto("ac_none", 2))
    assert max(abs(a - b) / abs(b) for a, b in zip(bf16, fp32)) > 1e-5, (bf16, fp32)


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_ac_auto_run_equals_no_ac(runs: Runs, mode: str) -> None:
    ref = _losses(runs.auto("ac_none", 2))
    got = _losses(runs.auto(f"ac_{mode}", 2, "--activation_checkpoint.mode", mode))
    print(f"\nAC {mode} losses {got}\nAC off losses {ref}")
    assert got == pytest.approx(ref, rel=AC_LOSS_REL)
    assert len(set(got)) == STEPS
