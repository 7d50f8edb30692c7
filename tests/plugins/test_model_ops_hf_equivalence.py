"""rms_norm and rope against Hugging Face's own modules (LlamaRMSNorm, Gemma2RMSNorm's (1 + w) form,
apply_rotary_pos_emb with LlamaRotaryEmbedding's tables), forward and gradients, fp32 and bf16, for every
builder: the reference, cpu's torch builder, the cuda plugin's Triton kernels (interpreter) and npu's
vendor ops (emulated)."""

from __future__ import annotations

import pytest
import torch
from polyaccel import ops
from polyaccel.ops import reference as ref
from polyaccel.testing.emulation import emulate
from polyaccel.testing.numerics import assert_close_to_reference
from transformers import LlamaConfig
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

BUILDERS = ["reference", "cpu", "triton", "npu"]


def _builder(name: str, op: str):
    if name == "reference":
        return getattr(ref, op)
    if name == "cpu":
        return ops.resolve(op, "cpu")
    if name == "triton":
        from polyaccel.plugins.cuda.kernels import rms_norm, rope

        return {"rms_norm": rms_norm.rms_norm, "rope": rope.rope}[op]
    return ops.resolve(op, "npu")


@pytest.fixture(params=BUILDERS)
def builder(request):
    if request.param == "npu":
        with emulate("npu"):
            yield request.param
    else:
        yield request.param


def _close(got, want, dtype, what):
    # bf16: Hugging Face rounds the normalized value before the weight (Llama) or runs the rotation in bf16;
    # the ops round once from fp32. One bound for both: the bf16 tolerance of the suite.
    assert_close_to_reference(got, want.detach(), dtype, what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_rms_norm_equals_hugging_faces_module(builder, dtype, family):
    fn = _builder(builder, "rms_norm")
    H = 64
    gen = torch.Generator().manual_seed(7)
    module = LlamaRMSNorm(H, eps=1e-5) if family == "llama" else Gemma2RMSNorm(H, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(torch.randn(H, generator=gen) * (0.1 if family == "gemma2" else 1.0))
    module = module.to(dtype)
    eps = module.variance_epsilon if family == "llama" else module.eps
    offset = 1.0 if family == "gemma2" else 0.0
    x = (torch.randn(2, 5, H, generator=gen) * 2).to(dtype).requires_grad_()
    go = torch.randn(2, 5, H, generator=gen).to(dtype)
    want = module(x)
    want.backward(go)
    want_dx, want_dw = x.grad.clone(), module.weight.grad.clone()
    x.grad = None
    w = module.weight.detach().clone().requires_grad_()
    got = fn(x, w, eps, offset=offset)
    got.backward(go)
    assert got.dtype == want.dtype
    _close(got, want, dtype, f"{builder} {family} forward")
    _close(x.grad, want_dx, dtype, f"{builder} {family} dx")
    # a sum over all rows: bounded by the bf16 tolerance times the sum of magnitudes
    mag = (go.double().abs() * ref.rms_norm(x.detach().double(), None, eps).abs()).reshape(-1, H).sum(0)
    err = (w.grad.double() - want_dw.double()).abs()
    rtol = 1e-5 if dtype == torch.float32 else 1.6e-2
    assert bool((err <= 1e-6 + rtol * mag).all()), f"{builder} {family} dw: max error {float(err.max()):.3e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_hugging_faces_apply_rotary_pos_emb(builder, dtype):
    fn = _builder(builder, "rope")
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    B, S, D = 2, 6, 16
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, S, 64, generator=gen).to(dtype)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(S).expand(B, S))
    assert cos.shape == (B, S, D) and cos.dtype == dtype
    q = torch.randn(B, S, 4, D, generator=gen).to(dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(B, S, 2, D, generator=gen).to(dtype).transpose(1, 2).requires_grad_()
    gq, gk = torch.randn(q.shape, generator=gen).to(dtype), torch.randn(k.shape, generator=gen).to(dtype)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    torch.autograd.backward([want_q, want_k], [gq, gk])
    want_dq, want_dk = q.grad.clone(), k.grad.clone()
    q.grad = k.grad = None
    got_q, got_k = fn(q, k, cos, sin)
    torch.autograd.backward([got_q, got_k], [gq, gk])
    for name, got, want in (("q_out", got_q, want_q), ("k_out", got_k, want_k), ("dq", q.grad, want_dq),
                            ("dk", k.grad, want_dk)):
        _close(got, want, dtype, f"{builder} {name}")
