"""The op contract: every optimizer builder is right for any layout; bad calls raise and touch nothing.

Layouts (transposed, strided with a storage offset, an expanded read-only gradient, states of
other strides than the param) are checked for every optimizer builder that runs here: the cpu
plugin's, the reference, and the npu, xpu, mps and supa builders on their emulated runtimes
(the Triton builders: tests/plugins/cuda/test_optimizer_kernels.py). The oracle is the
reference op on contiguous float64 copies, and torch.optim.AdamW for the transposed param.
"""

from __future__ import annotations

import contextlib
import math

import polyaccel
import pytest
import torch
from polyaccel import ops
from polyaccel.errors import OpArgumentError
from polyaccel.hookspecs import hookimpl
from polyaccel.ops import contract
from polyaccel.ops import reference as ref
from polyaccel.optim import FusedAdam, FusedLamb, FusedLion
from polyaccel.testing.emulation import emulate

ADAM_HP = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)
LION_HP = dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.05)
LAMB_HP = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.05, max_coeff=10.0, min_coeff=0.01)
OPS = {"fused_adam": (4, ADAM_HP, True), "fused_lion": (3, LION_HP, False), "fused_lamb": (4, LAMB_HP, True)}


# ------------------------------------------------------------------------------------------- layouts
def _contig(t):
    return t.clone()


def _transposed(t):
    """Same values, stored transposed (strides (1, rows))."""
    return t.t().contiguous().t()


def _strided(t):
    """Same values in every other column of a bigger buffer, one row in: a storage offset, not dense."""
    big = torch.full((t.shape[0] + 1, 2 * t.shape[1]), 7.0, dtype=t.dtype)
    big[1:, ::2] = t
    return big[1:, ::2]


def _expanded(t):
    """Row 0 repeated through stride 0 (read-only operands only: new logical values)."""
    return t[:1].expand_as(t)


#: (param, grad, exp_avg, exp_avg_sq) layouts of the entry under test
LAYOUTS = {
    "transposed param, contiguous rest": (_transposed, _contig, _contig, _contig),
    "all transposed (same strides)": (_transposed, _transposed, _transposed, _transposed),
    "strided views with storage offsets": (_strided, _contig, _strided, _contig),
    "expanded (stride-0) grad": (_contig, _expanded, _contig, _contig),
    "transposed grad and second moment": (_contig, _transposed, _contig, _transposed),
}


def _lists(n_lists, layout, dtype, seed):
    """Lists of three entries (contiguous, the layout under test, contiguous) and their float64 oracle copies."""
    gen = torch.Generator().manual_seed(seed)
    got = [[] for _ in range(n_lists)]
    want = [[] for _ in range(n_lists)]
    for k, shape in enumerate([(3, 4), (5, 6), (7,)]):
        for li in range(n_lists):
            t = torch.randn(shape, generator=gen, dtype=torch.float64) * (1.0, 0.5, 0.1, 0.01)[li]
            t = t.abs() if li == 3 else t
            t = t.to(dtype)
            t = layout[li](t) if k == 1 else t.clone()
            got[li].append(t)
            want[li].append(t.detach().to(torch.float64, copy=True).contiguous())
    return got, want


def _emulated(name):
    return contextlib.nullcontext() if name == "cpu" else emulate(name)


def _builders(op, device_type):
    """Every builder of ``op`` the registry could use for ``device_type`` here (loaded)."""
    return [(c.builder.name, c.builder.load()) for c in ops.registry.candidates(op, device_type)
            if c.chosen or c.reason.startswith("compatible")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("device_type", ["cpu", "npu", "xpu", "mps", "supa"])
def test_every_optimizer_builder_is_right_for_any_layout(device_type, op, dtype):
    n_lists, hp, has_step = OPS[op]
    with _emulated(device_type):
        builders = _builders(op, device_type)
        assert builders and any(name != "reference" for name, _ in builders) or device_type == "cpu"
        for name, fn in builders:
            for li, (what, layout) in enumerate(LAYOUTS.items()):
                got, want = _lists(n_lists, layout, dtype, seed=li)
                for step in (1, 2):
                    extra = {"step": step} if has_step else {}
                    fn(*got, **hp, **extra)
                    getattr(ref, op)(*want, **hp, **extra)
                tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
                for lj, (g_list, w_list) in enumerate(zip(got, want, strict=True)):
                    for i, (g, w) in enumerate(zip(g_list, w_list, strict=True)):
                        torch.testing.assert_close(g.double(), w, **tol,
                                                   msg=lambda m, n=name, a=what, b=lj, c=i: f"{n}, {a}: list {b} "
                                                   f"entry {c}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("builder", ["cpu_fused_adam", "reference"])
def test_transposed_param_matches_torch_adamw(builder, dtype):
    """The hostile-input case: a transposed param with a contiguous grad, through polyaccel.ops."""
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(6, 5, generator=gen, dtype=dtype)
    ours = p0.clone().t()  # shape (5, 6), strides (1, 5)
    m, v = torch.zeros(5, 6, dtype=dtype), torch.zeros(5, 6, dtype=dtype)
    theirs = torch.nn.Parameter(p0.clone().t())
    opt = torch.optim.AdamW([theirs], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    ops.override("fused_adam", builder)
    try:
        for step in (1, 2, 3):
            g = torch.randn(5, 6, generator=gen, dtype=dtype)
            ops.fused_adam([ours], [g], [m], [v], lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                           step=step)
            theirs.grad = g.clone()
            opt.step()
        assert ops.registry.chosen("fused_adam", "cpu").name == builder
    finally:
        ops.override("fused_adam", None)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(ours, theirs.detach(), rtol=tol, atol=tol)


def test_builders_receive_the_callers_tensors_unchanged():
    """The contract validates but never makes tensors contiguous: layout is each builder's job."""
    seen = []

    class Recorder:
        POLYACCEL_API_VERSION = "1.0"

        @hookimpl
        def polyaccel_register_ops(self, registry):
            def recording(*lists, **kw):
                seen.append(lists)
                return ref.fused_adam(*lists, **kw)

            registry.register("fused_adam", "recording", ("cpu",), lambda: recording, priority=99)

    polyaccel.register_plugin("recorder", Recorder())
    p, g = torch.randn(6, 5).t(), torch.randn(5, 6)
    m, v = torch.zeros(5, 6), torch.zeros(5, 6)
    ops.fused_adam([p], [g], [m], [v], step=1, **ADAM_HP)
    assert seen and seen[0][0][0] is p and not seen[0][0][0].is_contiguous()


# ------------------------------------------------------------------------------- bad hyperparameters
def _adam_call(**changes):
    gen = torch.Generator().manual_seed(1)
    lists = [[torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)] for _ in range(4)]
    lists[3] = [t.abs() for t in lists[3]]
    kw = dict(ADAM_HP, step=3)
    kw.update(changes)
    return lists, kw


BAD_ADAM = [
    ("lr", math.nan, "lr=nan"), ("lr", math.inf, "lr=inf"), ("lr", -1e-3, "lr=-0.001"),
    ("eps", 0.0, "eps=0.0"), ("eps", math.nan, "eps=nan"), ("eps", math.inf, "eps=inf"), ("eps", -1e-8, "eps=-1e-08"),
    ("weight_decay", math.nan, "weight_decay=nan"), ("weight_decay", -0.1, "weight_decay=-0.1"),
    ("weight_decay", math.inf, "weight_decay=inf"),
    ("beta1", 2.0, "beta1=2.0"), ("beta1", 1.0, "beta1=1.0"), ("beta1", -0.1, "beta1=-0.1"),
    ("beta1", math.nan, "beta1=nan"), ("beta2", 1.0, "beta2=1.0"),
    ("step", 0, "step=0"), ("step", -2, "step=-2"), ("step", 0.5, "step=0.5"), ("step", math.nan, "step=nan"),
    ("step", math.inf, "step=inf"), ("step", torch.tensor(0.0), "step=0.0"),
    ("step", torch.tensor([1.0, 2.0]), "shape"), ("step", torch.tensor(True), "dtype torch.bool"),
    ("lr", torch.tensor(1e-3), "real number"), ("lr", "0.001", "real number"), ("lr", True, "real number"),
]


@pytest.mark.parametrize("arg,value,words", BAD_ADAM, ids=[f"{a}={v!r}" for a, v, _ in BAD_ADAM])
def test_bad_adam_and_lamb_hyperparameters_raise_and_touch_nothing(arg, value, words):
    for op in ("fused_adam", "fused_lamb"):
        lists, kw = _adam_call(**{arg: value})
        if op == "fused_lamb":
            kw.update(max_coeff=10.0, min_coeff=0.01)
        before = [[t.clone() for t in lst] for lst in lists]
        with pytest.raises(OpArgumentError, match=arg) as info:
            getattr(ops, op)(*lists, **kw)
        assert words in str(info.value) and op in str(info.value)
        for lst, old in zip(lists, before, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(lst, old, strict=True))


@pytest.mark.parametrize("changes,words", [
    (dict(lr=math.nan), "lr=nan"), (dict(beta1=2.0), "beta1=2.0"), (dict(beta2=-0.5), "beta2=-0.5"),
    (dict(weight_decay=math.inf), "weight_decay=inf"),
])
def test_bad_lion_hyperparameters_raise_and_touch_nothing(changes, words):
    lists, _ = _adam_call()
    lists = lists[:3]
    before = [[t.clone() for t in lst] for lst in lists]
    with pytest.raises(OpArgumentError, match=words.split("=")[0]) as info:
        ops.fused_lion(*lists, **dict(LION_HP, **changes))
    assert words in str(info.value)
    for lst, old in zip(lists, before, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(lst, old, strict=True))


@pytest.mark.parametrize("min_coeff,max_coeff,words", [
    (0.0, 1.0, "min_coeff=0.0"), (-1.0, 1.0, "min_coeff=-1.0"), (math.nan, 1.0, "min_coeff=nan"),
    (2.0, 1.0, "max_coeff=1.0"), (0.1, math.nan, "max_coeff=nan"),
])
def test_bad_lamb_trust_bounds_raise(min_coeff, max_coeff, words):
    lists, kw = _adam_call()
    with pytest.raises(OpArgumentError, match="coeff") as info:
        ops.fused_lamb(*lists, **kw, min_coeff=min_coeff, max_coeff=max_coeff)
    assert words in str(info.value)


def test_edge_values_the_rules_allow_run():
    lists, kw = _adam_call(lr=0.0, beta1=0.0, weight_decay=0.0)
    before = [t.clone() for t in lists[0]]
    ops.fused_adam(*lists, **kw)  # lr 0: params unchanged
    assert all(torch.equal(a, b) for a, b in zip(lists[0], before, strict=True))
    lists, kw = _adam_call(step=torch.tensor(2, dtype=torch.int64))
    ops.fused_lamb(*lists, **kw, min_coeff=1.0, max_coeff=math.inf)  # equal bounds, no upper bound
    assert all(bool(torch.isfinite(t).all()) for t in lists[0])


def test_a_device_step_tensor_is_not_read():
    """The contract checks a device step tensor's dtype, shape and device, never its value (no sync)."""
    with pytest.raises(OpArgumentError, match="meta"):
        contract.check_step("fused_adam", torch.tensor(1.0, device="meta"), torch.device("cpu"))
    contract.check_step("fused_adam", torch.tensor(0.0, device="meta"), torch.device("meta"))  # not read: passes


# ------------------------------------------------------------------------------- bad tensor lists
def _fresh(shape=(4, 3), n=4):
    return [[torch.randn(shape).abs()] for _ in range(n)]


def test_aliased_or_overlapping_written_memory_raises_and_touches_nothing():
    x = torch.randn(8)
    cases = {
        "a param listed twice": ([[x, x], [torch.randn(8), torch.randn(8)], [torch.zeros(8), torch.zeros(8)],
                                  [torch.zeros(8), torch.zeros(8)]], "params[0] and params[1]"),
        "exp_avg is exp_avg_sq": ([[torch.randn(8)], [torch.randn(8)], [x], [x]], "exp_avgs[0] and exp_avg_sqs[0]"),
        "grad is the param": ([[x], [x], [torch.zeros(8)], [torch.zeros(8)]], "params[0] and grads[0]"),
        "overlapping slices": ([[x[:5]], [torch.randn(5)], [x[3:]], [torch.zeros(5)]], "share memory"),
        "expanded param": ([[torch.randn(1, 8).expand(3, 8)], [torch.randn(3, 8)], [torch.zeros(3, 8)],
                            [torch.zeros(3, 8)]], "params[0]"),
    }
    for what, (lists, words) in cases.items():
        before = [[t.clone() for t in lst] for lst in lists]
        with pytest.raises(OpArgumentError, match="memory") as info:
            ops.fused_adam(*lists, step=1, **ADAM_HP)
        assert words in str(info.value), (what, str(info.value))
        for lst, old in zip(lists, before, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(lst, old, strict=True)), what


def test_interleaved_views_and_shared_read_only_grads_are_allowed_and_right():
    """Views of one buffer that share no element are fine, and so is one grad read by two entries."""
    buf = torch.randn(6, 3)
    p, m, v = buf[:, 0], buf[:, 1], buf[:, 2].abs_()
    g = torch.randn(6)
    want = [[t.clone()] for t in (p, g, m, v)]
    ops.fused_adam([p], [g], [m], [v], step=1, **ADAM_HP)
    ref.fused_adam(*want, step=1, **ADAM_HP)
    for got, w in zip((p, m, v), (want[0][0], want[2][0], want[3][0]), strict=True):
        torch.testing.assert_close(got, w)
    ps, ms, vs = [torch.randn(6), torch.randn(6)], [torch.zeros(6), torch.zeros(6)], [torch.zeros(6), torch.zeros(6)]
    ops.fused_adam(ps, [g, g], ms, vs, step=1, **ADAM_HP)


def test_lengths_shapes_devices_and_dtypes_are_named():
    lists = _fresh()
    with pytest.raises(OpArgumentError, match="differ in length"):
        ops.fused_adam(lists[0], lists[1], lists[2], [], step=1, **ADAM_HP)
    with pytest.raises(OpArgumentError, match=r"grads\[0\] has shape \(3, 4\)"):
        ops.fused_adam(lists[0], [torch.randn(3, 4)], lists[2], lists[3], step=1, **ADAM_HP)
    with pytest.raises(OpArgumentError, match=r"exp_avgs\[0\] is on meta.*one device"):
        ops.fused_adam(lists[0], lists[1], [torch.zeros(4, 3, device="meta")], lists[3], step=1, **ADAM_HP)
    with pytest.raises(OpArgumentError, match=r"grads\[0\].*torch.int64"):
        ops.fused_lion(lists[0], [torch.ones(4, 3, dtype=torch.int64)], lists[2], **LION_HP)


# ------------------------------------------------------------------------------- polyaccel.optim
@pytest.mark.parametrize("cls,kw,words", [
    (FusedAdam, dict(lr=math.inf), "lr=inf"), (FusedAdam, dict(eps=math.nan), "eps=nan"),
    (FusedAdam, dict(eps=math.inf), "eps=inf"), (FusedLion, dict(lr=math.nan), "lr=nan"),
    (FusedLion, dict(betas=(0.9, 1.0)), "betas[1]=1.0"), (FusedLamb, dict(weight_decay=math.nan), "weight_decay"),
])
def test_optimizers_refuse_non_finite_hyperparameters_at_construction(cls, kw, words):
    with pytest.raises(OpArgumentError) as info:
        cls([torch.nn.Parameter(torch.randn(3))], **kw)
    assert words in str(info.value)


@pytest.mark.parametrize("cls", [FusedAdam, FusedLion, FusedLamb])
@pytest.mark.parametrize("key,value", [("lr", math.nan), ("lr", math.inf), ("weight_decay", -1.0),
                                       ("betas", (0.9, 2.0))])
def test_values_changed_in_param_groups_later_raise_at_step_and_touch_nothing(cls, key, value):
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    opt = cls(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = [p.detach().clone() for p in params]
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    opt.param_groups[0][key] = value
    with pytest.raises(OpArgumentError, match=key):
        opt.step()
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p.detach(), b)
        assert all(torch.equal(opt.state[p][k], v) for k, v in state[id(p)].items())


def test_fused_muon_refuses_a_gradient_and_buffer_of_two_precisions_by_name_and_runs_the_mixes_it_allows():
    gen = torch.Generator().manual_seed(11)
    p = torch.randn(6, 4, generator=gen)
    kw = dict(lr=0.05, momentum=0.9, weight_decay=0.1, ns_dtype=torch.float64)
    for g_dtype, b_dtype in ((torch.float64, torch.float32), (torch.float32, torch.float64),
                             (torch.bfloat16, torch.float64)):
        params, buf = [p.clone()], [torch.zeros(6, 4, dtype=b_dtype)]
        with pytest.raises(OpArgumentError, match=rf"grads\[0\] is {g_dtype} but momentum_buffers\[0\] is {b_dtype}"):
            ops.fused_muon(params, [torch.randn(6, 4, generator=gen).to(g_dtype)], buf, **kw)
        assert torch.equal(params[0], p) and not buf[0].any()  # refused before anything was written
    # allowed: a bf16 gradient with an fp32 buffer (upcast), an fp32 param with an fp64 gradient and buffer
    g = torch.randn(6, 4, generator=gen)
    want = [p.double().clone()]
    ops.fused_muon(want, [g.bfloat16().double()], [torch.zeros(6, 4, dtype=torch.float64)], **kw)
    got = [p.clone()]
    ops.fused_muon(got, [g.bfloat16()], [torch.zeros(6, 4)], **kw)
    torch.testing.assert_close(got[0].double(), want[0], rtol=1e-5, atol=1e-6)
    got = [p.clone()]
    ops.fused_muon(got, [g.bfloat16().double()], [torch.zeros(6, 4, dtype=torch.float64)], **kw)
    torch.testing.assert_close(got[0].double(), want[0], rtol=1e-6, atol=1e-7)
