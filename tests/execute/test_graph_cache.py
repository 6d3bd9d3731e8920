"""``execute/graph_io.py`` and ``execute/graph_cache.py``: a compiled step stored and loaded exactly.

Graphs are small steps of raw functional collectives traced on a real
one-rank gloo group (as in test_bucketing.py), bucketed and scheduled like
the trainer's. The trainer-level checks (a second start loads every rank's
graph and trains bitwise the same; one spoiled rank makes all recompile) are
in test_auto_parity.py.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from _graphs import _inputs, _trace
from torch import fx

from torchtitan_autoparallel.execute import graph_cache
from torchtitan_autoparallel.execute.bucketing import bucket_collectives
from torchtitan_autoparallel.execute.graph_cache import GraphEntryError, load_entry, used_groups
from torchtitan_autoparallel.execute.graph_io import PackedGraph, pack, unpack
from torchtitan_autoparallel.execute.overlap import schedule_overlap


def _compiled(group: str) -> fx.GraphModule:
    gm = _trace(group)
    bucket_collectives(gm)
    schedule_overlap(gm)
    return gm


def _signature(gm: fx.GraphModule) -> list[tuple]:
    rows = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        shape = (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None
        rows.append((node.op, node.name, str(node.target), str(node.args), shape))
    return rows


def test_pack_unpack_rebuilds_the_same_graph_and_values(gloo_one, tmp_path):
    gm = _compiled(gloo_one)
    packed = pack(gm)
    again = unpack(PackedGraph(json.loads(json.dumps(packed.nodes)), packed.attributes))  # as stored
    assert _signature(again) == _signature(gm)
    assert all(v.device.type == "meta" for n in again.graph.nodes if isinstance(v := n.meta.get("val"), torch.Tensor))
    expected, got = gm(*_inputs()), again(*_inputs())
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_a_target_without_a_name_is_refused():
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(lambda t: t + 1, (x,)))
    with pytest.raises(TypeError, match="cannot be stored by name"):
        pack(fx.GraphModule(torch.nn.Module(), graph))


def _store(tmp_path: Path, gm: fx.GraphModule, key: str = "k") -> Path:
    path = tmp_path / "entry.pt"
    planned = types.SimpleNamespace(local_graph=gm, bucket_stats=None, overlap_stats=None)
    graph_cache._store(path, key, planned)
    assert path.exists()
    return path


def test_a_stored_entry_loads_and_records_its_groups(gloo_one, tmp_path):
    gm = _compiled(gloo_one)
    entry = load_entry(_store(tmp_path, gm), "k")
    assert entry.groups == {gloo_one: [0]} == used_groups(gm)
    assert _signature(entry.graph) == _signature(gm)


def test_an_entry_for_another_key_is_refused(gloo_one, tmp_path):
    with pytest.raises(GraphEntryError, match="does not match"):
        load_entry(_store(tmp_path, _compiled(gloo_one)), "other")


def test_a_corrupt_entry_is_refused(tmp_path):
    path = tmp_path / "entry.pt"
    path.write_bytes(b"\x80\x04 not a pickle")
    with pytest.raises(GraphEntryError, match="unreadable"):
        load_entry(path, "k")


def _edit_header(path: Path, edit) -> None:
    raw = torch.load(path, weights_only=True)
    header = json.loads(raw["header"])
    edit(header)
    torch.save({"header": json.dumps(header), "constants": raw["constants"]}, path)


def test_a_group_over_other_ranks_is_refused(gloo_one, tmp_path):
    path = _store(tmp_path, _compiled(gloo_one))
    # as if compiled on a two-rank group of that name
    _edit_header(path, lambda header: header.update(groups={gloo_one: [0, 1]}))
    with pytest.raises(GraphEntryError, match=rf"process group '{gloo_one}' was over ranks \[0, 1\], now \[0\]"):
        load_entry(path, "k")


def test_a_group_this_run_does_not_have_is_refused(gloo_one, tmp_path):
    path = _store(tmp_path, _compiled(gloo_one))

    def renamed(header):  # the graph as if compiled where the group had another name
        for node in header["nodes"]:
            if isinstance(node["args"], dict):
                node["args"]["tuple"] = ["4711" if a == gloo_one else a for a in node["args"]["tuple"]]
        header["groups"] = {"4711": [0]}

    _edit_header(path, renamed)
    with pytest.raises(GraphEntryError, match="'4711'.*no such group"):
        load_entry(path, "k")


class _Planted:
    def __reduce__(self):
        return (Path.touch, (_Planted.proof,))


def test_a_planted_pickle_is_refused_without_running(tmp_path):
    """An entry that would run code when unpickled: refused, and the code never ran."""
    _Planted.proof = tmp_path / "ran"
    path = tmp_path / "entry.pt"
    torch.save({"header": "{}", "constants": {}, "payload": _Planted()}, path)
    with pytest.raises(GraphEntryError, match="unreadable"):
        load_entry(path, "k")
    assert not _Planted.proof.exists()


@pytest.mark.parametrize("target", [{"callable": "os:system"}, {"op": "aten.__class__.__init__"},
                                    {"op": "aten.mm"}, {"import": "os"}])
def test_a_target_outside_the_closed_set_is_refused(gloo_one, tmp_path, target):
    """A stored graph names its calls; one that names anything but a torch op overload or
    operator.getitem does not rebuild."""
    path = _store(tmp_path, _compiled(gloo_one))

    def plant(header):
        next(n for n in header["nodes"] if n["op"] == "call_function")["target"] = target

    _edit_header(path, plant)
    with pytest.raises(GraphEntryError, match="does not rebuild"):
        load_entry(path, "k")
