"""``[compile]``: torch.compile on both paths, with torchtitan's keys.

* end to end on 2 ranks (the debug model cut to two blocks): a planned model whose step (and validation graph) Inductor
  builds trains and validates to the losses of the same run uncompiled, to rounding;
  so does torchtitan's FSDP with its blocks and loss compiled;
* the backend gets a copy of the step graph without its dead nodes (a fake-tensor
  pass refuses the data-dependent ones the CPU attention leaves), built once;
* a backend that fails says which and how to run without it; bad settings are refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _run import FEW_LAYERS, LLAMA3_CONFIG, RUNS, RunCache
from torch.fx.experimental.proxy_tensor import make_fx

from torchtitan_autoparallel.config import load_config
from torchtitan_autoparallel.execute.backend import BackendGraph

LOSS_REL = 1e-4
STEPS = 3
VALIDATE = ["--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "1"]
COMPILE = ["--compile.enable", "true"]


class Runs(RunCache):
    def run(self, name: str, *extra: str) -> list[dict]:
        return self.get(name, *VALIDATE, *extra, model="llama3", ngpu=2, steps=STEPS, seq_len=64, local_batch_size=2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("compile"), n_layers=FEW_LAYERS)


def _log(name: str) -> str:
    run = next(r for r in RUNS if f"/{name} " in r.cmd)
    return run.stdout + run.stderr


@pytest.mark.multirank
@pytest.mark.parametrize(
    "model,says",
    [
        (
            "llama3_auto_parallel",
            [
                "compile: inductor built the planned step",
                "compile: inductor built the loss-only graph",
                # gloo: one collective in flight at a time (execute/inflight.py)
                "gloo keeps one collective of the planned step in flight at a time",
                "gloo keeps one collective of the loss-only graph (validation) in flight at a time",
            ],
        ),
        ("llama3", ["Compiling each TransformerBlock", "compile: the loss function is compiled by inductor"]),
    ],
)
def test_compiled_runs_train_and_validate_like_eager(runs: Runs, model: str, says: list[str]) -> None:
    eager = runs.run(f"eager-{model}", "--model.name", model)
    compiled = runs.run(f"compiled-{model}", "--model.name", model, *COMPILE)
    log = _log(f"compiled-{model}")
    for line in says:
        assert line in log, log[-3000:]
    for key in ("loss", "grad_norm", "validation_loss"):
        want = [r[key] for r in eager if key in r]
        got = [r[key] for r in compiled if key in r]
        assert len(got) == len(want) > 0, key
        assert got == pytest.approx(want, rel=LOSS_REL), key
    eager_log = _log(f"eager-{model}")
    assert not any(line in eager_log for line in ["compile: ", *says]), eager_log[-3000:]


def _graph_with_dead_nonzero() -> torch.fx.GraphModule:
    def step(x: torch.Tensor):
        torch.nonzero(x > 0)  # read by nothing, as the CPU attention kernels leave it
        return (x * 2 + 1,)

    return make_fx(step)(torch.randn(4))


def test_backend_builds_a_copy_without_dead_nodes_once() -> None:
    graph = _graph_with_dead_nonzero()
    built = BackendGraph(graph, "aot_eager", "test graph")
    x = torch.randn(4)
    assert torch.equal(built(x)[0], x * 2 + 1)
    first = built.compiled
    assert first is not None and built(x)[0].shape == (4,) and built.compiled is first
    # the traced graph is kept whole (the plan check and validation read it)
    assert any("nonzero" in str(n.target) for n in graph.graph.nodes)


def test_a_failing_backend_names_itself_and_the_way_out() -> None:
    built = BackendGraph(_graph_with_dead_nonzero(), "no_such_backend", "test graph")
    with pytest.raises(RuntimeError, match=r"compile\.backend = 'no_such_backend' failed on the test graph; compile\.enable = false"):
        built(torch.randn(4))


def test_torchtitan_compile_section_reads(tmp_path: Path) -> None:
    toml = tmp_path / "job.toml"
    toml.write_text(LLAMA3_CONFIG.read_text() + '\n[compile]\nenable = true\ncomponents = ["loss"]\nbackend = "aot_eager"\n')
    c = load_config(config_file=str(toml)).compile
    assert (c.enable, c.components, c.backend) == (True, ["loss"], "aot_eager")
    assert load_config([]).compile.enable is False


def test_a_planned_step_is_compiled_only_from_its_local_graph(caplog: pytest.LogCaptureFixture) -> None:
    from torchtitan_autoparallel.train.auto import _compile_backend

    assert _compile_backend(load_config([])) is None
    assert _compile_backend(load_config(COMPILE)) == "inductor"
    # model and loss are one graph: naming either compiles it
    assert _compile_backend(load_config([*COMPILE, "--compile.components", "loss", "--compile.backend", "aot_eager"])) == "aot_eager"
    assert _compile_backend(load_config([*COMPILE, "--compile.components", ""])) is None
    with caplog.at_level("INFO", logger="torchtitan_autoparallel"):
        assert _compile_backend(load_config([*COMPILE, "--autoparallel.compile", "false"])) is None
    assert "compile.enable has no effect: autoparallel.compile is off" in caplog.text
