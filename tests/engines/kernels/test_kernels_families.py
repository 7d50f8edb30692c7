"""Each family's swapped modules against Hugging Face's own, and the whole model's loss and gradients with the
kernels against without (float64 tight; float32 and bfloat16 within the ops' tolerance)."""

from __future__ import annotations

import copy

import pytest
import torch
from kernels_testlib import ALL_ON, FAMILIES, OpCalls, build, ce, exact_norms, ids
from polyaccel.engines.kernels import apply_kernels, get_plan

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
#: family -> what the plan must swap (the kernels' counts) and leave alone
EXPECTED = {
    "llama": {"rms_norm": 5, "rope": 2, "swiglu": 2, "cross_entropy": 1},
    "mistral": {"rms_norm": 5, "rope": 2, "swiglu": 2, "cross_entropy": 1},
    "qwen2": {"rms_norm": 5, "rope": 2, "swiglu": 2, "cross_entropy": 1},
    "qwen3": {"rms_norm": 9, "rope": 2, "swiglu": 2, "cross_entropy": 1},  # + q_norm / k_norm per layer
    "qwen3_moe": {"rms_norm": 9, "rope": 2, "swiglu": 1, "cross_entropy": 1},  # the dense layer's MLP only
    "gemma2": {"rms_norm": 9, "rope": 2, "swiglu": 0, "cross_entropy": 0},  # GELU MLP; softcapped logits
    "phi3": {"rms_norm": 5, "rope": 2, "swiglu": 2, "cross_entropy": 1},  # fused gate_up_proj, partial rotary
}


def _inputs(module, path, model, dtype, g):
    hidden = model.config.hidden_size
    if path.endswith(("q_norm", "k_norm")):
        return (torch.randn(2, 5, 4, module.weight.shape[0], generator=g).to(dtype),), {}
    x = torch.randn(2, 7, hidden, generator=g).to(dtype)
    if "attn" not in path:
        return (x,), {}
    pos = torch.arange(7).unsqueeze(0).expand(2, -1)
    cos, sin = model.model.rotary_emb(x, position_ids=pos)
    return (), {"hidden_states": x, "position_embeddings": (cos, sin), "attention_mask": None}


def _run(module, args, kwargs, grad_seed):
    args = tuple(a.detach().requires_grad_() for a in args)
    kwargs = {k: (v.detach().requires_grad_() if k == "hidden_states" else v) for k, v in kwargs.items()}
    out = module(*args, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    g = torch.Generator().manual_seed(grad_seed)
    out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
    leaves = list(args) + [v for k, v in kwargs.items() if k == "hidden_states"]
    return out.detach(), [t.grad for t in leaves], {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_swapped_module_matches_hugging_faces(family, dtype, monkeypatch):
    ref = build(family, dtype)
    fast = copy.deepcopy(ref)
    apply_kernels(fast, ALL_ON)
    plan = get_plan(fast)
    assert {k: plan.count(k) for k in EXPECTED[family]} == EXPECTED[family], str(plan)
    calls = OpCalls(monkeypatch)
    g = torch.Generator().manual_seed(7)
    modules = dict(ref.named_modules())
    checked = 0
    for path, what in plan.swapped.items():
        if what.startswith("cross_entropy"):
            continue
        args, kwargs = _inputs(modules[path], path, ref, dtype, g)
        want = _run(modules[path], args, kwargs, checked)
        got = _run(fast.get_submodule(path), args, kwargs, checked)
        torch.testing.assert_close(got[0], want[0], **TOL[dtype], msg=lambda m, p=path: f"{p} output: {m}")
        for a, b in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m, p=path: f"{p} input grad: {m}")
        for name, grad in want[2].items():
            torch.testing.assert_close(got[2][name], grad, **TOL[dtype], msg=lambda m, p=path, n=name: f"{p}.{n}: {m}")
        checked += 1
    assert checked == sum(v for k, v in EXPECTED[family].items() if k != "cross_entropy")
    # every swapped module ran its op (and only the swapped ones: the Hugging Face copy ran none)
    attentions = [p for p, w in plan.swapped.items() if w.startswith("rope")]
    nested = sum(1 for p, w in plan.swapped.items() if w.startswith("rms_norm")
                 for a in attentions if p.startswith(a + "."))  # Qwen3's q/k norms run again inside the attention
    assert calls.counts["rms_norm"] == EXPECTED[family]["rms_norm"] + nested
    assert calls.counts["rope"] == EXPECTED[family]["rope"]
    assert calls.counts["swiglu"] == EXPECTED[family]["swiglu"]


WHOLE_TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (2e-5, 2e-4), torch.bfloat16: (3e-2, 6e-2)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_whole_models_loss_and_gradients_with_kernels_equal_without(family, dtype, monkeypatch):
    """float64: to 1e-10 against Hugging Face's model with its norms in float64 (Hugging Face's RMSNorm rounds
    through float32 whatever the input); float32 / bfloat16: against Hugging Face's model as it is."""
    ref = build(family, dtype)
    fast = copy.deepcopy(ref)
    apply_kernels(fast, ALL_ON)
    if dtype == torch.float64:
        exact_norms(ref)
    calls = OpCalls(monkeypatch)
    ref.train()
    fast.train()
    x = ids()
    out = fast(input_ids=x, labels=x)
    fused = EXPECTED[family]["cross_entropy"] == 1
    if fused:
        assert out.logits is None and calls.counts["linear_cross_entropy"] == 1
        loss = out.loss
    else:  # Gemma2's softcapped logits: Hugging Face's loss was kept
        assert out.logits is not None and calls.counts["linear_cross_entropy"] == 0
        loss = ce(out.logits, x) if dtype == torch.float64 else out.loss
    want = ce(ref(input_ids=x).logits, x) if dtype == torch.float64 else ref(input_ids=x, labels=x).loss
    loss.backward()
    want.backward()
    loss_tol, grad_tol = WHOLE_TOL[dtype]
    assert abs(loss.item() - want.item()) <= loss_tol * max(1.0, abs(want.item())), (loss.item(), want.item())
    for (name, p), q in zip(fast.named_parameters(), ref.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        err = (p.grad.double() - q.grad.double()).norm() / q.grad.double().norm().clamp_min(1e-30)
        assert err <= grad_tol, f"{family} {name}: relative gradient error {err:.3g} > {grad_tol}"
