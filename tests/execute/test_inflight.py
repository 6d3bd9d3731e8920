"""execute/inflight.py: on gloo, a backend build keeps one collective in flight.

* ``blocking``: every all-gather, reduce-scatter and all-reduce with its wait
  becomes one ``collective_now`` call, and the graph computes the same values;
* ``chained``: each collective but the last is issued after the previous
  one's wait and keeps its own wait where it was; Inductor's build of it
  computes the same values and never has two collectives in flight;
* a collective whose wait comes after the next collective is made blocking,
  one whose buffer is read other than through its wait is left alone;
* the chained op issues on a private copy of its input, released by the
  next collective;
* the ops' fake implementations give the shapes the real ones do;
* only gloo gets the rewrite, ``AUTOPARALLEL_GLOO_COLLECTIVES`` picks the
  way, and a bad value is a clear error;
* ``queued`` rewrites nothing where every gloo group has one
  worker thread (``cpu_compat.one_gloo_worker_thread``), and falls back to
  ``chained`` on torch's two-thread groups.
The backend path on 2 and 4 gloo ranks is ``test_compile``'s and
``experiments/gloo_inflight``'s.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx
from torch.library import opcheck

from torchtitan_autoparallel.cpu_compat import one_gloo_worker_thread
from torchtitan_autoparallel.errors import ConfigError
from torchtitan_autoparallel.execute import inflight
from torchtitan_autoparallel.execute.inflight import (
    MODE_ENV,
    gloo_groups_one_thread,
    gloo_mode,
    mode_from_env,
    one_in_flight,
)

c10d = torch.ops._c10d_functional
AFTER = "autoparallel.collective_after.default"
NOW = "autoparallel.collective_now.default"


def _calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in _calls(gm)]


def _three_collectives(group: str):
    def step(x: torch.Tensor, y: torch.Tensor):
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(x * 2, 1, group))
        scattered = c10d.wait_tensor(c10d.reduce_scatter_tensor(y + 1, "sum", 1, group))
        reduced = c10d.wait_tensor(c10d.all_reduce(gathered @ scattered, "sum", group))
        return (reduced.relu(),)

    return step


def test_blocking_makes_each_collective_and_its_wait_one_call(gloo_one: str) -> None:
    x, y = torch.randn(4, 3), torch.randn(3, 5)
    gm = make_fx(_three_collectives(gloo_one))(x, y)
    want = gm(x, y)[0]
    assert one_in_flight(gm, chained=False) == (0, 3)
    targets = _targets(gm)
    assert targets.count(NOW) == 3, targets
    assert not any(t.startswith("_c10d_functional.") for t in targets), targets
    assert torch.equal(gm(x, y)[0], want)


def test_chained_issues_each_collective_after_the_previous_wait(gloo_one: str) -> None:
    x, y = torch.randn(4, 3), torch.randn(3, 5)
    gm = make_fx(_three_collectives(gloo_one))(x, y)
    want = gm(x, y)[0]
    assert one_in_flight(gm, chained=True) == (2, 1)
    ops = [n for n in _calls(gm) if str(n.target) in (AFTER, NOW)]
    assert [str(n.target) for n in ops] == [AFTER, AFTER, NOW]  # the last has nothing to overlap
    assert ops[0].args[1] == []
    for before, op in zip(ops, ops[1:]):
        (token,) = op.args[1]
        assert str(token.target) == "_c10d_functional.wait_tensor.default" and token.args[0] is before
    assert torch.equal(gm(x, y)[0], want)


def test_inductor_keeps_one_chained_collective_in_flight(gloo_one: str) -> None:
    from torch._dynamo import lookup_backend
    from torch._inductor.utils import run_and_get_code

    x, y = torch.randn(64, 32), torch.randn(32, 48)
    gm = make_fx(_three_collectives(gloo_one))(x, y)
    want = gm(x, y)[0]
    one_in_flight(gm, chained=True)
    compiled, (code,) = run_and_get_code(lambda: lookup_backend("inductor")(gm, [x, y]))
    assert torch.equal(compiled(x, y)[0], want)
    pending, most = set(), 0
    for line in code.splitlines():
        if m := re.match(r"\s*(buf\d+) = torch\.ops\.autoparallel\.collective_after", line):
            pending.add(m.group(1))
            most = max(most, len(pending))
        elif m := re.search(r"wait_tensor\.default\((buf\d+)\)", line):
            pending.discard(m.group(1))
    assert most == 1 and not pending, code


def test_a_wait_after_the_next_collective_makes_its_collective_blocking(gloo_one: str) -> None:
    def step(x: torch.Tensor, y: torch.Tensor):
        a = c10d.all_gather_into_tensor(x, 1, gloo_one)
        b = c10d.all_gather_into_tensor(y, 1, gloo_one)  # issued while ``a`` is in flight
        return (c10d.wait_tensor(a) + c10d.wait_tensor(b),)

    x, y = torch.randn(4), torch.randn(4)
    gm = make_fx(step)(x, y)
    assert one_in_flight(gm, chained=True) == (0, 2)
    assert torch.equal(gm(x, y)[0], x + y)


def test_a_buffer_read_before_its_wait_keeps_its_collective(gloo_one: str) -> None:
    def step(x: torch.Tensor):
        out = c10d.all_gather_into_tensor(x, 1, gloo_one)
        early = out.sum()  # reads the buffer before the wait: not ours to move
        return (c10d.wait_tensor(out) + early,)

    gm = make_fx(step)(torch.randn(4))
    assert one_in_flight(gm, chained=True) == (0, 0)
    assert "_c10d_functional.all_gather_into_tensor.default" in _targets(gm)


def test_the_chained_op_sends_a_private_copy_until_the_next_collective(gloo_one: str) -> None:
    x = torch.randn(4, 3)
    out = torch.ops.autoparallel.collective_after.default(x, [], "all_gather_into_tensor", "", 1, gloo_one)
    (held,) = inflight._IN_FLIGHT
    assert torch.equal(held, x) and held.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    x.zero_()  # what the backend may do to a buffer it thinks is free
    done = c10d.wait_tensor(out)
    torch.ops.autoparallel.collective_now.default(torch.ones(2), [done], "all_reduce", "sum", 0, gloo_one)
    assert not inflight._IN_FLIGHT
    assert torch.equal(done, held)


def test_the_ops_pass_torch_custom_op_checks(gloo_one: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    cases = [
        (torch.randn(4, 3), [], "all_gather_into_tensor", "", 1, gloo_one),
        (torch.randn(4, 3), [torch.randn(2)], "reduce_scatter_tensor", "sum", 1, gloo_one),
        (torch.randn(2, 3).t(), [], "all_reduce", "sum", 0, gloo_one),
    ]
    for args in cases:
        opcheck(torch.ops.autoparallel.collective_now.default, args, test_utils=("test_schema", "test_faketensor"))
        # opcheck never waits, so the chained op (same fake function) is checked by hand
        real = c10d.wait_tensor(torch.ops.autoparallel.collective_after.default(*args))
        with FakeTensorMode() as mode:
            fake_args = (mode.from_tensor(args[0]), [mode.from_tensor(t) for t in args[1]], *args[2:])
            fake = torch.ops.autoparallel.collective_after.default(*fake_args)
        assert (fake.shape, fake.dtype) == (real.shape, real.dtype)


def test_an_unknown_kind_is_a_clear_error(gloo_one: str) -> None:
    with pytest.raises(ValueError, match=r"no collective 'broadcast'; known: all_gather_into_tensor"):
        torch.ops.autoparallel.collective_now.default(torch.randn(2), [], "broadcast", "", 1, gloo_one)


def test_the_mode_is_for_gloo_and_comes_from_the_environment(gloo_one: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MODE_ENV, raising=False)
    assert mode_from_env() == "chained"
    assert gloo_mode() == "chained"
    monkeypatch.setenv(MODE_ENV, "queued")
    assert not gloo_groups_one_thread()  # torch's own gloo group: two worker threads
    assert gloo_mode() == "chained"  # so queued falls back
    monkeypatch.setenv(MODE_ENV, "blocking")
    assert gloo_mode() == "blocking"
    monkeypatch.setenv(MODE_ENV, "async")
    assert gloo_mode() is None
    monkeypatch.setenv(MODE_ENV, "overlapped")
    with pytest.raises(ConfigError, match=r"AUTOPARALLEL_GLOO_COLLECTIVES='overlapped' is not a mode; use one of chained, queued"):
        mode_from_env()


@pytest.fixture
def gloo_one_thread(tmp_path):
    """A one-rank gloo group made after ``one_gloo_worker_thread``; torch's plugin restored after."""
    plugins = dist.distributed_c10d.Backend._plugins
    saved = dict(plugins)
    if dist.is_initialized():
        pytest.fail("a process group is already open in this process")
    try:
        plugins.pop("GLOO", None)  # as in a fresh process: torch registers gloo on first use
        assert one_gloo_worker_thread()
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        plugins.clear()
        plugins.update(saved)


def test_queued_groups_have_one_worker_thread_and_keep_the_schedule(
    gloo_one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MODE_ENV, "queued")
    sub = dist.new_group([0])
    for group in (dist.group.WORLD, sub):
        assert group._get_backend(torch.device("cpu")).options._threads == 1
    assert gloo_groups_one_thread()
    assert gloo_mode() == "queued"  # no rewrite: the group runs one collective at a time
    xs = [torch.full((3,), float(i)) for i in range(8)]
    issued = [c10d.all_reduce(x, "sum", sub.group_name) for x in xs]  # eight in flight on one group
    assert all(torch.equal(c10d.wait_tensor(out), x) for out, x in zip(issued, xs))


def test_without_torch_hooks_groups_keep_two_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = dist.distributed_c10d.Backend
    before = dict(backend._plugins)
    monkeypatch.delattr(backend, "_BackendPlugin")
    assert one_gloo_worker_thread() is False
    assert backend._plugins == before


def test_no_process_group_means_no_rewrite() -> None:
    assert gloo_mode() is None
