"""The expert ops as one autograd node each on torch._grouped_mm (the cuda plugin's default ``moe_*`` builders), with
the Triton passes under the interpreter: the unfused chain's numbers bit for bit, the conformance checks, and the
inputs that go to the unfused path."""

from __future__ import annotations

import pytest
import torch
from polyaccel.ops import reference as ref
from polyaccel.plugins.cuda.kernels import gather_sum as kgs
from polyaccel.plugins.cuda.kernels import grouped_mm as kg
from polyaccel.plugins.cuda.kernels import moe_grouped as kmg
from polyaccel.plugins.cuda.kernels import swiglu as ks
from polyaccel.testing.conformance import opcases_moe

CPU = torch.device("cpu")


def _case(T=13, k=3, E=4, H=32, F=24, tail=0, transposed=False, seed=None):
    """Token rows, a routing (every expert gets rows, ``tail`` rows past the last offset) and weights, bf16."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    N = T * k
    cuts = torch.sort(torch.randint(0, N - tail + 1, (E - 1,), generator=g))[0]
    offsets = torch.cat([cuts, torch.tensor([N - tail])])
    index = torch.randperm(N, generator=g).view(T, k)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    if transposed:  # HF's fused layout: parameters [E, 2F, H] and [E, H, F], viewed in grouped_mm's orientation
        w1 = (torch.randn(E, 2 * F, H, generator=g) / 4).to(torch.bfloat16).transpose(1, 2)
        w2 = (torch.randn(E, H, F, generator=g) / 4).to(torch.bfloat16).transpose(1, 2)
    else:
        w1 = (torch.randn(E, H, 2 * F, generator=g) / 4).to(torch.bfloat16)
        w2 = (torch.randn(E, F, H, generator=g) / 4).to(torch.bfloat16)
    weights = torch.rand(T, k, generator=g)
    return x, index, offsets, w1, w2, weights


class _Dispatch(torch.autograd.Function):
    """AutoEP's dispatch (``DispatchRows``) on the cuda plugin: a gather, its backward the gather-sum kernel."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        return x.index_select(0, ref.moe_experts.routed_tokens(index))

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return kgs.gather_sum_forward(grad.contiguous(), index, None), None


def _chain(x, index, offsets, w1, w2, weights):
    """The unfused chain on the same kernels: the dispatch, torch._grouped_mm, Triton SwiGLU, gather-sum."""
    routed = _Dispatch.apply(x, index)
    gate, up = kg.torch_grouped_mm(routed, w1, offsets).chunk(2, dim=-1)
    return kgs.gather_sum(kg.torch_grouped_mm(ks.swiglu(gate, up), w2, offsets), index, weights)


def _composed(x, index, offsets, w1, w2, weights):
    return kmg.moe_down_combine(kmg.moe_gate_up(x, index, w1, offsets), w2, offsets, index, weights)


def _step(fn, leaves, args, grad):
    leaves = [t.detach().requires_grad_(True) for t in leaves]
    out = fn(*args(*leaves))
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("tail,transposed", [(0, False), (5, True)])
def test_numbers_are_the_unfused_chains_bit_for_bit(tail, transposed):
    x, index, offsets, w1, w2, weights = _case(tail=tail, transposed=transposed)
    grad = torch.randn(x.shape[0], x.shape[1]).to(torch.bfloat16)
    leaves = [x, w1, w2, weights]

    def args(x, w1, w2, weights):
        return x, index, offsets, w1, w2, weights

    out, grads = _step(_composed, leaves, args, grad)
    want, want_grads = _step(_chain, leaves, args, grad)
    assert torch.equal(out, want)
    for name, got, exp in zip(("x", "w1", "w2", "weights"), grads, want_grads, strict=True):
        assert got.dtype == exp.dtype and torch.equal(got, exp), name
    assert grads[1].stride() == w1.stride(), "w1's gradient in the parameter's layout"
    # and the op's meaning, against float64
    want64 = ref.moe_down_combine(ref.moe_gate_up(x.double(), index, w1.double(), offsets), w2.double(), offsets,
                                  index, weights.double())
    assert float((out.double() - want64).abs().max()) <= 0.03 * float(want64.abs().max())


def test_rows_past_the_last_offset_are_zero_and_reach_no_gradient():
    x, index, offsets, w1, _, _ = _case(tail=7)
    x.requires_grad_(True)
    h = kmg.moe_gate_up(x, index, w1, offsets)
    N = index.numel()
    assert bool((h[N - 7:] == 0).all())
    grad = torch.zeros_like(h)
    grad[N - 7:] = 1.0  # only the rows past the end: nothing flows back
    h.backward(grad)
    assert bool((x.grad == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_conformance_checks(dtype):
    torch.manual_seed(11)
    opcases_moe.check_moe_gate_up(kmg.moe_gate_up, CPU, dtype)
    opcases_moe.check_moe_down_combine(kmg.moe_down_combine, CPU, dtype)


def test_what_torch_grouped_mm_does_not_take_runs_the_unfused_ops(monkeypatch):
    calls = []
    for cls in (kmg._GateUp, kmg._DownCombine):
        real = cls.apply
        monkeypatch.setattr(cls, "apply", lambda *a, real=real, cls=cls: calls.append(cls.__name__) or real(*a))
    x, index, offsets, w1, w2, weights = _case(seed=3)
    _composed(x, index, offsets, w1, w2, weights)
    assert calls == ["_GateUp", "_DownCombine"]
    calls.clear()
    _composed(x.float(), index, offsets, w1.float(), w2.float(), weights)  # fp32: not torch._grouped_mm's
    x2, index2, offsets2, w1b, w2b, weights2 = _case(H=30, seed=4)  # H not a multiple of 8
    out = _composed(x2, index2, offsets2, w1b, w2b, weights2)
    assert calls == []
    want = ref.moe_down_combine(ref.moe_gate_up(x2.double(), index2, w1b.double(), offsets2), w2b.double(),
                                offsets2, index2, weights2.double())
    assert float((out.double() - want).abs().max()) <= 0.03 * float(want.abs().max())


def test_a_second_backward_through_one_forward_is_refused_by_name():
    x, index, offsets, w1, _, _ = _case(seed=5)
    x.requires_grad_(True)
    h = kmg.moe_gate_up(x, index, w1, offsets)
    h.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="moe_gate_up .*retain_graph"):
        h.sum().backward()


def test_autoep_runs_its_experts_through_them_where_they_are_chosen():
    """A bf16 Mixtral layer under AutoEP with these builders serving the cpu device: the fused path is taken, each op
    once a step, and the output and gradients agree with the cpu plugin's reference path."""
    import copy

    import polyaccel
    from polyaccel import selection
    from polyaccel.engines.autoep import apply_autoep, moe
    from polyaccel.hookspecs import hookimpl
    from transformers import MixtralConfig, MixtralForCausalLM

    calls = []

    def counted(fn):
        return lambda *a: calls.append(fn.__name__) or fn(*a)

    class TorchMoeOnCpu:
        POLYACCEL_API_VERSION = "1.0"

        @hookimpl
        def polyaccel_register_ops(self, registry):
            for op in ("moe_gate_up", "moe_down_combine"):
                registry.register(op, f"cpu_torch_{op}", ("cpu",), lambda fn=getattr(kmg, op): counted(fn),
                                  priority=99)

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=61, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    plain = MixtralForCausalLM(cfg).to(torch.bfloat16)
    apply_autoep(plain, {})
    ours = copy.deepcopy(plain)
    ids = torch.randint(0, 61, (2, 9))
    out = plain(input_ids=ids).logits
    out.float().sum().backward()
    want = out.detach()
    selection.reset()  # (discovery ran for the reference path; the next one finds the plugin)
    polyaccel.register_plugin("torch_moe_on_cpu", TorchMoeOnCpu())
    out = ours(input_ids=ids).logits
    out.float().sum().backward()
    got = out.detach()
    layer = next(m for m in ours.modules() if isinstance(m, moe.AutoEPMoE))
    assert layer._uses_fused(ids) and calls == ["moe_gate_up", "moe_down_combine"]
    assert float((got.float() - want.float()).abs().max()) <= 0.05 * float(want.float().abs().max())
    grads = dict(plain.named_parameters())
    for name, p in ours.named_parameters():
        ref_grad = grads[name].grad.float()
        assert float((p.grad.float() - ref_grad).abs().max()) <= 0.05 * float(ref_grad.abs().max()) + 1e-3, name


def test_marked_offsets_are_prepared_once_for_the_two_ops_and_again_after_any_change():
    """``prepared_offsets`` keeps what it made only for offsets marked valid by construction, and only while they stay
    the marked ones for the same rows, unchanged: a change of values, rows, dtype or tensor is read and checked."""
    from polyaccel.errors import OpArgumentError
    from polyaccel.ops import offsets as known_offsets

    x, index, offsets, w1, w2, weights = _case(seed=6)
    N = index.numel()
    known_offsets.mark_complete(offsets, N)
    first = kmg.prepared_offsets(offsets, N)
    assert first[1] == N and torch.equal(first[2], offsets.to(torch.int32))
    assert kmg.prepared_offsets(offsets, N)[2] is first[2]  # the layer's second op: kept
    assert kmg.prepared_offsets(offsets, N + 1)[2] is not first[2]  # other rows: read and checked (valid there too)
    offsets[0] = N + 1  # decreasing now: a change in place (it bumps the version counter)
    with pytest.raises(OpArgumentError, match="non-decreasing"):
        kmg.prepared_offsets(offsets, N)
    # offsets never marked are checked at every call, even after a write no version counter sees
    plain = torch.tensor([2, 5, N], dtype=torch.int64)
    assert kmg.prepared_offsets(plain, N)[1] == N
    plain.numpy()[0] = 7
    with pytest.raises(OpArgumentError, match="non-decreasing"):
        kmg.prepared_offsets(plain, N)
    # marked int32 offsets: converted (not the marked tensor), so checked and converted at every call
    off32 = torch.tensor([2, 5, N], dtype=torch.int32)
    known_offsets.mark_complete(off32, N)
    a, b = kmg.prepared_offsets(off32, N), kmg.prepared_offsets(off32, N)
    assert a[2] is not b[2] and torch.equal(a[0], off32.long())


def test_marked_offsets_of_layers_of_other_shapes_give_the_unfused_chains_numbers():
    """AutoEP's use: each layer marks its end rows, then runs the two ops (the second taking the prepared offsets);
    layers of other shapes (experts, rows, widths), one after another, each get the unfused chain's numbers bit for
    bit, forward and backward."""
    from polyaccel.ops import offsets as known_offsets

    sizes = [dict(T=13, k=3, E=4, H=32, F=24), dict(T=9, k=2, E=3, H=16, F=8)]
    for seed, size in enumerate([*sizes, sizes[0]]):
        x, index, offsets, w1, w2, weights = _case(seed=20 + seed, **size)
        grad = torch.randn(size["T"], size["H"]).to(torch.bfloat16)
        args = lambda *t, i=index, o=offsets: (t[0], i, o, *t[1:])  # noqa: E731
        want = _step(_chain, [x, w1, w2, weights], args, grad)
        known_offsets.mark_complete(offsets, index.numel())
        got = _step(_composed, [x, w1, w2, weights], args, grad)
        assert torch.equal(got[0], want[0])
        for g, w in zip(got[1], want[1], strict=True):
            assert torch.equal(g, w)


def test_bad_arguments_are_refused_by_the_op_before_these_builders_run():
    """The builders take their arguments as checked (the op checks every call once, before any builder runs): a bad
    call through ``polyaccel.ops`` with them chosen is refused and never reaches them."""
    import polyaccel
    from polyaccel import ops
    from polyaccel.errors import OpArgumentError
    from polyaccel.hookspecs import hookimpl

    calls = []

    class TorchMoeOnCpu:
        POLYACCEL_API_VERSION = "1.0"

        @hookimpl
        def polyaccel_register_ops(self, registry):
            for op in ("moe_gate_up", "moe_down_combine"):
                registry.register(op, f"cpu_torch_{op}", ("cpu",),
                                  lambda fn=getattr(kmg, op): lambda *a: calls.append(fn.__name__) or fn(*a),
                                  priority=99)

    polyaccel.register_plugin("torch_moe_on_cpu", TorchMoeOnCpu())
    x, index, offsets, w1, w2, weights = _case(seed=8)
    h = ops.moe_gate_up(x, index, w1, offsets)
    ops.moe_down_combine(h, w2, offsets, index, weights)
    assert calls == ["moe_gate_up", "moe_down_combine"]
    calls.clear()
    bad = [(lambda: ops.moe_gate_up(x, index.view(-1), w1, offsets), "index must be"),
           (lambda: ops.moe_gate_up(x, index, w1[:, :, :7], offsets), "must be even"),
           (lambda: ops.moe_gate_up(x, index, w1[:, :5], offsets), "features"),
           (lambda: ops.moe_gate_up(x, index, w1, offsets[:2]), "one entry per expert"),
           (lambda: ops.moe_gate_up(x, index, w1.float(), offsets), "weight is torch.float32"),
           (lambda: ops.moe_gate_up(x, index, w1, offsets.float()), "int32 or int64"),
           (lambda: ops.moe_down_combine(h[:-1], w2, offsets, index, weights), "tokens \\* k == rows"),
           (lambda: ops.moe_down_combine(h, w2[:, :3], offsets, index, weights), "features"),
           (lambda: ops.moe_down_combine(h, w2, offsets, index, weights[:, :1]), "shaped like index")]
    for call, message in bad:
        with pytest.raises(OpArgumentError, match=message):
            call()
    assert calls == []
