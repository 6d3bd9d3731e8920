"""The joint forward+backward trace: roles of placeholders and outputs."""

from __future__ import annotations

import pytest
import torch

from torchtitan_autoparallel.models.registry import build_meta_model
from torchtitan_autoparallel.planner.trace.trace import TracedStep, trace_training_step

aten = torch.ops.aten


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return build_meta_model("llama3", "debugmodel")


@pytest.fixture(scope="module")
def traced(llama) -> TracedStep:
    return trace_training_step(llama, 4, 64)


def _targets(traced: TracedStep) -> set:
    return {n.target for n in traced.graph.graph.nodes if n.op == "call_function"}


def test_every_parameter_has_a_gradient_output(llama, traced):
    names = [n for n, _ in llama.named_parameters()]
    assert list(traced.params) == names
    assert list(traced.grads) == names
    for fqn, grad in traced.grads.items():
        param = traced.params[fqn]
        assert grad.op == "call_function"
        assert tuple(grad.meta["val"].shape) == tuple(param.meta["val"].shape), fqn
        assert grad.meta["val"].dtype == param.meta["val"].dtype


def test_loss_is_the_scalar_cross_entropy(traced):
    loss = traced.loss
    assert loss.meta["val"].shape == ()
    assert loss.meta["val"].dtype == torch.float32
    # getitem 0 of nll_loss_forward, as F.cross_entropy decomposes
    assert loss.args[0].target is aten.nll_loss_forward.default


def test_inputs_and_buffers_are_identified(llama, traced):
    assert tuple(traced.tokens.meta["val"].shape) == (4, 64)
    assert traced.tokens.meta["val"].dtype == torch.long
    assert tuple(traced.labels.meta["val"].shape) == (4, 64)
    assert list(traced.buffers) == [n for n, _ in llama.named_buffers()]


def test_graph_keeps_matmuls_and_cpu_flash_attention(traced):
    targets = _targets(traced)
    assert aten.mm.default in targets
    assert aten._scaled_dot_product_flash_attention_for_cpu.default in targets
    assert aten._scaled_dot_product_flash_attention_for_cpu_backward.default in targets
    assert aten.embedding.default in targets


def test_no_inplace_or_alias_ops_remain(traced):
    for n in traced.graph.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            assert not n.target._schema.is_mutable, n.target
            assert n.target is not aten.alias.default


def test_mixed_precision_casts_params_down_and_grads_up(llama):
    traced = trace_training_step(llama, 2, 32, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert set(traced.grad_casts) == set(traced.params)
    for fqn, cast in traced.grad_casts.items():
        assert cast.target is aten._to_copy.default
        assert cast.meta["val"].dtype == torch.float32
        assert cast.args[0].meta["val"].dtype == torch.bfloat16
    # every master weight is cast down before use
    for param in traced.params.values():
        users = list(param.users)
        assert users and all(u.target is aten._to_copy.default for u in users)
        assert all(u.meta["val"].dtype == torch.bfloat16 for u in users)


def test_mixed_precision_casts_each_gradient_up_as_its_layer_backward_ends():
    # Casts made before the forward would put every gradient's cast (and so, on a plan
    # that reduces in fp32, its reduction) after the whole backward, every layer's
    # unreduced gradient live at once. Made as each module starts, the last layer's
    # gradients are cast up before the first layer's gradients exist.
    model = build_meta_model("llama3", "debugmodel", n_layers=2)
    traced = trace_training_step(model, 2, 32, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    at = {n: i for i, n in enumerate(traced.graph.graph.nodes)}
    last_layer_casts = [at[c] for f, c in traced.grad_casts.items() if f.startswith("layers.1.")]
    first_layer_grads = [at[c.args[0]] for f, c in traced.grad_casts.items() if f.startswith("layers.0.")]
    assert last_layer_casts and first_layer_grads
    assert max(last_layer_casts) < min(first_layer_grads)


def test_mixed_precision_casts_a_tied_weight_once():
    qwen = build_meta_model("qwen3", "debugmodel", n_layers=1)  # embedding tied to the output
    traced = trace_training_step(qwen, 2, 32, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    tied = traced.params["tok_embeddings.weight"]
    assert [u.target for u in tied.users] == [aten._to_copy.default]
    assert len(list(tied.users)[0].users) == 2  # the embedding and the output projection


def test_a_large_model_traces_without_memory():
    model = build_meta_model("llama3", "8B", n_layers=1)
    traced = trace_training_step(model, 1, 256)
    emb = traced.params["tok_embeddings.weight"].meta["val"]
    assert tuple(emb.shape) == (128256, 4096)
