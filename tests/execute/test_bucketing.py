"""``execute/bucketing.py``: all-gathers and reduce-scatters merged into buckets.

Graph tests trace small steps of raw functional collectives with ``make_fx``
on a real one-rank gloo group, so the bucketed graph runs and its values are
compared bitwise with the traced one. Multi-rank tests train the LLaMA3 debug
model through the compiled, bucketed and scheduled step under torchrun and
compare the losses with one device.
"""

from __future__ import annotations

import pytest
import torch
from _graphs import _ag, _inputs, _rs, _trace, _wait
from torch import fx

from torchtitan_autoparallel.execute.bucketing import bucket_collectives
from torchtitan_autoparallel.execute.compiled import graph_collectives
from torchtitan_autoparallel.execute.overlap import is_collective, schedule_overlap


def _members(gm: fx.GraphModule) -> list[set[str]]:
    """For each collective, the names of the nodes its (possibly merged) buffer is made of."""
    out = []
    for c in (n for n in gm.graph.nodes if is_collective(n)):
        buf = c.args[0]
        if buf.target is torch.ops.aten.view.default:  # a merged reduce-scatter flattens its cat
            buf = buf.args[0]
        parts = buf.args[0] if buf.target is torch.ops.aten.cat.default else [buf]
        out.append({p.args[0].name if p.target is torch.ops.aten.reshape.default else p.name for p in parts})
    return out


def _assert_same_values(gm: fx.GraphModule, reference: fx.GraphModule) -> None:
    inputs = _inputs()
    for got, want in zip(gm(*inputs), reference(*inputs), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got, want)


def test_buckets_follow_the_placement_rule_and_keep_the_values(gloo_one):
    reference, gm = _trace(gloo_one), _trace(gloo_one)
    assert graph_collectives(gm) == {"all_gather": 6, "reduce_scatter": 4}
    stats = bucket_collectives(gm)
    gm.graph.lint()
    assert stats.before == {"all_gather": 6, "reduce_scatter": 4}
    assert stats.after == {"all_gather": 3, "reduce_scatter": 1} == dict(graph_collectives(gm))
    assert stats.buckets == (2, 3, 4)
    assert stats.summary() == "6 all_gather -> 3, 4 reduce_scatter -> 1"
    members = _members(gm)
    # The late activation does not join w0's bucket (w0 is used before sin(h) exists); w2 and b join it.
    assert members[0] == {"w0_1", "w1_1"}
    assert members[1] == {"sin", "w2_1", "b_1"}
    assert members[2] == {"ids_1"}  # the int64 gather is left alone
    assert len(members[3]) == 4
    _assert_same_values(gm, reference)
    # The scheduler runs after bucketing in the compiled step: still the same values.
    schedule_overlap(gm)
    _assert_same_values(gm, reference)


def test_a_bucket_never_exceeds_the_cap(gloo_one):
    reference, gm = _trace(gloo_one), _trace(gloo_one)
    # Bytes: w0 (256) is over it alone and w1 (192) fits only alone; sin(h), w2 and b
    # (96 + 72 + 12) fit together. Gradients: 128, 256 (alone), then 48 + 72.
    cap = 200
    stats = bucket_collectives(gm, bucket_bytes=cap)
    gm.graph.lint()
    assert stats.after == {"all_gather": 4, "reduce_scatter": 3} and stats.buckets == (3, 2)
    collectives = [n for n in gm.graph.nodes if is_collective(n)]
    for c, parts in zip(collectives, _members(gm), strict=True):
        full = c.meta["val"] if c.target is _ag.default else c.args[0].meta["val"]  # the full-size buffer
        if len(parts) > 1:  # a merged one (w0 alone stays as it was)
            assert full.numel() * full.element_size() <= cap
    _assert_same_values(gm, reference)


def _across(mutate: bool):
    def traced(group: str):
        def step(x, w0, w1, w2, b, ids):
            a = _wait(_ag(w0, 1, group))
            y = x * 1
            if mutate:
                y.add_(1)  # neither gather may cross it: they stay apart
            c = _wait(_ag(w1, 1, group))
            return a @ c, y

        return step

    return traced


@pytest.mark.parametrize("mutate", [False, True])
def test_collectives_do_not_merge_across_a_mutation(gloo_one, mutate):
    reference, gm = _trace(gloo_one, _across(mutate)), _trace(gloo_one, _across(mutate))
    stats = bucket_collectives(gm)
    assert stats.before == {"all_gather": 2}
    assert stats.after == {"all_gather": 2 if mutate else 1}
    _assert_same_values(gm, reference)


def _gradient_beside_activation(group: str):
    def step(x, w0, w1, w2, b, ids):
        grad = _wait(_rs(w0 * 2, "sum", 1, group))  # read by the output alone: kept to the end
        act = _wait(_rs(x * 3, "sum", 1, group))  # read by the next op, then dead
        return grad, torch.tanh(act).sum()

    return step


def test_a_kept_gradient_does_not_keep_an_activation_alive(gloo_one):
    """A merged result is one buffer, alive while any slice is: a gradient's reduce-scatter,
    read by the step's output, stays out of an activation's bucket (and would be merged
    with another gradient's)."""
    reference = _trace(gloo_one, _gradient_beside_activation)
    gm = _trace(gloo_one, _gradient_beside_activation)
    stats = bucket_collectives(gm)
    assert stats.before == {"reduce_scatter": 2} and stats.after == {"reduce_scatter": 2}
    _assert_same_values(gm, reference)


def test_the_pass_is_deterministic(gloo_one):
    first, second = _trace(gloo_one), _trace(gloo_one)
    assert bucket_collectives(first) == bucket_collectives(second)
    assert [n.name for n in first.graph.nodes] == [n.name for n in second.graph.nodes]
    again = bucket_collectives(first)  # merged buckets do not merge further
    assert again.before == again.after


def test_the_cap_must_be_positive(gloo_one):
    with pytest.raises(ValueError, match="bucket_bytes"):
        bucket_collectives(_trace(gloo_one), bucket_bytes=0)


# ---------------------------------------------------------------- multi-rank parity


@pytest.mark.multirank
@pytest.mark.parametrize("mesh", ["dp_shard=2", "dp_shard=2,tp=2"])
def test_bucketed_losses_equal_single_device(mesh, tmp_path_factory):
    from test_execute import REL_TOL, reference, run_parity

    flags = ("--audit", "--compile", "1", "--bucket-collectives", "1", "--overlap-execution", "1")
    result = run_parity(mesh, *flags, tmp=tmp_path_factory.mktemp("bucketed"))
    assert "error" not in result, result["error"]
    want = reference("llama3")
    print(f"\nbucketed {mesh}: losses {result['losses']} (reference {want})")
    print(f"expected {result['expected']}, compiled {result['compiled_collectives']}, {result['bucket_stats']}")
    assert len(result["losses"]) == len(want)
    for step, (got, ref) in enumerate(zip(result["losses"], want)):
        assert abs(got - ref) <= REL_TOL * abs(ref), f"step {step}: {got} vs {ref}"
    compiled, expected = result["compiled_collectives"], result["expected"]
    assert compiled["all_gather"] < expected["all_gather"]
    # On dp_shard x tp every reduce-scatter is one step of DTensor's two-step sequence (the
    # next step reads its result at once): none can wait for a neighbour, so none merge.
    # The gradients are reduced as the backward makes them, not all together at the end.
    if "tp" in mesh:
        assert compiled["reduce_scatter"] == expected["reduce_scatter"]
    else:
        assert compiled["reduce_scatter"] < expected["reduce_scatter"]
