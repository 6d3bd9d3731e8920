"""What a plan is, in words: each mesh dim's role, read from the plan's own placements and collectives.

A mesh dim's role follows from what the parameters and activations do on it:

* parameters replicated on it and their gradients all-reduced: DDP;
* parameters sharded on it and all-gathered before use, gradients
  reduce-scattered: FSDP;
* parameters sharded on it and used sharded, activations exchanged instead
  (an all-reduce of an activation is the partial sums a weight split on its
  input features leaves): TP;
* fewer weight gathers than sharded weights, or gathered weights beside
  activation all-reduces, on one dim: mixed, said so.

plan.json names no parameter in its collectives, so where a dim mixes
gathered and sharded use the words give the counts and do not guess which
weight is which. The reason given is only what the planner's problem
supports: the solver takes the placements of least predicted step time whose
parameters fit the memory budget, and a dp_replicate dim replicates every
parameter by definition.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from torchtitan_autoparallel.planner.plan.plan import Plan
from torchtitan_autoparallel.planner.trace.recompute import block_runs
from torchtitan_autoparallel.report.common import fmt_bytes, short_name, split_layer

_SHARD = re.compile(r"^S+\((\d+)")  # S(d) and strided SS(d,k): sharded on tensor dim d
_REPLICATE_DIM = "dp_replicate"  # the planner pins parameters Replicate on it (planner/strategies/placement.py)
# A dim that gathers at least this share of its sharded weights (and all-reduces no activation)
# reads as FSDP, the few it does not gather counted: LLaMA3-8B's FSDP plan uses its embedding sharded.
_MOSTLY = 0.9
# A budget used to within this fraction binds: the solver could not have placed more bytes per device.
_BINDING = 1e-6


@dataclass(frozen=True)
class DimRole:
    """One mesh dim's role in the plan, and the sentence that says so."""

    name: str
    size: int
    role: str  # DDP | FSDP | TP | FSDP and TP mixed | replicated
    sentence: str


def plan_words(plan: Plan) -> list[str]:
    """The "what this plan is" paragraph as sentences: one per mesh dim, then the reason."""
    return [r.sentence for r in dim_roles(plan)] + _recompute_words(plan) + _fit_words(plan) + [budget_reason(plan)]


def _fit_words(plan: Plan) -> list[str]:
    """Why the plan is not the cheapest one: the cheapest overflowed the device."""
    fit = plan.memory_fit
    if not fit:
        return []
    price = 100 * (plan.objective / fit["unbounded_objective"] - 1)
    head = (f"The cheapest plan would peak at {fmt_bytes(fit['unbounded_peak_bytes'])} per device, over the "
            f"{fmt_bytes(fit['usable_bytes'])} usable")
    if not fit["fits"]:
        return [f"{head}; solved again under memory rows, no plan found fits: this one peaks lowest, at "
                f"{fmt_bytes(fit['peak_bytes'])} ({price:+.1f}% step time)."]
    return [f"{head}; this one, solved under that bound, peaks at {fmt_bytes(fit['peak_bytes'])} for "
            f"{price:+.1f}% step time."]


def _recompute_words(plan: Plan) -> list[str]:
    """What the backward recomputes, and for activation_checkpoint = "auto" why."""
    mode, choice = plan.activation_checkpoint, plan.recompute_choice
    what = {"full": "each transformer block's forward", "selective": "part of each transformer block's forward"}
    if mode == "none":
        if not choice:
            return []
        how = "once resharded" if plan.memory_fit else "as it is"
        return [f"Recomputes nothing: the step's predicted peak, {fmt_bytes(plan.predicted['peak_bytes_per_device'])} "
                f"per device, fits the device {how} (activation_checkpoint auto)."]
    if plan.block_recompute:
        of = {"full": "the whole forward of", "selective": "part of the forward of", "none": "nothing of"}
        runs = (f"{of.get(m, m)} block{'s' if '-' in r else ''} {r}" for m, r in block_runs(plan.block_recompute))
        said = "Recomputes " + ", ".join(runs) + " in the backward"
    else:
        said = f"Recomputes {what.get(mode, mode)} in the backward"
    if not choice:
        return [f"{said} (activation_checkpoint.mode = {mode})."]
    if "recompute_us" in choice:
        price = 100 * (plan.objective / choice["unbounded_objective"] - 1)
        why = (f"the cheapest plan without recomputation peaks at {fmt_bytes(choice['unbounded_peak_bytes'])} per "
               "device, over the device; the solve that fits the step's peak chose this, block by block, over "
               f"resharding alone (it priced the recomputation at {choice['recompute_us'] / 1e3:.2f} ms of step time "
               f"for {fmt_bytes(choice['recompute_freed_bytes'])} freed at that peak; {price:+.1f}% step time in all)")
    else:  # the chosen plan did not fit: the fallback to full recomputation
        why = "no lighter recomputation's plan fits the device"
    return [f"{said}: {why} (activation_checkpoint auto; {len(choice['tried'])} trace(s) planned)."]


def dim_roles(plan: Plan) -> list[DimRole]:
    return [_dim_role(plan, i, name, size) for i, (name, size) in enumerate(zip(plan.mesh["names"], plan.mesh["sizes"]))]


def _dim_role(plan: Plan, index: int, name: str, size: int) -> DimRole:
    by_dim = _sharded_by_tensor_dim(plan, index)
    sharded = sum(len(v) for v in by_dim.values())
    total = len(plan.parameters)
    calls = _calls(plan, name)
    gathers, act_reduces = calls["parameter all_gather"], calls["activation all_reduce"]
    head = f"{name}={size}"
    if size == 1:
        return DimRole(name, size, "replicated", f"{head}: one rank, nothing to split.")
    if not sharded:
        role = "DDP" if calls["gradient all_reduce"] and not act_reduces else "replicated"
        why = " (dp_replicate replicates parameters by definition)" if name == _REPLICATE_DIM else ""
        text = f"every parameter replicated{why}; {_grad_words(calls)}"
        return DimRole(name, size, role, f"{role} over {head}: {text}{_act_words(calls)}.")
    split = _split_words(by_dim, sharded, total)
    if gathers >= _MOSTLY * sharded and not act_reduces:
        role, use = "FSDP", f"all-gathered before use ({_plural(gathers, 'all-gather')} of weights per step"
        use += ")" if gathers >= sharded else f", so at most {sharded - gathers} of them used sharded)"
    elif not gathers:
        role, use = "TP", "used sharded (no weight is gathered on it)"
    else:
        role = "FSDP and TP mixed"
        use = (f"{_plural(gathers, 'all-gather')} of weights per step gather at most {min(gathers, sharded)} "
               "of them before use, the others are used sharded")
        if act_reduces:
            use += f", {_plural(act_reduces, 'all-reduce')} of activations per step adding up their partial results"
    text = f"{split}, {use}; {_grad_words(calls)}{_act_words(calls, skip_reduces=role == 'FSDP and TP mixed')}"
    return DimRole(name, size, role, f"{role} over {head}: {text}.")


def _sharded_by_tensor_dim(plan: Plan, index: int) -> dict[int, list[str]]:
    """Tensor dim -> the parameters sharded on it over mesh dim ``index``."""
    out: dict[int, list[str]] = defaultdict(list)
    for fqn, placements in plan.parameters.items():
        m = _SHARD.match(placements[index])
        if m:
            out[int(m.group(1))].append(fqn)
    return dict(sorted(out.items()))


def _calls(plan: Plan, mesh_dim: str) -> dict[str, int]:
    """"purpose kind" -> collectives per step on ``mesh_dim``, as the plan prices them."""
    out: dict[str, int] = defaultdict(int)
    for c in plan.collectives:
        if c.mesh_dim == mesh_dim:
            out[f"{c.purpose} {c.kind}"] += c.count
    return out


def _split_words(by_dim: dict[int, list[str]], sharded: int, total: int) -> str:
    parts = [f"dim {d} ({_names(fqns)})" for d, fqns in by_dim.items()]
    share = f"all {total} parameters" if sharded == total else f"{sharded} of {total} parameters"
    rest = "" if sharded == total else f" ({total - sharded} replicated)"
    return f"{share} sharded{rest}, on " + ", ".join(parts)


def _names(fqns: list[str]) -> str:
    """Short names, each once: 'wo, w2, tok_embeddings'."""
    seen: dict[str, None] = {}
    for fqn in fqns:
        parts = split_layer(fqn)
        seen[short_name(parts[2]) if parts else fqn.removesuffix(".weight")] = None
    return ", ".join(seen)


_KINDS = ("reduce_scatter", "all_reduce", "all_gather", "all_to_all")


def _grad_words(calls: dict[str, int]) -> str:
    said = _kind_counts(calls, "gradient", ())
    return "gradients: " + (said + " per step" if said else "not reduced on it")


def _act_words(calls: dict[str, int], skip_reduces: bool = False) -> str:
    said = _kind_counts(calls, "activation", ("all_reduce",) if skip_reduces else ())
    return f"; activations: {said} per step" if said else ""


def _kind_counts(calls: dict[str, int], purpose: str, skip: tuple[str, ...]) -> str:
    """'13 reduce-scatters, 1 all-reduce' of one purpose's collectives on a dim."""
    counted = [(calls[f"{purpose} {k}"], k) for k in _KINDS if k not in skip and calls[f"{purpose} {k}"]]
    return ", ".join(_plural(n, k.replace("_", "-")) for n, k in counted)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def budget_reason(plan: Plan) -> str:
    """Why parameters are sharded as much as they are, as far as the problem says."""
    used = plan.predicted["param_bytes_per_device"]
    budget = plan.memory_budget_bytes
    rule = (f"The solver ({plan.solver}, {plan.status}) takes the placements of least predicted step time "
            "whose parameters fit the memory budget")
    if budget is None:
        return f"{rule}; this plan had none, so speed alone decided."
    shown = f"parameters take {fmt_bytes(used)} of the {fmt_bytes(budget)} budget per device"
    if not any(_SHARD.match(p) for ps in plan.parameters.values() for p in ps):
        return f"{rule}: {shown}; none is sharded."
    if used >= budget * (1 - _BINDING):
        return f"{rule}: {shown}, all of it, so the budget forced the sharding (less sharding would not fit)."
    return f"{rule}: {shown}, so the sharding was chosen for speed, not forced by memory."
