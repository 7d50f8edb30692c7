"""What the op fuzz suite draws for each op, and how it runs one drawn case.

For every op a hypothesis strategy of cases (pure data with a readable ``repr``: shapes,
strides, offsets, dtypes, hyperparameters, the NaN/Inf planted and the seed of the random
values) and ``run(case, device)``, which builds the inputs on the device, calls
``polyaccel.ops.<op>`` (whatever builder the caller's override selects), computes the
reference on float64 host copies and judges the outcome (:mod:`.fuzz_outcome`). Cases the
contract says must be refused (bad hyperparameters, a written tensor with overlapping
storage, a quantizer input that is not contiguous, scales that do not match the groups)
carry the reason in ``refuse``; for them only an honest refusal passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import polyaccel.ops as ops
import torch
from hypothesis import strategies as st
from polyaccel.errors import OpArgumentError
from polyaccel.ops import reference as ref

from . import fuzz_loss, fuzz_model, fuzz_moe, fuzz_muon, fuzz_muon_passes
from .fuzz_layouts import Buffers, Layout, TensorSpec, draw_layout, draw_shape, draw_specials, dtype_name, host64
from .fuzz_outcome import COMPARED, REFUSED, attempt, close, fail, pretty_repr, unchanged
from .opcases import _codes

SEEDS = st.integers(0, 2**31 - 1)
#: magnitudes of the random values (absolute tolerances scale with them)
SCALES = (1.0, 1e-3, 30.0)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ============================================================================ optimizers
STATES = {"fused_adam": ("exp_avg", "exp_avg_sq"), "fused_lion": ("exp_avg",), "fused_lamb": ("exp_avg", "exp_avg_sq")}
VALID = {
    "lr": (1e-3, 0.0, 1e-2, 0.1),
    "beta1": (0.9, 0.0, 0.5, 0.99),
    "beta2": (0.999, 0.0, 0.9, 0.99),
    "eps": (1e-8, 1e-6, 1e-3),
    "weight_decay": (0.0, 0.01, 0.1),
    "step": (1, 2, 3, 10, 1000),
    "adam_w_mode": (True, False),
    "bias_correction": (True, False),
    "coeffs": ((0.01, 10.0), (0.5, 2.0), (1.0, 1.0)),
}
BAD = {
    "lr": (math.nan, math.inf, -1e-3),
    "eps": (0.0, -1e-8, math.nan, math.inf),
    "weight_decay": (-0.01, math.nan, math.inf),
    "beta1": (1.0, -0.1, math.nan),
    "beta2": (1.0, 1.5, math.nan),
    "step": (0, -1),
    "coeffs": ((0.0, 10.0), (-1.0, 10.0), (2.0, 1.0)),
}
_VALID = {k: st.sampled_from(v) for k, v in VALID.items()}
_BAD = {k: st.sampled_from(v) for k, v in BAD.items()}
#: mostly valid calls; now and then one the contract says must be refused (in the middle: hypothesis
#: favours the ends of a choice, and shrinks towards the first)
_KINDS = st.sampled_from(("valid",) * 7 + ("bad hyperparameter", "overlapping param", "aliased tensors")
                         + ("valid",) * 7)
_SCALES = st.sampled_from(SCALES)
HYPER = {
    "fused_adam": ("lr", "beta1", "beta2", "eps", "weight_decay", "step", "adam_w_mode", "bias_correction"),
    "fused_lion": ("lr", "beta1", "beta2", "weight_decay"),
    "fused_lamb": ("lr", "beta1", "beta2", "eps", "weight_decay", "step", "bias_correction", "coeffs"),
}


@dataclass(frozen=True)
class OptimizerCase:
    op: str
    groups: tuple[tuple[TensorSpec, ...], ...]  # per tensor index: param, grad, states...
    hyper: tuple[tuple[str, object], ...]
    step_tensor: bool
    scale: float
    seed: int
    alias: str = ""  # "exp_avg 0 is param 0" / "tensor 1 is tensor 0"
    refuse: str = ""

    def kwargs(self) -> dict:
        kw = {}
        for k, v in self.hyper:
            if k == "coeffs":
                kw["min_coeff"], kw["max_coeff"] = v
            else:
                kw[k] = v
        return kw

    def __repr__(self) -> str:
        hyper = " ".join(f"{k}={v!r}" for k, v in self.hyper)
        step = " (step as a 0-d tensor)" if self.step_tensor else ""
        parts = [f"{self.op}: {hyper}{step}; values scale {self.scale:g}, seed {self.seed}"]
        parts += [f"tensor {i}: " + "; ".join(map(repr, g)) for i, g in enumerate(self.groups)]
        if self.alias:
            parts.append(f"aliased: {self.alias}")
        if self.refuse:
            parts.append(f"must refuse: {self.refuse}")
        return " | ".join(parts)

    _repr_pretty_ = pretty_repr


def _optimizer_groups(draw, op: str, kind: str, n: int, dtype, state_dtype) -> list[tuple[TensorSpec, ...]]:
    """The case's ``n`` groups of tensors (param, grad, states), with the overlap or alias ``kind`` plants."""
    roles = ("param", "grad") + STATES[op]
    groups = []
    for i in range(n):
        if kind == "aliased tensors" and i == 1:
            groups.append(tuple(TensorSpec(s.role[:-1] + "1", s.layout, s.dtype, s.planted) for s in groups[0]))
            continue
        shape = draw_shape(draw)
        if kind != "valid" and i == 0 and math.prod(shape) < 2:
            shape = (3, 2)  # an overlap or alias needs elements to collide
        specs = []
        for role in roles:
            lay = draw_layout(draw, shape, overlap=(kind == "overlapping param" and i == 0 and role == "param"))
            planted = draw_specials(draw, lay.numel) if role == "grad" else ()
            specs.append(TensorSpec(f"{role} {i}", lay, dtype if role in ("param", "grad") else state_dtype, planted))
        groups.append(tuple(specs))
    return groups


def _optimizer_refusal(draw, op: str, kind: str, hyper: dict) -> tuple[str, str]:
    """``(refuse, alias)`` for a case of ``kind`` (a bad hyperparameter is planted into ``hyper``)."""
    if kind == "bad hyperparameter":
        key = draw(st.sampled_from([k for k in HYPER[op] if k in BAD]))
        hyper[key] = draw(_BAD[key])
        return f"{key}={hyper[key]!r}", ""
    if kind == "overlapping param":
        return "a param with overlapping storage (a stride-0 expand)", ""
    if kind == "aliased tensors":
        alias = draw(st.sampled_from(("exp_avg 0 is param 0", "tensor 1 is tensor 0")))
        return f"aliased written tensors ({alias})", alias
    return "", ""


@st.composite
def optimizer_cases(draw, op: str, dtypes: tuple[torch.dtype, ...]) -> OptimizerCase:
    dtype = draw(st.sampled_from(dtypes))
    state_dtype = dtype if dtype in (torch.float32, torch.float64) else draw(st.sampled_from((torch.float32, dtype)))
    kind = draw(_KINDS)
    n = draw(st.integers(2 if kind == "aliased tensors" else 1, 3))
    groups = _optimizer_groups(draw, op, kind, n, dtype, state_dtype)
    hyper = {k: draw(_VALID[k]) for k in HYPER[op]}
    refuse, alias = _optimizer_refusal(draw, op, kind, hyper)
    step_tensor = "step" in hyper and kind != "bad hyperparameter" and draw(st.booleans())
    return OptimizerCase(op, tuple(groups), tuple(hyper.items()), step_tensor, draw(_SCALES),
                         draw(SEEDS), alias, refuse)


def run_optimizer(case: OptimizerCase, device: torch.device) -> str:
    bufs = Buffers(device, _generator(case.seed))
    roles = ("param", "grad") + STATES[case.op]
    lists: list[list[torch.Tensor]] = [[] for _ in roles]
    for group in case.groups:
        for k, spec in enumerate(group):
            positive = roles[k] == "exp_avg_sq"
            scale = case.scale ** 2 * 0.01 if positive else case.scale * (0.1 if roles[k] == "exp_avg" else 1.0)
            lists[k].append(bufs.make(spec, scale=scale, positive=positive))
    if case.alias == "exp_avg 0 is param 0":
        lists[2][0] = lists[0][0]
    elif case.alias == "tensor 1 is tensor 0":
        for lst in lists:
            lst[1] = lst[0]
    kw = case.kwargs()
    refuse = case.refuse
    copies = [[host64(t) for t in lst] for lst in lists]
    if not refuse:
        try:
            getattr(ref, case.op)(*copies, **kw)
        except OpArgumentError as exc:
            refuse = f"what the reference refuses ({exc})"
    if case.step_tensor:
        kw["step"] = torch.tensor(float(kw["step"]), device=device)
    outcome, _ = attempt(lambda: getattr(ops, case.op)(*lists, **kw), bufs, refuse)
    if outcome == REFUSED:
        return f"{REFUSED}: {bufs.refusal}"
    unchanged(bufs, {s.role for g in case.groups for s in g if s.role.startswith("grad")})
    _compare_written(case, roles, lists, copies)
    return COMPARED


def _compare_written(case: OptimizerCase, roles: tuple[str, ...], lists, copies) -> None:
    """Every param and state the op wrote keeps its dtype and matches the float64 reference's update, within
    the tolerance of the param dtype (of the state's own dtype beside fp32/fp64 params)."""
    for k, role in enumerate(roles):
        if role == "grad":
            continue
        for i, (got, want) in enumerate(zip(lists[k], copies[k], strict=True)):
            spec = case.groups[i][k]
            if got.dtype != spec.dtype:
                fail(f"{role} {i} changed dtype from {spec.dtype} to {got.dtype}")
            param_dtype = case.groups[i][0].dtype
            tol_dtype = param_dtype if role == "param" or param_dtype in (torch.float16, torch.bfloat16) else spec.dtype
            atol_scale = max(1.0, case.scale ** 2 if role == "exp_avg_sq" else case.scale)
            close(got, want, tol_dtype, f"{role} {i}", atol_scale=atol_scale, non_finite_alike=True)


def forward_backward(forward, grad_out: torch.Tensor, bufs: Buffers):
    """``forward()`` and its backward with ``grad_out`` as one attempt: the output, or None when the builder refused
    (honestly: every input unchanged). Accepted calls must leave every input as it was too (autograd ops only read)."""

    def call():
        out = forward()
        out.backward(grad_out)
        return out

    outcome, out = attempt(call, bufs)
    if outcome == REFUSED:
        return None
    unchanged(bufs, {e[0] for e in bufs.entries})
    return out


# ============================================================================== quantize
@dataclass(frozen=True)
class QuantizeCase:
    x: TensorSpec
    mode: str
    group_size: int
    symmetric: bool
    scale: float
    shift: float
    zero_groups: tuple[int, ...]
    seed: int

    def __repr__(self) -> str:
        zeros = f", all-zero groups {list(self.zero_groups)}" if self.zero_groups else ""
        return (f"quantize(x, mode={self.mode!r}, group_size={self.group_size}, symmetric={self.symmetric}) | "
                f"{self.x!r} | values scale {self.scale:g} shift {self.shift:g}{zeros}, seed {self.seed}")

    _repr_pretty_ = pretty_repr


#: mostly contiguous inputs (at storage offsets); a strided one must be refused
_QUANT_STRIDED = st.sampled_from((False, False, True, False, False))
#: mostly non-empty inputs; an empty one must be refused
_QUANT_GROUPS = st.sampled_from((1, 2, 3, 0, 4, 5, 6))
GROUP_SIZES = (8, 1, 2, 3, 4, 6, 7, 16, 32, 128)


def _grouped_shape(draw, groups: int, group_size: int) -> tuple[int, ...]:
    n = groups * group_size
    return draw(st.sampled_from(((n,), (groups, group_size), (group_size, groups), (1, n), (groups, 1, group_size))))


@st.composite
def quantize_cases(draw, dtypes: tuple[torch.dtype, ...], fp8: bool) -> QuantizeCase:
    dtype = draw(st.sampled_from(dtypes))
    mode = draw(st.sampled_from(("int8", "int4", "fp8") if fp8 else ("int8", "int4")))
    sym = True if mode == "fp8" else draw(st.booleans())
    gs = draw(st.sampled_from([g for g in GROUP_SIZES if mode != "int4" or g % 2 == 0]))
    groups = draw(_QUANT_GROUPS)
    shape = _grouped_shape(draw, groups, gs)
    lay = draw_layout(draw, shape, strided=draw(_QUANT_STRIDED))
    zero_groups = tuple(sorted(set(draw(st.lists(st.integers(0, max(groups - 1, 0)), max_size=2))))) if groups else ()
    x = TensorSpec("x", lay, dtype, draw_specials(draw, lay.numel))
    return QuantizeCase(x, mode, gs, sym, draw(_SCALES), draw(st.sampled_from((0.0, 0.5))),
                        zero_groups, draw(SEEDS))


def _host_qt(qt) -> ref.QuantizedTensor:
    return ref.QuantizedTensor(qt.data.detach().cpu(), qt.scales.detach().cpu(),
                               None if qt.zero_points is None else qt.zero_points.detach().cpu(), qt.mode,
                               qt.group_size, qt.shape, qt.dtype)


def run_quantize(case: QuantizeCase, device: torch.device) -> str:
    gen = _generator(case.seed)
    lay, gs = case.x.layout, case.group_size
    values = torch.randn(lay.shape, generator=gen, dtype=torch.float64) * case.scale + case.shift * case.scale
    flat = values.view(-1)
    for g in case.zero_groups:
        flat[g * gs:(g + 1) * gs] = 0.0
    bufs = Buffers(device, gen)
    x = bufs.make(case.x, values=values)
    refuse = ""
    if lay.numel == 0:
        refuse = "an empty input"
    elif not x.is_contiguous():
        refuse = "a non-contiguous input (the contract takes a contiguous x)"
    x64 = host64(x)
    outcome, got = attempt(lambda: ops.quantize(x, mode=case.mode, group_size=gs, symmetric=case.symmetric), bufs,
                           refuse)
    if outcome == REFUSED:
        return f"{REFUSED}: {bufs.refusal}"
    unchanged(bufs, {"x"})
    want = ref.quantize(x64, mode=case.mode, group_size=gs, symmetric=case.symmetric)
    _check_quantized_format(case, got, want, x)
    host = _host_qt(got)
    bad = ~x64.reshape(-1, gs).isfinite().all(dim=1)
    good = ~bad
    scales = host.scales.double()
    if bool(bad.any()):
        _check_non_finite_groups(host, bad, scales)
    deq = ref.dequantize(host, dtype=torch.float64).reshape(-1, gs)
    if bool(bad.any()) and not bool(deq[bad].isnan().all()):
        fail("an element of a group holding NaN/Inf does not dequantize to NaN")
    if not bool(good.any()):
        return COMPARED
    _check_finite_groups(case, host, want, x64, good, scales, deq)
    return COMPARED


def _check_quantized_format(case: QuantizeCase, got, want: ref.QuantizedTensor, x: torch.Tensor) -> None:
    """The result is a QuantizedTensor of the call's mode, group size, dtype and shape, in the reference's wire
    format (data dtype and shape, one float32 scale per group, zero points where the reference has them)."""
    gs = case.group_size
    if not isinstance(got, ref.QuantizedTensor):
        fail(f"returned {type(got).__name__}, not a QuantizedTensor")
    for name, expect in (("mode", case.mode), ("group_size", gs), ("dtype", x.dtype), ("shape", x.shape)):
        if getattr(got, name) != expect:
            fail(f"result's {name} is {getattr(got, name)!r}, expected {expect!r}")
    if got.data.dtype != want.data.dtype or tuple(got.data.shape) != tuple(want.data.shape):
        fail(f"data is {got.data.dtype}{tuple(got.data.shape)}, the wire format is "
             f"{want.data.dtype}{tuple(want.data.shape)}")
    groups = case.x.layout.numel // gs
    if got.scales.dtype != torch.float32 or got.scales.numel() != groups:
        fail(f"scales are {got.scales.dtype}{tuple(got.scales.shape)}, expected float32 with {groups} entries")
    if (got.zero_points is None) != (want.zero_points is None):
        fail("zero points present where the reference has none, or missing")


def _check_non_finite_groups(host: ref.QuantizedTensor, bad: torch.Tensor, scales: torch.Tensor) -> None:
    """The contract: a group holding NaN or ±Inf gets a NaN scale (zero point 0), so it dequantizes to NaN."""
    if not bool(scales[bad].isnan().all()):
        g = int((bad & ~scales.isnan()).nonzero()[0])
        fail(f"group {g} holds NaN/Inf but its scale is {scales[g].item()!r} (the contract: NaN)")
    if host.zero_points is not None and bool((host.zero_points[bad] != 0).any()):
        fail("a group holding NaN/Inf has a non-zero zero point (the contract: 0)")


def _check_finite_groups(case: QuantizeCase, host: ref.QuantizedTensor, want: ref.QuantizedTensor,
                         x64: torch.Tensor, good: torch.Tensor, scales: torch.Tensor, deq: torch.Tensor) -> None:
    """Scales, zero points and codes of the finite groups within a step of the reference's, and the round trip
    within one quantization step of ``x``."""
    gs = case.group_size
    close(scales[good], want.scales.double()[good], torch.float32, "scales of the finite groups")
    if want.zero_points is not None:
        dz = (host.zero_points[good].int() - want.zero_points[good].int()).abs().max()
        if int(dz) > 1:
            fail(f"zero points differ from the reference by {int(dz)}")
    cg, cw = _codes(host).reshape(-1, gs)[good], _codes(want).reshape(-1, gs)[good]
    if case.mode == "fp8":
        if bool(((cg - cw).abs() > cw.abs() * 0.125 + 2.0 ** -6).any()):
            fail("fp8 codes of a finite group differ from the reference by more than one step")
    elif int((cg - cw).abs().max()) > 1:
        fail(f"integer codes differ from the reference by {int((cg - cw).abs().max())} (allowed: 1)")
    xg = x64.reshape(-1, gs)[good]
    step = scales[good][:, None]
    if case.mode == "fp8":
        bound = xg.abs() * 0.0625 * (1 + 1e-3) + step * 2.0 ** -6
    else:
        bound = step * (0.5 if case.symmetric else 1.0) * (1 + 1e-3) + 1e-6 * max(case.scale, 1.0)
    if not bool(((deq[good] - xg).abs() <= bound).all()):
        fail("dequantize(quantize(x)) is off by more than one quantization step in a finite group")


# ============================================================================ dequantize
@dataclass(frozen=True)
class DequantizeCase:
    dtype: torch.dtype
    out_dtype: torch.dtype | None
    mode: str
    group_size: int
    symmetric: bool
    shape: tuple[int, ...]
    data: Layout
    scales: Layout
    zero_points: Layout | None
    nan_group: int | None
    miscount: str  # "" or "scales" / "zero points": one entry more or fewer than the groups
    seed: int

    def __repr__(self) -> str:
        out = "None" if self.out_dtype is None else dtype_name(self.out_dtype)
        text = (f"dequantize(qt, dtype={out}) of quantize({dtype_name(self.dtype)} {self.shape}, mode={self.mode!r}, "
                f"group_size={self.group_size}, symmetric={self.symmetric}) | data {self.data!r} | "
                f"scales {self.scales!r}")
        if self.zero_points is not None:
            text += f" | zero points {self.zero_points!r}"
        if self.nan_group is not None:
            text += f" | NaN scale in group {self.nan_group}"
        if self.miscount:
            text += f" | must refuse: {self.miscount} count is not the number of groups"
        return text + f" | seed {self.seed}"

    _repr_pretty_ = pretty_repr


_MISCOUNT = st.sampled_from(("",) * 7 + ("scales", "zero points") + ("",) * 7)


@st.composite
def dequantize_cases(draw, dtypes: tuple[torch.dtype, ...], fp8: bool) -> DequantizeCase:
    dtype = draw(st.sampled_from(dtypes))
    mode = draw(st.sampled_from(("int8", "int4", "fp8") if fp8 else ("int8", "int4")))
    sym = True if mode == "fp8" else draw(st.booleans())
    gs = draw(st.sampled_from([g for g in GROUP_SIZES if mode != "int4" or g % 2 == 0]))
    groups = draw(st.integers(1, 5))
    shape = _grouped_shape(draw, groups, gs)
    miscount = draw(_MISCOUNT)
    if miscount == "zero points" and sym:
        miscount = "scales"
    n_scales = groups + (draw(st.sampled_from((1, -1))) if miscount == "scales" and groups > 1 else
                         (1 if miscount == "scales" else 0))
    n_zp = groups + (1 if miscount == "zero points" else 0)
    data_len = groups * gs // (2 if mode == "int4" else 1)
    return DequantizeCase(
        dtype, draw(st.sampled_from((None, *dtypes))), mode, gs, sym, shape, draw_layout(draw, (data_len,)),
        draw_layout(draw, (n_scales,)), None if sym else draw_layout(draw, (n_zp,)),
        draw(st.one_of(st.none(), st.integers(0, groups - 1))), miscount, draw(SEEDS))


def run_dequantize(case: DequantizeCase, device: torch.device) -> str:
    gen = _generator(case.seed)
    x = (torch.randn(case.shape, generator=gen, dtype=torch.float64) * 2).to(case.dtype)
    qt = ref.quantize(x, mode=case.mode, group_size=case.group_size, symmetric=case.symmetric)
    scales, zp = qt.scales.clone(), None if qt.zero_points is None else qt.zero_points.clone()
    if case.nan_group is not None:
        scales[case.nan_group] = math.nan
        if zp is not None:
            zp[case.nan_group] = 0
    n = scales.numel()
    bufs = Buffers(device, gen)
    data = bufs.make(TensorSpec("data", case.data, qt.data.dtype), values=qt.data.to(torch.float64))
    want_scales = torch.cat([scales, torch.ones(max(case.scales.numel - n, 0))])[:case.scales.numel]
    scales_d = bufs.make(TensorSpec("scales", case.scales, torch.float32), values=want_scales)
    zp_d = None
    if case.zero_points is not None:
        zp_vals = torch.cat([zp.double(), torch.zeros(max(case.zero_points.numel - n, 0))])[:case.zero_points.numel]
        zp_d = bufs.make(TensorSpec("zero points", case.zero_points, torch.uint8), values=zp_vals)
    given = ref.QuantizedTensor(data, scales_d, zp_d, qt.mode, qt.group_size, qt.shape, qt.dtype)
    refuse = f"{case.miscount} for {n} groups" if case.miscount else ""
    outcome, got = attempt(lambda: ops.dequantize(given, dtype=case.out_dtype), bufs, refuse)
    if outcome == REFUSED:
        return f"{REFUSED}: {bufs.refusal}"
    unchanged(bufs, {"data", "scales", "zero points"})
    expect_dtype = case.out_dtype or case.dtype
    if not isinstance(got, torch.Tensor) or got.dtype != expect_dtype:
        fail(f"returned {getattr(got, 'dtype', type(got).__name__)}, expected a {expect_dtype} tensor")
    host = ref.QuantizedTensor(qt.data, scales, zp, qt.mode, qt.group_size, qt.shape, qt.dtype)
    close(got, ref.dequantize(host, dtype=torch.float64), expect_dtype, "result")
    return COMPARED


# ================================================================================ swiglu
@dataclass(frozen=True)
class SwigluCase:
    gate: TensorSpec
    up: TensorSpec
    grad_out: TensorSpec
    halves: bool  # gate and up are h.chunk(2, -1) of one contiguous [N, 2F] tensor
    seed: int
    weights: TensorSpec | None = None  # weighted_swiglu's one weight per row

    def __repr__(self) -> str:
        halves = " (gate, up = h.chunk(2, -1) of one contiguous tensor)" if self.halves else ""
        op, w = ("swiglu", "") if self.weights is None else ("weighted_swiglu", f" | {self.weights!r}")
        return f"{op}{halves} | {self.gate!r} | {self.up!r}{w} | {self.grad_out!r} | seed {self.seed}"

    _repr_pretty_ = pretty_repr


NAN_ONLY = (math.nan,)


@st.composite
def swiglu_cases(draw, dtypes: tuple[torch.dtype, ...], weighted: bool = False) -> SwigluCase:
    dtype = draw(st.sampled_from(dtypes))
    halves = draw(st.sampled_from((False, False, True)))
    shape = draw_shape(draw, two_dims=True) if halves or weighted else draw_shape(draw)
    if halves:
        h = Layout.contiguous((shape[0], 2 * shape[1]))
        gate_l = Layout(shape, h.strides, 0, h.storage)
        up_l = Layout(shape, h.strides, shape[1], h.storage)
    else:
        gate_l, up_l = draw_layout(draw, shape), draw_layout(draw, shape)
    numel = math.prod(shape)
    spec = lambda role, lay: TensorSpec(role, lay, dtype, draw_specials(draw, numel, NAN_ONLY, 1))  # noqa: E731
    weights = None
    if weighted:
        weights = TensorSpec("weights", draw_layout(draw, shape[:1]), draw(st.sampled_from(dtypes)),
                             draw_specials(draw, shape[0], NAN_ONLY, 1))
    return SwigluCase(spec("gate", gate_l), spec("up", up_l), spec("grad_out", draw_layout(draw, shape)), halves,
                      draw(SEEDS), weights)


def run_swiglu(case: SwigluCase, device: torch.device) -> str:
    bufs = Buffers(device, _generator(case.seed))
    if case.halves:
        n, f = case.gate.layout.shape
        hspec = TensorSpec("h", Layout.contiguous((n, 2 * f)), case.gate.dtype)
        h_vals = torch.randn(n, 2 * f, generator=bufs.generator, dtype=torch.float64)
        for spec, col in ((case.gate, 0), (case.up, f)):
            block = h_vals[:, col:col + f].reshape(-1).clone()
            for i, v in spec.planted:
                block[i % max(block.numel(), 1)] = v
            h_vals[:, col:col + f] = block.view(n, f)
        h = bufs.make(hspec, values=h_vals).detach().requires_grad_(True)
        gate, up = h.chunk(2, -1)
        leaves = [h]
    else:
        gate = bufs.make(case.gate).detach().requires_grad_(True)
        up = bufs.make(case.up).detach().requires_grad_(True)
        leaves = [gate, up]
    weights = None
    if case.weights is not None:
        weights = bufs.make(case.weights).detach().requires_grad_(True)
        leaves.append(weights)
    grad_out = bufs.make(case.grad_out)
    g64, u64 = host64(gate).requires_grad_(True), host64(up).requires_grad_(True)
    go64 = host64(grad_out)

    if weights is None:
        out = forward_backward(lambda: ops.swiglu(gate, up), grad_out, bufs)
    else:
        out = forward_backward(lambda: ops.weighted_swiglu(gate, up, weights), grad_out, bufs)
    if out is None:
        return f"{REFUSED}: {bufs.refusal}"
    if weights is None:
        want = ref.swiglu(g64, u64)
    else:
        w64 = host64(weights).requires_grad_(True)
        want = ref.weighted_swiglu(g64, u64, w64)
    want.backward(go64)
    dtype = case.gate.dtype
    if out.dtype != dtype:
        fail(f"result is {out.dtype}, expected {dtype}")
    close(out, want, dtype, "forward")
    if any(t.grad is None for t in leaves):
        fail("backward produced no gradient for an input")
    if weights is not None:  # a sum over F: bounded by the sum of the terms' magnitudes
        g, u = g64.detach(), u64.detach()
        mag = (go64.abs() * (g * torch.sigmoid(g)).abs() * u.abs()).sum(dim=1)
        close(weights.grad, w64.grad, case.weights.dtype, "d weights", mag=mag)
    if case.halves:
        close(leaves[0].grad, torch.cat([g64.grad, u64.grad], dim=-1), dtype, "gradient of h = [gate | up]")
    else:
        close(gate.grad, g64.grad, dtype, "d gate")
        close(up.grad, u64.grad, dtype, "d up")
    return COMPARED


# ============================================================================ grouped_mm
@dataclass(frozen=True)
class GroupedMmCase:
    x: TensorSpec
    weight: TensorSpec
    offsets: Layout
    counts: tuple[int, ...]
    offsets_dtype: torch.dtype
    seed: int

    def __repr__(self) -> str:
        return (f"grouped_mm | rows per expert {list(self.counts)} | {self.x!r} | {self.weight!r} | "
                f"offsets: {dtype_name(self.offsets_dtype)} {self.offsets!r} | seed {self.seed}")

    _repr_pretty_ = pretty_repr


@st.composite
def grouped_mm_cases(draw, dtypes: tuple[torch.dtype, ...]) -> GroupedMmCase:
    dtype = draw(st.sampled_from(dtypes))
    counts = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=4)))
    rows = sum(counts) + draw(st.integers(0, 3))
    k, n = draw(st.integers(1, 9)), draw(st.integers(1, 7))
    return GroupedMmCase(TensorSpec("x", draw_layout(draw, (rows, k)), dtype),
                         TensorSpec("weight", draw_layout(draw, (len(counts), k, n)), dtype),
                         draw_layout(draw, (len(counts),)), counts, draw(st.sampled_from((torch.int64, torch.int32))),
                         draw(SEEDS))


def run_grouped_mm(case: GroupedMmCase, device: torch.device) -> str:
    bufs = Buffers(device, _generator(case.seed))
    x = bufs.make(case.x).detach().requires_grad_(True)
    w = bufs.make(case.weight).detach().requires_grad_(True)
    ends = torch.tensor(case.counts, dtype=torch.float64).cumsum(0)
    offsets = bufs.make(TensorSpec("offsets", case.offsets, case.offsets_dtype), values=ends)
    rows, n = case.x.layout.shape[0], case.weight.layout.shape[2]
    grad_out = bufs.make(TensorSpec("grad_out", Layout.contiguous((rows, n)), case.x.dtype))

    out = forward_backward(lambda: ops.grouped_mm(x, w, offsets), grad_out, bufs)
    if out is None:
        return f"{REFUSED}: {bufs.refusal}"
    off = ends.long()
    leaves64 = [host64(x).requires_grad_(True), host64(w).requires_grad_(True)]
    want = ref.grouped_mm(leaves64[0], leaves64[1], off)
    want.backward(host64(grad_out))
    # the same op on absolute values bounds each dot product's rounding error (forward and backward)
    abs64 = [host64(x).abs().requires_grad_(True), host64(w).abs().requires_grad_(True)]
    mag = ref.grouped_mm(abs64[0], abs64[1], off)
    mag.backward(host64(grad_out).abs())
    dtype = case.x.dtype
    if out.dtype != dtype:
        fail(f"result is {out.dtype}, expected {dtype}")
    close(out, want, dtype, "forward", mag=mag.detach())
    if x.grad is None or w.grad is None:
        fail("backward produced no gradient for x or weight")
    close(x.grad, leaves64[0].grad, dtype, "d x", mag=abs64[0].grad)
    close(w.grad, leaves64[1].grad, dtype, "d weight", mag=abs64[1].grad)
    return COMPARED


# ============================================================================ gather_sum
@dataclass(frozen=True)
class GatherSumCase:
    rows: TensorSpec
    index: Layout
    index_dtype: torch.dtype
    weights: TensorSpec | None
    seed: int

    def __repr__(self) -> str:
        w = repr(self.weights) if self.weights is not None else "weights: None"
        return (f"gather_sum | {self.rows!r} | index: {dtype_name(self.index_dtype)} {self.index!r} | {w} | "
                f"seed {self.seed}")

    _repr_pretty_ = pretty_repr


@st.composite
def gather_sum_cases(draw, dtypes: tuple[torch.dtype, ...]) -> GatherSumCase:
    dtype = draw(st.sampled_from(dtypes))
    t, k, h = draw(st.integers(0, 6)), draw(st.integers(1, 4)), draw(st.sampled_from((1, 2, 3, 5, 8, 33)))
    weighted = draw(st.booleans())
    weights = TensorSpec("weights", draw_layout(draw, (t, k)), draw(st.sampled_from(dtypes))) if weighted else None
    return GatherSumCase(TensorSpec("rows", draw_layout(draw, (t * k, h)), dtype), draw_layout(draw, (t, k)),
                         draw(st.sampled_from((torch.int64, torch.int32))), weights, draw(SEEDS))


def run_gather_sum(case: GatherSumCase, device: torch.device) -> str:
    bufs = Buffers(device, _generator(case.seed))
    t, k = case.index.shape
    rows = bufs.make(case.rows).detach().requires_grad_(True)
    perm = torch.randperm(t * k, generator=bufs.generator).view(t, k).double()
    index = bufs.make(TensorSpec("index", case.index, case.index_dtype), values=perm)
    weights = None
    if case.weights is not None:
        weights = bufs.make(case.weights, positive=True).detach().requires_grad_(True)
    grad_out = bufs.make(TensorSpec("grad_out", Layout.contiguous((t, case.rows.layout.shape[1])), case.rows.dtype))

    out = forward_backward(lambda: ops.gather_sum(rows, index, weights), grad_out, bufs)
    if out is None:
        return f"{REFUSED}: {bufs.refusal}"
    idx = perm.long()
    dtype = case.rows.dtype

    def reference(absolute: bool):
        r = host64(rows).abs() if absolute else host64(rows)
        w = None if weights is None else (host64(weights).abs() if absolute else host64(weights))
        r.requires_grad_(True)
        if w is not None:
            w.requires_grad_(True)
        o = ref.gather_sum(r, idx, w)
        go = host64(grad_out)
        o.backward(go.abs() if absolute else go)
        return o, r, w

    want, r64, w64 = reference(False)
    mag, r_abs, w_abs = reference(True)
    if out.dtype != dtype:
        fail(f"result is {out.dtype}, expected {dtype}")
    close(out, want, dtype, "forward", mag=mag.detach())
    if rows.grad is None or (weights is not None and weights.grad is None):
        fail("backward produced no gradient for rows or weights")
    close(rows.grad, r64.grad, dtype, "d rows", mag=r_abs.grad)
    if weights is not None:
        close(weights.grad, w64.grad, case.weights.dtype, "d weights", mag=w_abs.grad)
    return COMPARED


@dataclass(frozen=True)
class OpFuzz:
    """One op's strategy (given the dtypes to draw from and whether fp8 is on) and its runner."""

    strategy: object
    run: object


def op_fuzzers() -> dict[str, OpFuzz]:
    opt = lambda op: OpFuzz(lambda dtypes, fp8: optimizer_cases(op, dtypes), run_optimizer)  # noqa: E731
    return {
        "fused_adam": opt("fused_adam"),
        "fused_lion": opt("fused_lion"),
        "fused_lamb": opt("fused_lamb"),
        "quantize": OpFuzz(quantize_cases, run_quantize),
        "dequantize": OpFuzz(dequantize_cases, run_dequantize),
        "swiglu": OpFuzz(lambda dtypes, fp8: swiglu_cases(dtypes), run_swiglu),
        "weighted_swiglu": OpFuzz(lambda dtypes, fp8: swiglu_cases(dtypes, weighted=True), run_swiglu),
        "grouped_mm": OpFuzz(lambda dtypes, fp8: grouped_mm_cases(dtypes), run_grouped_mm),
        "gather_sum": OpFuzz(lambda dtypes, fp8: gather_sum_cases(dtypes), run_gather_sum),
        "newton_schulz": OpFuzz(lambda dtypes, fp8: fuzz_muon.newton_schulz_cases(dtypes), fuzz_muon.run_newton_schulz),
        "fused_muon": OpFuzz(lambda dtypes, fp8: fuzz_muon.fused_muon_cases(dtypes), fuzz_muon.run_fused_muon),
        "muon_momentum": OpFuzz(lambda dtypes, fp8: fuzz_muon_passes.muon_momentum_cases(dtypes),
                                fuzz_muon_passes.run_muon_momentum),
        "muon_apply": OpFuzz(lambda dtypes, fp8: fuzz_muon_passes.muon_apply_cases(dtypes),
                             fuzz_muon_passes.run_muon_apply),
        "moe_gate_up": OpFuzz(lambda dtypes, fp8: fuzz_moe.moe_gate_up_cases(dtypes), fuzz_moe.run_moe),
        "moe_down_combine": OpFuzz(lambda dtypes, fp8: fuzz_moe.moe_down_combine_cases(dtypes), fuzz_moe.run_moe),
        "rms_norm": OpFuzz(lambda dtypes, fp8: fuzz_model.rms_norm_cases(dtypes), fuzz_model.run_rms_norm),
        "rope": OpFuzz(lambda dtypes, fp8: fuzz_model.rope_cases(dtypes), fuzz_model.run_rope),
        **fuzz_loss.loss_fuzzers(OpFuzz),
    }
