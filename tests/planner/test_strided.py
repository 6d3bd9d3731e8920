"""``[autoparallel] strided_sharding``: strided matmul strategies, their costs, and their execution.

The planning tests run in this process on a fake process group. The
multi-rank tests launch torchrun on gloo: this file's ``__main__`` checks
every redistribution between a list of placements on a 2x2 mesh (values and
collective counts), and ``./run_train.sh`` trains a plan that uses strided
shards against one rank. With ``--compile-arms`` the ``__main__`` instead
compiles a strided plan in a fresh process, as torch traces and as we do.
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from torchtitan_autoparallel.planner.cost.cost_model import redistribute_steps
from torchtitan_autoparallel.planner.cost.profiles import load_profile
from torchtitan_autoparallel.planner.problem.build import _flops, strategy_time_us
from torchtitan_autoparallel.planner.strategies.placement import is_evenly_shardable, label, local_shape
from torchtitan_autoparallel.planner.strategies.strategy import Strategy, StrategyTable, enumerate_strategies
from torchtitan_autoparallel.planner.strategies.strided import STRIDED_OPS, has_strided
from torchtitan_autoparallel.planner.trace.trace import BatchSpec, trace_training_step

aten = torch.ops.aten
R = Replicate()
B, S, D, N = 6, 8, 16, 32  # local batch 3 on dp=2: the tp ranks cannot split samples
PROFILE = load_profile("h100")
REL_TOL = 1e-4


def SS(dim: int, k: int) -> _StridedShard:
    return _StridedShard(dim, split_factor=k)


# ---------------------------------------------------------------- planning


class ScaledLinear(nn.Module):
    """A pointwise op before the linear lets tp shard the sequence of [B, S, D]."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, N, bias=False, device="meta")

    def forward(self, x):
        return self.proj(x * 2.0)


def dot_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # sharded every way (a sum), so the gradient of the output can be strided too
    return (pred * labels).sum()


@pytest.fixture(scope="module")
def tables(fake_world) -> dict[bool, StrategyTable]:
    from torch.distributed.device_mesh import init_device_mesh

    batch = BatchSpec((B, S, D), (B, S, N), torch.float32, torch.float32)
    traced = trace_training_step(ScaledLinear(), 0, 0, loss_fn=dot_loss, batch=batch)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_shard", "tp"))
    return {on: enumerate_strategies(traced, mesh, strided_sharding=on) for on in (False, True)}


def _nodes(table: StrategyTable, target) -> list:
    return [n for n in table.nodes if n.target is target]


def _candidates(table: StrategyTable, node) -> list[set]:
    return [{s.outputs[i] for s in table.nodes[p].strategies} for p, i in table.nodes[node].args]


def _strided(strategies: list[Strategy]) -> list[Strategy]:
    return [s for s in strategies if any(map(has_strided, (*s.outputs, *s.inputs)))]


def test_flattening_view_gives_the_local_batch_as_split_factor(tables):
    # [B, S, D] split S(0) on dp and S(1) on tp, flattened: each tp rank holds a
    # slice of each of the B/dp = 3 local samples.
    view = _nodes(tables[True], aten.view.default)[0]
    pairs = {(label(s.inputs[0]), label(s.outputs[0])) for s in tables[True].nodes[view].strategies}
    assert ("S(0)S(1)", "S(0)SS(0,3)") in pairs
    assert ("RS(1)", "RSS(0,6)") in pairs


def test_matmuls_get_strided_variants_exactly_when_an_input_can_carry_one(tables):
    off, on = tables[False], tables[True]
    checked = 0
    for op in (aten.mm.default, aten.t.default):
        for node_off, node_on in zip(_nodes(off, op), _nodes(on, op)):
            plain = off.nodes[node_off].strategies
            assert not _strided(plain)
            strategies = on.nodes[node_on].strategies
            assert set(plain) <= set(strategies)  # every plain strategy is still there
            cands = _candidates(on, node_on)
            offered = any(map(has_strided, itertools.chain(*cands)))
            assert bool(_strided(strategies)) == offered, node_on.name
            for s in _strided(strategies):  # each one reads a strided shard some producer emits
                assert any(has_strided(p) and p in c for p, c in zip(s.inputs, cands)), s
            checked += offered
    assert checked >= 3  # forward and both backward matmuls, and a transpose


def test_strided_rows_and_contraction_variants(tables):
    table = tables[True]
    labelled = set()
    for node in _nodes(table, aten.mm.default):
        for s in _strided(table.nodes[node].strategies):
            labelled.add((label(s.outputs[0]), tuple(label(p) for p in s.inputs)))
    # rows: the activation keeps its strided shard through the forward matmul
    assert ("S(0)SS(0,3)", ("S(0)SS(0,3)", "RR")) in labelled
    # contraction over the strided rows (weight gradient): partial sums on both axes
    assert ("PP", ("S(1)SS(1,3)", "S(0)SS(0,3)")) in labelled


def test_strided_matmul_local_shapes_and_flops(tables):
    table = tables[True]
    mesh = table.mesh
    node = _nodes(table, aten.mm.default)[0]
    strided = Strategy(((Shard(0), SS(0, 3)),), ((Shard(0), SS(0, 3)), (R, R)))
    plain = Strategy(((Shard(0), Shard(0)),), ((Shard(0), Shard(0)), (R, R)))
    assert strided in table.nodes[node].strategies
    rows = B * S // 8
    assert local_shape((B * S, D), strided.inputs[0], mesh.sizes) == (rows, D)
    assert _flops(node, [(rows, D), (D, N)]) == 2.0 * rows * D * N
    # Same local shapes as the plain row split, so the same FLOPs and bytes.
    t_strided = strategy_time_us(node, strided, mesh, PROFILE)
    assert t_strided == pytest.approx(strategy_time_us(node, plain, mesh, PROFILE)) and t_strided > 0


def test_even_sharding_counts_the_strided_chunks():
    # After S(0) on 2 ranks, 24 local rows; SS(0,3) on 4 ranks cuts 3 chunks of 8 into 2s.
    assert is_evenly_shardable((48, 4), (Shard(0), SS(0, 3)), (2, 4))
    assert not is_evenly_shardable((48, 4), (Shard(0), SS(0, 5)), (2, 4))
    assert not is_evenly_shardable((36, 4), (Shard(0), SS(0, 3)), (2, 4))  # chunks of 6 over 4
    assert is_evenly_shardable((36, 4), (Shard(0), SS(0, 5)), (2, 1))  # one rank holds it all


def _kinds(src, dst, shape=(16, 4), mesh=(2, 2)) -> list[tuple[str, int]]:
    return [(s.kind, s.mesh_dim) for s in redistribute_steps(shape, 4, src, dst, mesh)]


def test_strided_conversions_are_priced_as_gathers():
    # strided <-> plain of the same rows: gather the strided mesh dim, cut locally
    assert _kinds((Shard(0), SS(0, 4)), (Shard(0), Shard(0))) == [("all_gather", 1)]
    assert _kinds((Shard(0), Shard(0)), (Shard(0), SS(0, 4))) == [("all_gather", 1)]
    assert _kinds((R, R), (SS(0, 4), SS(0, 2))) == []  # cutting is free
    # a strided shard nests like a plain one: mesh dim 1's cut is undone first ...
    assert _kinds((SS(0, 4), Shard(0)), (R, Shard(0))) == [("all_gather", 1), ("all_gather", 0)]
    # ... unless it is FSDP2+TP's tp-first order (factor = the later mesh sizes)
    assert _kinds((SS(0, 2), Shard(0)), (R, Shard(0))) == [("all_gather", 0)]
    assert _kinds((Partial(), R), (SS(0, 4), R)) == [("all_reduce", 0)]


def test_option_reaches_the_planner_from_the_job(monkeypatch):
    from torchtitan_autoparallel.config.job_config import JobConfig
    from torchtitan_autoparallel.planner.plan import api
    from torchtitan_autoparallel.train import auto

    job = JobConfig()
    runtime = SimpleNamespace(device_type="cpu", fake=False)
    assert auto.planner_options(job, runtime, (1, 1, 1)).strided_sharding is False
    job.autoparallel.strided_sharding = True
    options = auto.planner_options(job, runtime, (1, 1, 1))
    assert options.strided_sharding is True
    assert options.cache_settings()["strided_sharding"] is True
    seen = {}

    def fake_enumerate(traced, mesh, strided_sharding=False):
        seen["strided"] = strided_sharding
        raise RuntimeError("stop here")

    monkeypatch.setattr(api, "trace_training_step", lambda *a, **k: None)
    monkeypatch.setattr(api, "enumerate_strategies", fake_enumerate)
    mesh = SimpleNamespace(mesh_dim_names=("dp_shard",), mesh=torch.zeros(1))
    with pytest.raises(RuntimeError, match="stop here"):
        api.plan_stages(None, mesh, options)
    assert seen["strided"] is True


def test_family_covers_the_matmuls_and_the_transpose():
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.t.default}
    assert ops <= STRIDED_OPS


# ---------------------------------------------------------------- multi-rank

RUN_TIMEOUT_S = 600
REPO = Path(__file__).resolve().parents[2]


def _torchrun(args: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=REPO)
    if not out.exists():
        pytest.fail(f"torchrun wrote no result (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.mark.multirank
def test_strided_redistributions_are_exact_and_run_the_priced_collectives(tmp_path):
    out = tmp_path / "pairs.json"
    result = _torchrun([str(Path(__file__)), "--out", str(out)], out)
    print(f"\n{result['pairs']} pairs ({result['partial_pairs']} from Partial); DTensor alone: {result['dtensor']}")
    assert result["pairs"] > 500
    assert result["wrong"] == []
    assert result["count_mismatch"] == []


def test_compiling_a_strided_plan_records_no_sharding_bookkeeping(tmp_path):
    """DTensor sizes ``_StridedShard`` chunks with index tensors while it prices a
    redistribution; traced as torch does, those dead ops swell the recorded step (and
    every step ran them). ``compiled.sharding_propagation_for_trace`` keeps them out
    without changing a live node. A fresh process: DTensor's caches must start cold."""
    out = tmp_path / "arms.json"
    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), "--compile-arms", "--out", str(out)],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=REPO,
    )  # fmt: skip
    if not out.exists():
        pytest.fail(f"no result (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    arms = json.loads(out.read_text())
    torch_arm, ours = arms["torch"], arms["patched"]
    for arm, a in (("torch", torch_arm), ("patched", ours)):
        print(f"\n{arm}: {a['recorded']} nodes recorded, {len(a['live'])} live, {a['dead_index_ops']} dead index ops")
    assert arms["strided_nodes"] > 0
    assert torch_arm["dead_index_ops"] > 100, "torch no longer records its bookkeeping: is the patch still needed?"
    assert ours["dead_index_ops"] == 0
    assert ours["live"] == torch_arm["live"]
    assert ours["recorded"] < torch_arm["recorded"] / 5


@pytest.mark.multirank
def test_launcher_job_with_strided_sharding_trains_like_one_rank(tmp_path):
    """``--autoparallel.strided_sharding true`` through ./run_train.sh: LLaMA3 debug cut to
    2 blocks, FSDP 2 x TP 2, local batch 3 x seq 512, 3 steps, against 1 rank at batch 6.
    The local batch of 3 does not split over tp, and the planner picks strided sequence
    shards for the q/k/v and feed-forward matmuls by itself (its objective is lower than
    with the option off; experiments/strided); the compiled step runs them.
    (At the auto-parity tests' batch 4 x seq 64 the planner picks no strided shard:
    the batch then splits over tp as well, which is as cheap.)"""
    from _run import FEW_LAYERS, check_records, train

    tp = ("--parallelism.tensor_parallel_degree", "2")
    auto = train(
        tmp_path / "auto", "--model.name", "llama3_auto_parallel", *tp, "--autoparallel.strided_sharding", "true",
        ngpu=4, steps=3, seq_len=512, local_batch_size=3, timeout=RUN_TIMEOUT_S, n_layers=FEW_LAYERS,
    )  # fmt: skip
    ref = train(tmp_path / "ref", ngpu=1, steps=3, seq_len=512, local_batch_size=6, timeout=RUN_TIMEOUT_S,
                n_layers=FEW_LAYERS)
    check_records(auto, 3)
    assert [r["loss"] for r in auto] == pytest.approx([r["loss"] for r in ref], rel=REL_TOL)
    nodes = json.loads((tmp_path / "auto" / "plan.json").read_text())["nodes"]
    strided = {name: p for name, p in nodes.items() if "SS(" in json.dumps(p)}
    print(f"\nlosses {[r['loss'] for r in auto]}; {len(strided)} strided nodes, e.g. {list(strided.items())[:2]}")
    assert any(name.startswith("mm") for name in strided)


# ---------------------------------------------------------------- the ranks' side


def _pairs_main(out: str) -> None:
    """Every redistribution to or from a strided placement on a 2x2 mesh, checked on each rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    shape = (24, 4)
    opts = [R, Shard(0), Shard(1), SS(0, 2), SS(0, 3), SS(1, 2)]
    cands = [c for c in itertools.product(opts, repeat=2) if is_evenly_shardable(shape, c, (2, 2))]
    pairs = [(a, b) for a, b in itertools.product(cands, cands) if a != b and has_strided(a + b)]
    partial = [
        (tuple(Partial() if j == i else p for j, p in enumerate(a)), b)
        for a, b in pairs
        for i in range(2)
        if a[i] == R and not isinstance(b[i], Partial)
    ]
    report = {"pairs": len(pairs) + len(partial), "partial_pairs": len(partial), "wrong": [], "count_mismatch": []}
    for src, dst in pairs + partial:
        ok, counts = _check_pair(mesh, shape, src, dst)
        if not ok:
            report["wrong"].append(f"{label(src)} -> {label(dst)}")
        elif counts is not None:
            report["count_mismatch"].append(f"{label(src)} -> {label(dst)}: {counts}")
    report["dtensor"] = _dtensor_alone(mesh, shape)
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, report)
    if dist.get_rank() == 0:
        merged = {**flags[0], "wrong": sorted({w for r in flags for w in r["wrong"]})}
        Path(out).write_text(json.dumps(merged, indent=1))
    dist.destroy_process_group()


def _values(mesh, shape, placements) -> torch.Tensor:
    """This rank's rows of arange(shape) under ``placements``, by index arithmetic alone."""
    from torchtitan_autoparallel.execute.strided import held

    full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    coord, sizes = mesh.get_coordinate(), tuple(mesh.mesh.shape)
    for d in range(len(shape)):
        full = full.index_select(d, held(shape[d], placements, sizes, coord, d))
    return full


def _check_pair(mesh, shape, src, dst) -> tuple[bool, dict | None]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    from torchtitan_autoparallel.execute.audit import executed_collectives
    from torchtitan_autoparallel.execute.redistribute import redistribute_to

    plain_src = tuple(R if isinstance(p, Partial) else p for p in src)
    # Partial(sum) over a mesh dim of 2: each rank holds half the value.
    scale = 0.5 if any(isinstance(p, Partial) for p in src) else 1.0
    value = DTensor.from_local(
        _values(mesh, shape, plain_src) * scale, mesh, src, run_check=False, shape=shape, stride=(shape[1], 1)
    )
    with CommDebugMode() as comm:
        out = redistribute_to(value, mesh, dst)
    ok = tuple(out.placements) == dst and torch.equal(out.to_local(), _values(mesh, shape, dst))
    got = executed_collectives(comm.get_comm_counts())
    # gloo has no all-to-all: DTensor gathers and chunks instead (as audit.py expects)
    want = collections.Counter(
        "all_gather" if s.kind == "all_to_all" else s.kind for s in redistribute_steps(shape, 4, src, dst, (2, 2))
    )
    return ok, None if got == want else {"executed": dict(got), "priced": dict(want)}


def _dtensor_alone(mesh, shape) -> str:
    """Whether DTensor's own redistribute gets a nested strided case right (why strided.py exists)."""
    from torch.distributed.tensor import DTensor

    src, dst = (R, SS(0, 6)), (Shard(0), SS(0, 3))
    value = DTensor.from_local(_values(mesh, shape, src), mesh, src, run_check=False, shape=shape, stride=(shape[1], 1))
    try:
        right = torch.equal(value.redistribute(mesh, dst).to_local(), _values(mesh, shape, dst))
    except Exception as e:  # noqa: BLE001 - reported, not raised: it is torch's behaviour we record
        return f"{label(src)} -> {label(dst)} raises {type(e).__name__}"
    return f"{label(src)} -> {label(dst)} is {'right' if right else 'WRONG'}"


def _compile_arms_main(out: str) -> None:
    """Compile one strided plan (LLaMA3 debug, 1 block, 2x2, batch 6 x 512) as torch
    traces, then with ``sharding_propagation_for_trace``; what each recorded."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan_autoparallel.execute import compiled
    from torchtitan_autoparallel.execute.parity import ParityConfig, batch, full_model, plan_parity

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    cfg = ParityConfig(layers=1, batch=6, seq_len=512, strided_sharding=1)
    full = full_model(cfg)
    planned = plan_parity(cfg, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp")), full)
    step = planned.step
    report: dict = {"strided_nodes": len(_strided(list(step.chosen.values())))}
    tokens, labels = batch(cfg, 0, full.tok_embeddings.weight.shape[0])
    ours = compiled.sharding_propagation_for_trace
    for arm in ("torch", "patched"):  # torch's first, while DTensor's caches are cold
        compiled.sharding_propagation_for_trace = ours if arm == "patched" else contextlib.nullcontext
        step.compile(tokens, labels)
        report[arm] = _recorded(step.local_graph)
    Path(out).write_text(json.dumps(report))
    dist.destroy_process_group()


def _recorded(gm) -> dict:
    """Node count, live nodes' signatures, and dead arange/split nodes of a graph."""
    from _graphs import live_graph, node_signatures

    live = live_graph(gm)
    kept = {n.name for n in live.graph.nodes}
    index_ops = (aten.arange.default, aten.split.Tensor)
    dead = sum(1 for n in gm.graph.nodes if n.name not in kept and n.target in index_ops)
    return {"recorded": len(gm.graph.nodes), "live": node_signatures(live), "dead_index_ops": dead}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for _graphs
    if "--compile-arms" in sys.argv:
        _compile_arms_main(sys.argv[sys.argv.index("--out") + 1])
    else:
        _pairs_main(sys.argv[sys.argv.index("--out") + 1])
