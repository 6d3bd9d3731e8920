"""execute/blocking.py: on gloo, a backend build's collectives each finish before the next op.

* every all-gather, reduce-scatter and all-reduce with its wait becomes one
  ``collective_now`` call, and the graph computes the same values;
* a collective whose buffer is read other than through its wait is left alone;
* the op's fake implementation gives the shapes the real one does;
* only gloo gets the rewrite, and AUTOPARALLEL_GLOO_ASYNC=1 turns it off.
The backend path itself (Inductor on 2 gloo ranks) is ``test_compile``'s.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.library import opcheck

from torchtitan_autoparallel.execute.blocking import ASYNC_ENV, make_blocking, needs_blocking

c10d = torch.ops._c10d_functional


def _targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _three_collectives(group: str):
    def step(x: torch.Tensor, y: torch.Tensor):
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(x * 2, 1, group))
        scattered = c10d.wait_tensor(c10d.reduce_scatter_tensor(y + 1, "sum", 1, group))
        reduced = c10d.wait_tensor(c10d.all_reduce(gathered @ scattered, "sum", group))
        return (reduced.relu(),)

    return step


def test_each_collective_and_its_wait_become_one_blocking_call(gloo_one: str) -> None:
    assert needs_blocking()
    x, y = torch.randn(4, 3), torch.randn(3, 5)
    gm = make_fx(_three_collectives(gloo_one))(x, y)
    want = gm(x, y)[0]
    assert make_blocking(gm) == 3
    targets = _targets(gm)
    assert targets.count("autoparallel.collective_now.default") == 3, targets
    assert not any(t.startswith("_c10d_functional.") for t in targets), targets
    assert torch.equal(gm(x, y)[0], want)


def test_a_buffer_read_before_its_wait_keeps_its_collective(gloo_one: str) -> None:
    def step(x: torch.Tensor):
        out = c10d.all_gather_into_tensor(x, 1, gloo_one)
        early = out.sum()  # reads the buffer before the wait: not ours to move
        return (c10d.wait_tensor(out) + early,)

    gm = make_fx(step)(torch.randn(4))
    assert make_blocking(gm) == 0
    assert "_c10d_functional.all_gather_into_tensor.default" in _targets(gm)


def test_the_blocking_op_passes_torch_custom_op_checks(gloo_one: str) -> None:
    op = torch.ops.autoparallel.collective_now.default
    for args in [
        (torch.randn(4, 3), "all_gather_into_tensor", "", 1, gloo_one),
        (torch.randn(4, 3), "reduce_scatter_tensor", "sum", 1, gloo_one),
        (torch.randn(2, 3).t(), "all_reduce", "sum", 0, gloo_one),
    ]:
        opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_an_unknown_kind_is_a_clear_error(gloo_one: str) -> None:
    with pytest.raises(ValueError, match=r"collective_now: no collective 'broadcast'; known: all_gather_into_tensor"):
        torch.ops.autoparallel.collective_now.default(torch.randn(2), "broadcast", "", 1, gloo_one)


def test_blocking_is_for_gloo_and_can_be_turned_off(gloo_one: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ASYNC_ENV, raising=False)
    assert needs_blocking()
    monkeypatch.setenv(ASYNC_ENV, "1")
    assert not needs_blocking()


def test_no_process_group_means_no_rewrite() -> None:
    assert not needs_blocking()
