"""``report/executed.py``: the collectives the executor issues, counted after bucketing.

The graph is ``test_bucketing``'s small step of raw functional collectives on a
real one-rank gloo group; the multi-rank check against a training run's compiled
step is ``test_plan_check.test_auto_training_run_checks_its_plan``.
"""

from __future__ import annotations

import copy
from collections import Counter
from types import SimpleNamespace

import pytest
from _graphs import _trace
from torch.distributed.device_mesh import init_device_mesh

from torchtitan_autoparallel.execute.bucketing import bucket_collectives
from torchtitan_autoparallel.execute.compiled import graph_collectives
from torchtitan_autoparallel.execute.graph_cost import graph_cost
from torchtitan_autoparallel.planner.cost.profiles import load_profile
from torchtitan_autoparallel.report.executed import MeshGroups, bucketed_collectives, executed_collectives, from_dicts


def _per_kind(found) -> dict[str, int]:
    counts: Counter = Counter()
    for c in found:
        counts[c.kind] += c.count
    return dict(counts)


def test_counted_after_bucketing_as_the_executor_issues_them(gloo_one) -> None:
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    groups = MeshGroups.of(mesh)
    gm = _trace(mesh.get_group(0).group_name)
    untouched = [n.name for n in gm.graph.nodes]
    profile = load_profile("h100")
    listed = bucketed_collectives(gm, groups, profile)
    assert [n.name for n in gm.graph.nodes] == untouched  # bucketed a copy
    merged = copy.deepcopy(gm)
    stats = bucket_collectives(merged)  # what the executor's compile does to its graph
    assert _per_kind(listed) == stats.after == dict(graph_collectives(merged)) == {"all_gather": 3, "reduce_scatter": 1}
    assert _per_kind(executed_collectives(gm, groups, profile)) == stats.before  # unbucketed: one per tensor
    assert {c.mesh_dim for c in listed} == {"dp_shard"}
    # the 4 gradients' reduce-scatter is one call over their buffers (128 + 256 + 48 + 72 bytes)
    (scatter,) = [c for c in listed if c.kind == "reduce_scatter"]
    assert scatter.count == 1 and scatter.bytes == 504
    # priced as the plan check prices the executed graph, on a dim of 4 ranks (one rank costs nothing)
    wide = SimpleNamespace(mesh=SimpleNamespace(shape=(4,)), ndim=1, size=lambda dim: 4, get_group=mesh.get_group)
    priced = bucketed_collectives(gm, MeshGroups(groups.groups, groups.names, (4,)), profile)
    assert all(c.us > 0 for c in priced)
    assert sum(c.us * c.count for c in priced) == pytest.approx(graph_cost(merged, wide, profile).comm_us, rel=1e-12)
    assert from_dicts([c.to_dict() for c in listed]) == listed  # through plan.json and back


def test_a_collective_on_a_group_outside_the_mesh_is_named(gloo_one) -> None:
    gm = _trace(gloo_one)
    elsewhere = MeshGroups({"not-this-group": 0}, ("dp_shard",), (1,))
    with pytest.raises(ValueError, match=r"all_gather over group .* which is no dim of the mesh"):
        executed_collectives(gm, elsewhere, load_profile("h100"))
