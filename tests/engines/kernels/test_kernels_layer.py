"""The kernels layer's config, plan, refusals and the Hugging Face loss arguments it honours."""

from __future__ import annotations

import copy

import polyaccel
import pytest
import torch
import torch.nn.functional as F
from kernels_testlib import ALL_ON, OpCalls, build, ce, exact_norms, ids
from polyaccel.engines.kernels import apply_kernels, get_plan, parse
from torch import nn


# ------------------------------------------------------------------------------------------------ config
def test_config_forms_and_refusals_name_the_key():
    assert parse("auto").wanted() == dict.fromkeys(ALL_ON, "auto")
    assert parse(True).wanted() == ALL_ON and not any(parse(False).wanted().values())
    assert parse({"rope": True}).wanted() == {"rms_norm": False, "rope": True, "swiglu": False, "cross_entropy": False}
    with pytest.raises(polyaccel.ConfigError,
                       match=r"unknown config key 'kernels.rmsnorm'; .*did you mean 'rms_norm'"):
        parse({"rmsnorm": True})
    with pytest.raises(polyaccel.ConfigError,
                       match=r"kernels.swiglu' must be one of true, false, auto, got 'yes'"):
        parse({"swiglu": "yes"})
    with pytest.raises(polyaccel.ConfigError, match=r"config key 'kernels' must be a dict of kernels .* got 'fast'"):
        parse("fast")


def test_initialize_refuses_a_bad_section_before_touching_the_model():
    from polyaccel.engine_entry import layer_mesh_sizes

    section = {"rms_norm": True, "flash": True}
    config = {"kernels": section, "zero_optimization": {"stage": 1}}
    model = build("llama")
    with pytest.raises(polyaccel.ConfigError, match="unknown config key 'kernels.flash'"):
        polyaccel.initialize(model, config)
    assert config["kernels"] is section and section == {"rms_norm": True, "flash": True}
    assert not any(hasattr(m, "_polyaccel_kernel") for m in model.modules())
    assert layer_mesh_sizes({"kernels": "auto"}) == {}  # the shorthand is expanded by the layer; no mesh dimension


def test_auto_turns_on_what_a_plugin_serves_on_the_device_type():
    from polyaccel import ops

    model = apply_kernels(build("llama"), "auto")
    plan = get_plan(model)
    for kernel, op in (("rms_norm", "rms_norm"), ("rope", "rope"), ("swiglu", "swiglu"),
                       ("cross_entropy", "linear_cross_entropy")):
        builder = ops.registry.chosen(op, "cpu")
        assert plan.kernels[kernel] == (builder.kind != "reference"), plan.why[kernel]
        if plan.kernels[kernel]:
            assert f"runs {builder.name} ({builder.plugin})" in plan.why[kernel] and plan.count(kernel) > 0
        else:
            assert "only the core's reference" in plan.why[kernel] and plan.count(kernel) == 0
    assert "kernels:" in str(plan) and get_plan(model) is polyaccel.parallel.get_plan(model, "kernels")


# ------------------------------------------------------------------------------------------------ plan
class _NotRMS(nn.Module):
    """One weight and an epsilon, but a bias-free LayerNorm (mean subtracted): not RMSNorm."""

    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.weight, None, self.variance_epsilon)


class _HardEpsRMSNorm(nn.Module):
    """RMSNorm that ignores its own epsilon attribute (uses 1e-2): the probe's small rows tell."""

    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-2) * self.weight


def test_unrecognised_modules_are_left_alone_and_listed_with_why():
    model = build("gemma2")
    model.model.layers[0].post_feedforward_layernorm = _NotRMS(32).double()
    model.model.layers[1].post_feedforward_layernorm = _HardEpsRMSNorm(32).double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    apply_kernels(model, ALL_ON)
    plan = get_plan(model)
    assert "not x * rsqrt(mean(x^2) + eps)" in plan.left["model.layers.0.post_feedforward_layernorm"]
    assert "not x * rsqrt(mean(x^2) + eps)" in plan.left["model.layers.1.post_feedforward_layernorm"]
    assert "activation GELUTanh" in plan.left["model.layers.0.mlp"]
    assert plan.left[""].startswith("final_logit_softcapping=30.0")
    assert plan.swapped["model.norm"] == "rms_norm (1 + w)" and plan.count("rms_norm") == 7
    assert any("Embedding" in cls for cls in plan.untouched)  # modules of no kernel: counted by class
    # parameter names, state-dict keys and values unchanged: checkpoints stay Hugging Face's
    assert [n for n, _ in model.named_parameters()] == names
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    # applied again: nothing is wrapped twice
    apply_kernels(model, ALL_ON)
    again = get_plan(model)
    assert not again.swapped and again.left["model.norm"] == "already runs the rms_norm kernel"


def test_gemma2_without_softcapping_gets_the_fused_loss():
    ref = build("gemma2", final_logit_softcapping=None)
    _assert_fused_loss_matches(copy.deepcopy(ref), ref)


def _assert_fused_loss_matches(model, ref):
    """``model`` with every kernel on swaps its loss, and its loss equals ``ref``'s logits' cross-entropy."""
    fast = apply_kernels(model, ALL_ON)
    assert get_plan(fast).swapped[""] == "cross_entropy"
    x = ids()
    fast.train()
    loss = fast(input_ids=x, labels=x).loss
    want = ce(exact_norms(ref)(input_ids=x).logits, x)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)


def test_a_norm_whose_weight_has_another_dtype_keeps_hugging_faces_forward(monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(8)
    norm.weight.data.normal_()
    model = nn.Sequential(norm)
    apply_kernels(model, {"rms_norm": True})
    calls = OpCalls(monkeypatch)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    y = norm(x)
    assert y.dtype == torch.float32 and calls.counts["rms_norm"] == 0  # HF's promotion kept
    assert torch.equal(y, LlamaRMSNorm.forward(norm, x))
    norm(x.float())
    assert calls.counts["rms_norm"] == 1


# ------------------------------------------------------------------------------------------------ loss arguments
def test_the_loss_honours_shift_labels_num_items_ignore_index_and_return_dict():
    ref, fast = build("llama"), None
    fast = apply_kernels(copy.deepcopy(ref), ALL_ON)
    exact_norms(ref)
    fast.train()
    x = ids()
    labels = x.clone()
    labels[0, :4] = -100
    logits = ref(input_ids=x).logits
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
    per_token = F.cross_entropy(flat, labels[:, 1:].reshape(-1), reduction="none", ignore_index=-100)
    # labels shifted inside, ignored tokens left out of the mean
    got = fast(input_ids=x, labels=labels).loss
    assert got.item() == pytest.approx((per_token.sum() / (labels[:, 1:] != -100).sum()).item(), rel=1e-12)
    # Hugging Face's Trainer: the sum over a global token count
    got = fast(input_ids=x, labels=labels, num_items_in_batch=torch.tensor(40)).loss
    assert got.item() == pytest.approx(per_token.sum().item() / 40, rel=1e-12)
    # labels already shifted (sequence parallelism) and another ignore_index
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    shifted = shifted.masked_fill(shifted == -100, -1)
    got = fast(input_ids=x, shift_labels=shifted, ignore_index=-1).loss
    per_all = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), reduction="none",
                              ignore_index=-1)
    assert got.item() == pytest.approx((per_all.sum() / (shifted != -1).sum()).item(), rel=1e-12)
    # return_dict=False: Hugging Face's tuple, the loss first
    tup = fast(input_ids=x, labels=labels, return_dict=False)
    assert isinstance(tup, tuple) and tup[0].dim() == 0
    # evaluation keeps Hugging Face's forward: logits and its own loss
    fast.eval()
    out = fast(input_ids=x, labels=labels)
    assert out.logits is not None and out.loss.item() == pytest.approx(ref(input_ids=x, labels=labels).loss.item(),
                                                                       rel=1e-6)


def test_a_moe_models_router_loss_is_added_as_its_forward_would():
    ref = build("qwen3_moe", output_router_logits=True)
    fast = apply_kernels(copy.deepcopy(ref), ALL_ON)
    exact_norms(ref)
    fast.train()
    x = ids()
    out = fast(input_ids=x, labels=x)
    want = ref(input_ids=x)
    expected = ce(want.logits, x) + ref.router_aux_loss_coef * want.aux_loss
    assert out.aux_loss is not None and out.loss.item() == pytest.approx(expected.item(), rel=1e-12)


# ------------------------------------------------------------------------------------------------ torch.compile
def test_a_swapped_decoder_layer_compiles_and_matches_hugging_faces():
    ref = build("llama", torch.float32)
    fast = apply_kernels(copy.deepcopy(ref), ALL_ON)
    compiled = torch.compile(fast.model.layers[0], backend="aot_eager")
    x = torch.randn(2, 7, 32)
    pos = torch.arange(7).unsqueeze(0).expand(2, -1)
    pe = ref.model.rotary_emb(x, position_ids=pos)
    outs = []
    for layer in (compiled, ref.model.layers[0]):
        xi = x.clone().requires_grad_()
        y = layer(xi, attention_mask=None, position_embeddings=pe, position_ids=pos)
        y.square().sum().backward()
        outs.append((y.detach(), xi.grad, [p.grad for p in layer.parameters()]))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-4, atol=1e-5)
    for a, b in zip(outs[0][2], outs[1][2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_model_without_kernels_keeps_hugging_faces_rotary_in_the_same_process(monkeypatch):
    """The modeling file's apply_rotary_pos_emb now dispatches; outside a swapped attention it is the original."""
    from transformers.models.llama import modeling_llama

    swapped = apply_kernels(build("llama"), {"rope": True})
    plain = build("llama", seed=1)
    assert "transformers.models.llama.modeling_llama" in get_plan(swapped).rotary_modules
    assert modeling_llama.apply_rotary_pos_emb.__wrapped__ is not None
    calls = OpCalls(monkeypatch)
    x = ids()
    plain(input_ids=x)
    assert calls.counts["rope"] == 0
    swapped(input_ids=x)
    assert calls.counts["rope"] == 2


def test_only_a_layer_that_expands_shorthands_takes_one():
    from polyaccel.engine_entry import layer_mesh_sizes

    with pytest.raises(polyaccel.ConfigError, match="config key 'tensor_parallel' must be a dict, got str"):
        layer_mesh_sizes({"tensor_parallel": "auto"})
    assert layer_mesh_sizes({"kernels": True}) == {} and layer_mesh_sizes({"kernels": False}) == {}
    with pytest.raises(polyaccel.ConfigError, match="a plan is recorded under one of"):
        polyaccel.parallel.set_plan(nn.Linear(1, 1), "kernel", object())


def test_a_transformers_4_style_forward_gets_the_fused_loss():
    """transformers 4.x wrote the same forward with ``slice(-logits_to_keep, None)`` and ``past_key_values``."""
    from transformers import LlamaForCausalLM
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class OldStyleLlama(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
            outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
            hidden_states = outputs.last_hidden_state
            slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(hidden_states[:, slice_indices, :])
            loss = None
            if labels is not None:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                          attentions=outputs.attentions)

    ref = build("llama")
    old = OldStyleLlama(ref.config).to(next(ref.parameters()).dtype)
    old.load_state_dict(ref.state_dict())
    _assert_fused_loss_matches(old, ref)
