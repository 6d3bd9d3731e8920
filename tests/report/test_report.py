"""Reading a plan: the HTML report in real headless Chromium, plan diff, the peak-activation estimate.

Chromium is Debian's package (``make test`` installs it when missing); a
machine without it fails here with the command to install it, never skips.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from torchtitan_autoparallel.execute.audit import expected_collectives
from torchtitan_autoparallel.execute.bucketing import bucket_collectives
from torchtitan_autoparallel.execute.compiled import graph_collectives
from torchtitan_autoparallel.models.registry import build_meta_model
from torchtitan_autoparallel.planner.cost.profiles import load_profile
from torchtitan_autoparallel.planner.plan.api import plan_stages, plan_training_step
from torchtitan_autoparallel.planner.plan.options import PlannerOptions
from torchtitan_autoparallel.planner.plan.plan import Plan
from torchtitan_autoparallel.report.__main__ import main as report_main
from torchtitan_autoparallel.report.common import (
    GIB,
    MemoryFit,
    group_blocks,
    large_buffers,
    memory_fit,
    peak_summary,
    split_layer,
)
from torchtitan_autoparallel.report.diff import diff_plans, format_diff
from torchtitan_autoparallel.report.executed import MeshGroups, executed_collectives, fake_step_graph, traced_step_collectives
from torchtitan_autoparallel.report.html import write_html
from torchtitan_autoparallel.report.text import report_text
from torchtitan_autoparallel.report.words import dim_roles, plan_words

CHROMIUM = "/usr/bin/chromium"
pytestmark = pytest.mark.usefixtures("fake_world")


def _plan(mesh_shape, names, **kwargs) -> Plan:
    model = build_meta_model("llama3", "debugmodel", n_layers=3)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    return plan_training_step(model, mesh, global_batch_size=8, seq_len=128, profile=load_profile("h100"), **kwargs)


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    """plan.json of FSDP 8 and of FSDP 4 x TP 2, each in its own run folder."""
    root = tmp_path_factory.mktemp("plans")
    out = {}
    for name, shape, names in (("fsdp", (8,), ("dp_shard",)), ("fsdp_tp", (4, 2), ("dp_shard", "tp"))):
        (root / name).mkdir()
        _plan(shape, names).to_json(root / name / "plan.json")
        out[name] = root / name / "plan.json"
    return out


# ---------------------------------------------------------------- chromium


def _chromium(tmp_path: Path, *args: str) -> str:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium); `make test` does")
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium-profile'}", *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"chromium failed ({proc.returncode}): {proc.stderr[-2000:]}"
    return proc.stdout


class _Dom(HTMLParser):
    """Every element's tag and attributes, plus the text of the whole page."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data):
        self.text.append(data)

    def having(self, attr: str) -> list[dict[str, str]]:
        return [a for _, a in self.elements if attr in a]


def _render(plan_json: Path, tmp_path: Path, warn_gib: float) -> _Dom:
    page = tmp_path / "plan.html"
    write_html(Plan.from_json(plan_json), page, warn_gib * GIB)
    dom = _Dom()
    dom.feed(_chromium(tmp_path, "--dump-dom", page.as_uri()))
    return dom


def test_report_renders_and_shows_the_numbers_of_plan_json(plans, tmp_path: Path) -> None:
    data = json.loads(plans["fsdp_tp"].read_text())
    dom = _render(plans["fsdp_tp"], tmp_path, warn_gib=1.0)
    shown = {a["data-key"]: float(a["data-value"]) for a in dom.having("data-key")}
    p = data["predicted"]
    for key in ("compute_us", "comm_us", "total_us", "param_bytes_per_device", "peak_activation_bytes_per_device"):
        assert shown[key] == p[key], key
    assert shown["step_us"] == pytest.approx(
        p["total_us"] - p.get("overlap_savings_us", 0.0) + p.get("host_us", 0.0) + p.get("optimizer_us", 0.0), rel=1e-12
    )
    assert shown["collectives_total_us"] == pytest.approx(p["comm_us"], rel=1e-9)
    # One row per collective of plan.json, with its exact figures.
    rows = sorted(
        (a["data-kind"], a["data-mesh-dim"], a["data-purpose"], float(a["data-bytes"]), float(a["data-us"]), int(a["data-count"]))
        for a in dom.having("data-us")
    )
    assert rows == sorted((c["kind"], c["mesh_dim"], c["purpose"], c["bytes"], c["us"], c["count"]) for c in data["collectives"])
    # Grouped placements: each cell's placement is that of every layer its row covers.
    cells = dom.having("data-placement")
    assert {a["data-param"] for a in cells} >= {"tok_embeddings.weight", "lm_head.weight"}
    blocks = {a["data-block"] for a in dom.having("data-block")}
    covered = set()
    for block in group_blocks(data["parameters"]):
        assert block.name in blocks
        covered |= _check_block(block, data["parameters"])
    assert covered == set(data["parameters"])
    assert "No collective materialises more than 1.00 GiB per device." in "".join(dom.text)
    assert any(tag == "img" and a.get("src", "").startswith("data:image/png;base64,") for tag, a in dom.elements)
    # Self-contained: nothing is fetched from anywhere.
    assert not [a for _, a in dom.elements if any(v.startswith(("http:", "https:", "//")) for v in a.values())]


def _check_block(block, parameters: dict[str, list[str]]) -> set[str]:
    """The FQNs the row stands for, checked against plan.json."""
    if block.name == "(not in a layer)":
        for (_, cell), fqn in zip(block.cells, block.first_fqns):
            assert "".join(parameters[fqn]) == cell
        return set(block.first_fqns)
    prefix, _, span = block.name.rpartition(".")
    lo, _, hi = span.partition("-")
    out = set()
    for i in range(int(lo), int(hi or lo) + 1):
        for (_, cell), first in zip(block.cells, block.first_fqns):
            rest = split_layer(first)[2]
            fqn = f"{prefix}.{i}.{rest}"
            assert "".join(parameters[fqn]) == cell, fqn
            out.add(fqn)
    return out


def test_report_warns_of_large_gathers(plans, tmp_path: Path) -> None:
    plan = Plan.from_json(plans["fsdp"])
    threshold_gib = 100 * 2**10 / GIB  # 100 KiB: the debug model's big weights exceed it
    expected = large_buffers(plan, threshold_gib * GIB)
    assert expected, "the FSDP plan gathers no weight above 100 KiB; pick a smaller threshold"
    dom = _render(plans["fsdp"], tmp_path, warn_gib=threshold_gib)
    shown = [a for _, a in dom.elements if "warning" in a.get("class", "").split()]
    assert [(a["data-kind"], float(a["data-bytes"])) for a in shown] == [(b.kind, b.bytes) for b in expected]
    assert all(float(a["data-bytes"]) > threshold_gib * GIB for a in shown)


def test_memory_fit_counts_weights_adamw_state_and_the_step_peak(plans) -> None:
    plan = Plan.from_json(plans["fsdp"])
    assert plan.device_memory_bytes is None and memory_fit(plan) is None  # CPU ranks: not checked
    plan.device_memory_bytes = 80 * GIB
    fit = memory_fit(plan)
    params, peak = plan.predicted["param_bytes_per_device"], plan.predicted["peak_activation_bytes_per_device"]
    assert peak > 0 and fit.state_bytes == 3 * params and fit.total_bytes == 3 * params + peak
    assert fit.fits
    plan.device_memory_bytes = fit.total_bytes * 0.99
    assert not memory_fit(plan).fits


def test_memory_fit_advice_follows_what_fills_the_device() -> None:
    mostly_weights = MemoryFit(state_bytes=60 * GIB, activation_bytes=30 * GIB, device_bytes=80 * GIB)
    mostly_activations = MemoryFit(state_bytes=30 * GIB, activation_bytes=60 * GIB, device_bytes=80 * GIB)
    assert "data_parallel_shard_degree" in mostly_weights.message()
    assert "local_batch_size" not in mostly_weights.message()
    assert "local_batch_size" in mostly_activations.message()
    assert "activation_checkpoint.mode" in mostly_activations.message()
    assert "data_parallel_shard_degree" not in mostly_activations.message()
    # LLaMA3-405B on FSDP 256 x TP 8 (see MemoryFit.message): weight copies fill the peak
    kept = MemoryFit(state_bytes=2 * GIB, activation_bytes=106 * GIB, device_bytes=80 * GIB,
                     weight_copy_bytes=93 * GIB, shard_ranks=256)
    assert "(93.00 GiB)" in kept.message() and "over 256 shard ranks" in kept.message()
    assert "data_parallel_replicate_degree" in kept.message() and "local_batch_size" not in kept.message()
    # ...but with no shard group to shrink, or copies a minor part, the batch advice stands
    for other in (replace(kept, shard_ranks=1), replace(kept, weight_copy_bytes=40 * GIB)):
        assert "local_batch_size" in other.message() and "data_parallel_replicate_degree" not in other.message()


def test_report_warns_when_the_plan_outgrows_the_device(plans, tmp_path: Path) -> None:
    plan = Plan.from_json(plans["fsdp"])
    for device_bytes, warned in ((80 * GIB, False), (2**20, True)):
        plan.device_memory_bytes = device_bytes
        plan.to_json(tmp_path / "plan.json")
        dom = _render(tmp_path / "plan.json", tmp_path, warn_gib=1.0)
        shown = {a["data-key"]: float(a["data-value"]) for a in dom.having("data-key")}
        fit = memory_fit(plan)
        assert shown["device_memory_bytes"] == device_bytes and shown["state_bytes"] == fit.state_bytes
        flagged = [a for _, a in dom.elements if a.get("id") == "memory-fit"]
        assert [float(a["data-bytes"]) for a in flagged] == ([fit.total_bytes] if warned else [])


def test_report_screenshot_is_not_blank(plans, tmp_path: Path) -> None:
    from PIL import Image

    page = tmp_path / "plan.html"
    write_html(Plan.from_json(plans["fsdp_tp"]), page)
    shot = tmp_path / "shot.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1000,1400", page.as_uri())
    image = Image.open(shot).convert("L")
    lo, hi = image.getextrema()
    assert image.size == (1000, 1400) and hi - lo > 100  # text and coloured cells, not an empty page


# ---------------------------------------------------------------- diff


def test_diff_of_a_plan_with_itself_is_empty(plans) -> None:
    plan = Plan.from_json(plans["fsdp"])
    d = diff_plans(plan, plan)
    assert d.same_placements and not d.collectives
    text = format_diff(d)
    assert "parameter placements: unchanged" in text and "collectives: 0 changed" in text


def test_diff_accounts_for_every_change(plans) -> None:
    a, b = Plan.from_json(plans["fsdp"]), Plan.from_json(plans["fsdp_tp"])
    d = diff_plans(a, b)
    assert d.mesh == ("dp_shard=8", "dp_shard=4 x tp=2")
    # Ranges expand back to exactly the parameters whose placements differ.
    expanded = set()
    for change in d.placements:
        parts = change.name.split(".")
        idx = next((i for i, x in enumerate(parts) if x[0].isdigit()), None)
        if idx is None:
            expanded.add(change.name)
            continue
        lo, _, hi = parts[idx].partition("-")
        for i in range(int(lo), int(hi or lo) + 1):
            fqn = ".".join(parts[:idx] + [str(i)] + parts[idx + 1 :])
            assert "".join(a.parameters[fqn]) == change.before and "".join(b.parameters[fqn]) == change.after
            expanded.add(fqn)
    assert expanded == {f for f in a.parameters if a.parameters[f] != b.parameters[f]}
    # The collective changes add up to the change in predicted communication.
    delta = sum(c.us_after * c.count_after - c.us_before * c.count_before for c in d.collectives)
    assert delta == pytest.approx(b.comm_us - a.comm_us, rel=1e-6, abs=1e-6)
    text = format_diff(d, ("fsdp", "fsdp_tp"))
    assert "mesh: dp_shard=8 -> dp_shard=4 x tp=2" in text and "predicted step time" in text


def test_cli_diff_and_html(plans, capsys, tmp_path: Path) -> None:
    assert report_main(["diff", str(plans["fsdp"]), str(plans["fsdp_tp"])]) == 0
    assert "peak activations per device" in capsys.readouterr().out
    out = tmp_path / "r.html"
    assert report_main(["html", str(plans["fsdp"]), "-o", str(out)]) == 0
    assert out.read_text().startswith("<!doctype html>")
    assert "more than the device holds" not in capsys.readouterr().out  # CPU plan: not checked
    small = Plan.from_json(plans["fsdp"])
    small.device_memory_bytes = 2**20
    small.to_json(tmp_path / "small.json")
    assert report_main(["html", str(tmp_path / "small.json"), "-o", str(out)]) == 0
    warned = [line for line in capsys.readouterr().out.splitlines() if "more than the device holds" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: parameters and AdamW state")


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["diff", "/nonexistent/plan.json", "x"], "does not exist"),
        (["html", "PLAN", "--warn-gib", "0"], "--warn-gib 0.0; accepted"),
        (["frob"], "invalid choice"),
    ],
)
def test_cli_bad_input_is_one_line(argv, needle, capsys) -> None:
    assert report_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err


def test_cli_rejects_a_file_that_is_not_a_plan(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "plan.json"
    bad.write_text('{"hello": 1}')
    assert report_main(["diff", str(bad), str(bad)]) == 2
    assert "is not a plan.json" in capsys.readouterr().err


# ---------------------------------------------------------------- peak activations


def test_peak_activation_estimate_falls_with_checkpointing() -> None:
    one = _plan((1,), ("dp_shard",))
    full_ac = _plan((1,), ("dp_shard",), activation_checkpoint="full")
    peak = one.predicted["peak_activation_bytes_per_device"]
    # Logits of the whole batch (8 x 128 x 2048 fp32) are live at once, at least.
    assert peak >= 8 * 128 * 2048 * 4
    assert full_ac.predicted["peak_activation_bytes_per_device"] < peak


def test_the_peak_counts_the_weight_copies_in_it() -> None:
    """bf16 casts of the weights live at the peak are counted apart; fp32 weights are
    read in place (their views alias them), so that plan has none."""
    fp32 = _plan((1,), ("dp_shard",)).predicted
    bf16 = _plan((1,), ("dp_shard",), param_dtype=torch.bfloat16).predicted
    assert fp32["peak_weight_copy_bytes_per_device"] == 0
    numel = sum(p.numel() for p in build_meta_model("llama3", "debugmodel", n_layers=3).parameters())
    copies = bf16["peak_weight_copy_bytes_per_device"]
    assert 0 < copies <= 2 * numel and copies < bf16["peak_activation_bytes_per_device"]


def test_the_peak_lists_what_is_live_then_and_adds_up_to_it(plans, tmp_path: Path) -> None:
    plan = Plan.from_json(plans["fsdp_tp"])  # read back: the listing survives plan.json
    peak = plan.predicted["peak_activation_bytes_per_device"]
    parts = plan.peak_contents
    assert parts and plan.peak_at
    assert sum(p["bytes"] for p in parts) == pytest.approx(peak, rel=1e-12)
    listed = [p["bytes"] for p in parts if p["what"] not in ("other tensors",) and " kept " not in p["what"]
              and "redistributed" not in p["what"]]
    assert listed == sorted(listed, reverse=True) and all(p["count"] >= 1 for p in parts)
    # the whole batch's log-softmax (8 x 128 tokens x 2048 fp32) is among them, at its local size
    (logits,) = [p for p in parts if p["what"].startswith("_log_softmax float32 [1024, 2048] ")]
    placements = re.findall(r"S\(\d+\)|R|P", logits["what"].rsplit(" ", 1)[1])
    pieces = math.prod(n for p, n in zip(placements, plan.mesh["sizes"]) if p.startswith("S"))
    assert len(placements) == 2 and logits["bytes"] == 1024 * 2048 * 4 / pieces
    summary = peak_summary(plan)
    assert summary.startswith(f"at the step's peak ({plan.peak_at}): ") and parts[0]["what"] in summary
    dom = _render(plans["fsdp_tp"], tmp_path, warn_gib=1.0)
    rows = [a for tag, a in dom.elements if tag == "tr" and "data-what" in a]
    assert [r["data-what"] for r in rows] == [p["what"] for p in parts]


# ---------------------------------------------------------------- the plan in words


def _made_plan(names, sizes, parameters, collectives, budget=None, used=1.0) -> Plan:
    """A plan.json's content written by hand: placements and collectives as a planner would give."""
    from torchtitan_autoparallel.planner.plan.plan import Collective

    return Plan(
        mesh={"names": list(names), "sizes": list(sizes)}, parameters=parameters, nodes={},
        collectives=[Collective(*c) for c in collectives],
        predicted={"compute_us": 1.0, "comm_us": 1.0, "total_us": 2.0, "param_bytes_per_device": used},
        replicated_ops=[], objective=2.0, lower_bound=2.0, solver="ilp-highs", status="optimal",
        memory_budget_bytes=budget,
    )


_WEIGHTS = ("layers.0.attention.wo.weight", "layers.0.feed_forward.w1.weight", "norm.weight")


def test_words_name_a_ddp_plan() -> None:
    plan = _made_plan(["dp_replicate"], [4], {f: ["R"] for f in _WEIGHTS},
                      [("all_reduce", "dp_replicate", 4e6, 30.0, 3, "gradient")], budget=10.0, used=10.0)
    (dim,) = dim_roles(plan)
    assert dim.role == "DDP"
    assert dim.sentence.startswith("DDP over dp_replicate=4: every parameter replicated")
    assert "gradients: 3 all-reduces per step" in dim.sentence
    assert plan_words(plan)[-1].endswith("none is sharded.")


def test_words_name_an_fsdp_plan_and_why_it_shards() -> None:
    plan = _made_plan(
        ["dp_shard"], [4], {f: ["S(0)"] for f in _WEIGHTS},
        [("all_gather", "dp_shard", 4e6, 30.0, 3, "parameter"), ("reduce_scatter", "dp_shard", 4e6, 30.0, 3, "gradient")],
        budget=10.0, used=10.0,
    )
    (dim,) = dim_roles(plan)
    assert dim.role == "FSDP"
    assert dim.sentence == (
        "FSDP over dp_shard=4: all 3 parameters sharded, on dim 0 (wo, w1, norm), all-gathered before use "
        "(3 all-gathers of weights per step); gradients: 3 reduce-scatters per step."
    )
    assert "so the budget forced the sharding" in plan_words(plan)[-1]
    roomy = replace(plan, memory_budget_bytes=40.0)
    assert "chosen for speed, not forced by memory" in plan_words(roomy)[-1]


def test_words_name_an_fsdp_x_tp_plan_and_a_mixed_dim() -> None:
    params = {_WEIGHTS[0]: ["S(0)", "S(1)"], _WEIGHTS[1]: ["S(1)", "S(0)"], _WEIGHTS[2]: ["S(0)", "R"]}
    collectives = [
        ("all_gather", "dp_shard", 2e6, 20.0, 3, "parameter"), ("reduce_scatter", "dp_shard", 2e6, 20.0, 3, "gradient"),
        ("all_reduce", "tp", 1e6, 10.0, 2, "activation"), ("all_reduce", "tp", 4.0, 5.0, 1, "gradient"),
    ]
    plan = _made_plan(["dp_shard", "tp"], [4, 2], params, collectives, budget=10.0, used=5.0)
    fsdp, tp = dim_roles(plan)
    assert (fsdp.role, tp.role) == ("FSDP", "TP")
    assert tp.sentence == (
        "TP over tp=2: 2 of 3 parameters sharded (1 replicated), on dim 0 (w1), dim 1 (wo), used sharded "
        "(no weight is gathered on it); gradients: 1 all-reduce per step; activations: 2 all-reduces per step."
    )
    # weights gathered on tp too, beside the activation all-reduces: said to be mixed
    mixed = replace(plan, collectives=plan.collectives + _made_plan(
        ["tp"], [2], {}, [("all_gather", "tp", 1e6, 10.0, 1, "parameter")]).collectives)
    assert dim_roles(mixed)[1].role == "FSDP and TP mixed"
    assert ("1 all-gather of weights per step gather at most 1 of them before use, the others are used sharded, "
            "2 all-reduces of activations per step adding up their partial results") in dim_roles(mixed)[1].sentence
    # fewer gathers than sharded weights, without any all-reduce: FSDP if nearly all are gathered
    def gathers(n: int) -> Plan:
        kept = [c for c in plan.collectives if c.mesh_dim == "dp_shard"]
        return replace(plan, collectives=[replace(c, count=n) if c.purpose == "parameter" else c for c in kept])

    assert dim_roles(gathers(2))[0].role == "FSDP and TP mixed"  # 2 of 3: one in three used sharded
    many = replace(gathers(19), parameters={f"layers.{i}.w{j}.weight": ["S(0)", "R"] for i in range(10) for j in (1, 2)})
    assert dim_roles(many)[0].role == "FSDP"
    assert "(19 all-gathers of weights per step, so at most 1 of them used sharded)" in dim_roles(many)[0].sentence


def test_words_of_planned_plans_lead_the_report(plans, tmp_path: Path) -> None:
    """The planner's own plans: every dim gets a role, and the page and the text say it first."""
    plan = Plan.from_json(plans["fsdp_tp"])
    roles = dim_roles(plan)
    assert [r.name for r in roles] == ["dp_shard", "tp"]
    assert all(r.role in ("DDP", "FSDP", "TP", "FSDP and TP mixed") for r in roles)
    dom = _render(plans["fsdp_tp"], tmp_path, warn_gib=1.0)
    page = "".join(dom.text)
    assert page.index("What this plan is") < page.index("Predicted cost per step")
    for sentence in plan_words(plan):
        assert sentence in page
    text = report_text(plan)
    assert text.startswith("what this plan is:\n  - " + roles[0].role + " over dp_shard=4")


# ---------------------------------------------------------------- one unit per table


_CELL = re.compile(r'data-key="([^"]+)" data-value="([^"]+)">([^<]*)<')


def _table_cells(page: str, table: str) -> tuple[str, list[tuple[str, float, str]]]:
    """A table's data-unit and its (key, exact value, shown text) cells, from the page Chromium loaded."""
    m = re.search(rf'<table id="{table}" data-unit="(\w+)">(.*?)</table>', page, re.S)
    assert m, f"no table {table} with a data-unit"
    return m.group(1), [(k, float(v), shown) for k, v, shown in _CELL.findall(m.group(2))]


@pytest.mark.parametrize("scale,unit", [(1.0, "ms"), (1e4, "s")])
def test_every_time_table_shows_one_unit_named_in_its_header(plans, tmp_path: Path, scale, unit) -> None:
    plan = Plan.from_json(plans["fsdp_tp"])
    plan.predicted = {k: v * scale if k.endswith("_us") else v for k, v in plan.predicted.items()}
    plan.collectives = [replace(c, us=c.us * scale) for c in plan.collectives]
    plan.timings = {"trace": 0.25, "solve": 0.0125, "compile": 95.5, "total": 96.0}
    page = tmp_path / "plan.html"
    write_html(plan, page)
    loaded = _chromium(tmp_path, "--dump-dom", page.as_uri())
    per_us = {"ms": 1e3, "s": 1e6}
    for table, want in (("cost", unit), ("collectives", unit), ("timings", "s")):
        got, cells = _table_cells(loaded, table)
        assert got == want and cells, table
        assert re.search(rf"<th>time[^<]*\({want}\)</th>", loaded.split(f'<table id="{table}"')[1]), table
        for key, value, shown in cells:
            us = value * 1e6 if table == "timings" else value  # timings are kept in seconds
            assert shown == f"{us / per_us[want]:.3f}", (table, key, shown)
    (collectives_unit,) = re.findall(r"Collectives per step as planned[^<]*; (\w+)\)", loaded)
    assert collectives_unit == unit and f"Predicted cost per step ({unit})" in loaded


def test_compile_time_has_its_own_line(plans, tmp_path: Path) -> None:
    plan = Plan.from_json(plans["fsdp"])
    plan.timings = {"trace": 0.5, "solve": 0.125, "compile": 95.5, "total": 96.125}
    assert "solve 0.125, compile 95.500, total 96.125" in report_text(plan)
    plan.to_json(tmp_path / "plan.json")
    dom = _render(tmp_path / "plan.json", tmp_path, warn_gib=1.0)
    shown = {a["data-key"]: float(a["data-value"]) for a in dom.having("data-key")}
    assert shown["timing_compile"] == 95.5 and shown["timing_solve"] == 0.125
    assert "compile (numba compiling or loading the planner's loops; apart from the stages)" in "".join(dom.text)


def test_a_planned_step_times_its_compile_apart(plans) -> None:
    """Plans of the fixture went through plan_stages: their lines add up to the total,
    compile (this process compiled the 2-D plan's loops, or loaded them) among them."""
    timings = Plan.from_json(plans["fsdp_tp"]).timings
    assert list(timings) == ["trace", "strategies", "build", "solve", "plan", "compile", "total"]
    assert sum(v for k, v in timings.items() if k != "total") == pytest.approx(timings["total"], abs=0.01)
    assert timings["compile"] >= 0.0


# ---------------------------------------------------------------- collectives as executed, plan-only


def test_a_plan_only_run_lists_what_the_executor_would_issue() -> None:
    """On a fake process group the executor's step is traced on fake tensors: unbucketed it
    issues one collective per planned redistribution, bucketed what the executor's own
    pass leaves of them."""
    model = build_meta_model("llama3", "debugmodel", n_layers=2)
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp_shard", "tp"))
    profile = load_profile("h100")
    stages = plan_stages(model, mesh, PlannerOptions(global_batch_size=8, seq_len=128, profile=profile))
    graph = fake_step_graph(stages, mesh)
    per_tensor = executed_collectives(graph, MeshGroups.of(mesh), profile)
    planned = dict(expected_collectives(stages.plan, backend="gloo"))
    # One call per planned redistribution; DTensor runs one planned reduce-scatter of this
    # plan as an all-reduce (then keeps its slice), which only the executed list shows.
    assert sum(_per_kind(per_tensor).values()) == sum(planned.values())
    assert _per_kind(per_tensor)["all_gather"] == planned["all_gather"]
    stats = bucket_collectives(graph)  # the executor's pass
    bucketed = traced_step_collectives(stages, mesh, profile, bucket=True)
    for kind, after in stats.after.items():
        assert _per_kind(bucketed)[kind] == after < stats.before[kind]
    assert _per_kind(bucketed) == dict(graph_collectives(graph))
    assert sum(_per_kind(bucketed).values()) < sum(_per_kind(per_tensor).values())
    plan = stages.plan
    plan.executed_collectives = [c.to_dict() for c in bucketed]
    text = report_text(plan)
    assert f"collectives per step as executed, after bucketing ({sum(c.count for c in bucketed)} calls" in text


def _per_kind(found) -> dict[str, int]:
    counts: dict[str, int] = {}
    for c in found:
        counts[c.kind] = counts.get(c.kind, 0) + c.count
    return counts
