"""FusedAdam/FusedLion/FusedLamb on the cpu plugin against torch and the reference."""

import copy

import polyaccel
import pytest
import torch
from polyaccel.ops import reference as ref
from polyaccel.optim import FusedAdam, FusedLamb, FusedLion

SHAPES = [(17, 3), (0,), (129,), (4, 5, 6), (1,), (0, 4)]


def make_params(dtype=torch.float32):
    return [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in SHAPES]


def run_steps(opts_and_params, steps=20, no_grad_index=None):
    for _ in range(steps):
        grads = [torch.randn(s) for s in SHAPES]
        for params, opt in opts_and_params:
            for i, (p, g) in enumerate(zip(params, grads, strict=True)):
                p.grad = None if i == no_grad_index else g.to(p.dtype).clone()
            opt.step()


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_adam_matches_torch(adam_w_mode, dtype):
    ours, theirs = make_params(dtype), None
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    run_steps([(ours, FusedAdam(ours, adam_w_mode=adam_w_mode, **kw)), (theirs, torch_cls(theirs, **kw))],
              no_grad_index=4)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert polyaccel.ops.registry.chosen("fused_adam", "cpu").name == "cpu_fused_adam"


@pytest.mark.parametrize("opt_cls,ref_fn,kw,states", [
    (FusedAdam, ref.fused_adam, dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05,
                                     bias_correction=False), ("exp_avg", "exp_avg_sq")),
    (FusedLion, ref.fused_lion, dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1), ("exp_avg",)),
    (FusedLamb, ref.fused_lamb, dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01),
     ("exp_avg", "exp_avg_sq")),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fused_optimizers_match_reference(opt_cls, ref_fn, kw, states, dtype):
    ours = make_params(dtype)
    ref_p = [p.detach().clone() for p in ours]
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    ref_s = [[torch.zeros_like(p, dtype=sdt) for p in ref_p] for _ in states]
    opt = opt_cls(ours, **kw)
    b1, b2 = kw["betas"]
    extra = {k: v for k, v in kw.items() if k not in ("lr", "betas", "weight_decay")}
    for step in range(1, 21):
        grads = [torch.randn(s).to(dtype) for s in SHAPES]
        for p, g in zip(ours, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        args = dict(lr=kw["lr"], beta1=b1, beta2=b2, weight_decay=kw["weight_decay"], **extra)
        if ref_fn is not ref.fused_lion:
            args["step"] = step
        ref_fn(ref_p, grads, *ref_s, **args)
    tol = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-12),
           torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}[dtype]
    for a, b in zip(ours, ref_p, strict=True):
        torch.testing.assert_close(a.detach(), b, **tol)
    for name, lst in zip(states, ref_s, strict=True):
        for p, s in zip(ours, lst, strict=True):
            assert opt.state[p][name].dtype == sdt
            if dtype != torch.bfloat16:
                torch.testing.assert_close(opt.state[p][name], s, **tol)


def test_state_dict_round_trip_continues_identically():
    a = make_params()
    opt_a = FusedAdam(a, lr=1e-2, weight_decay=0.01)
    run_steps([(a, opt_a)], steps=3)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = FusedAdam(b, lr=1.0)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    assert opt_b.param_groups[0]["lr"] == 1e-2
    run_steps([(a, opt_a), (b, opt_b)], steps=3)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_params_without_grads_are_untouched_and_get_no_state():
    ps = make_params()
    before = ps[2].detach().clone()
    opt = FusedLion(ps, lr=1e-2)
    run_steps([(ps, opt)], steps=2, no_grad_index=2)
    assert torch.equal(ps[2].detach(), before)
    assert ps[2] not in opt.state


def test_invalid_hyperparameters_are_rejected():
    p = make_params()
    with pytest.raises(ValueError, match="learning rate"):
        FusedAdam(p, lr=-1)
    with pytest.raises(ValueError, match="betas"):
        FusedLion(p, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="trust-ratio"):
        FusedLamb(p, min_coeff=2.0, max_coeff=1.0)


@pytest.mark.parametrize("opt_cls", [FusedAdam, FusedLamb])
def test_capturable_passes_the_device_step_tensor_and_matches(opt_cls):
    """capturable=True hands the op the step as a tensor (what a captured graph needs), same results."""
    import polyaccel
    from polyaccel.hookspecs import hookimpl

    seen = []

    class Recorder:
        POLYACCEL_API_VERSION = "1.0"

        @hookimpl
        def polyaccel_register_ops(self, registry):
            op = "fused_adam" if opt_cls is FusedAdam else "fused_lamb"
            fn = getattr(ref, op)

            def recording(*lists, step, **kw):
                seen.append((isinstance(step, torch.Tensor), float(step)))
                return fn(*lists, step=step, **kw)

            registry.register(op, "recording", ("cpu",), lambda: recording, priority=99)

    polyaccel.register_plugin("recorder", Recorder())
    a, b = make_params(), None
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    run_steps([(a, opt_cls(a, lr=1e-2, weight_decay=0.01, capturable=True)),
               (b, opt_cls(b, lr=1e-2, weight_decay=0.01))], steps=5)
    assert [v for is_tensor, v in seen if is_tensor] == [1.0, 2.0, 3.0, 4.0, 5.0]  # capturable: a tensor
    assert [v for is_tensor, v in seen if not is_tensor] == [1.0, 2.0, 3.0, 4.0, 5.0]  # default: a number
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_load_state_dict_keeps_fp32_states_of_bf16_params():
    """torch's load_state_dict casts states to the param's dtype; the fp32 moments of bf16 params must stay fp32."""
    a = make_params(torch.bfloat16)
    opt_a = FusedAdam(a, lr=1e-2)
    run_steps([(a, opt_a)], steps=2)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = FusedAdam(b, lr=1e-2)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    for pa, pb in zip(a, b, strict=True):
        for name in ("exp_avg", "exp_avg_sq"):
            assert opt_b.state[pb][name].dtype == torch.float32
            assert torch.equal(opt_b.state[pb][name], opt_a.state[pa][name])
