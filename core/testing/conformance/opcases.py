"""Per-op conformance cases: fresh random inputs, the builder under test on the device,
the core reference on the host, and a comparison with per-dtype tolerances.

Each ``check_<op>(fn, device, dtype)`` raises ``AssertionError`` with a message that
names the op, the input and the size of the error.
"""

from __future__ import annotations

import torch
from polyaccel.ops import reference as ref
from polyaccel.ops.reference.quantize import unpack_int4
from polyaccel.testing.numerics import assert_close_to_reference, tolerances

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: dtypes each op is defined for (the optimizers: fp32 math for 16-bit params, fp64 math for fp64 params)
OP_DTYPES = {
    "fused_adam": FLOATS,
    "fused_lion": FLOATS,
    "fused_lamb": FLOATS,
    "quantize": FLOATS,
    "dequantize": FLOATS,
    "swiglu": FLOATS,
    "weighted_swiglu": FLOATS,
    "grouped_mm": FLOATS,
    "gather_sum": FLOATS,
    "newton_schulz": FLOATS,  # checks in opcases_muon
    "fused_muon": FLOATS,
    "muon_momentum": FLOATS,  # checks in opcases_muon_passes
    "muon_apply": FLOATS,
    "moe_gate_up": FLOATS,  # checks in opcases_moe
    "moe_down_combine": FLOATS,
    "rms_norm": FLOATS,  # checks in opcases_model
    "rope": FLOATS,
    "linear_cross_entropy": FLOATS,  # checks in opcases_loss
    "logprobs": FLOATS,
    "entropy": FLOATS,
    "kl": FLOATS,
}
#: odd sizes, including zero-size tensors, for the multi-tensor ops
LIST_SHAPES = [(7,), (0,), (1,), (3, 5), (5, 0), (33,), (130,), (2, 3, 17), (1031,)]


def op_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """Ops compute in (at least) fp32, so float64 inputs get fp32 bounds."""
    return tolerances(torch.float32 if dtype == torch.float64 else dtype)


def _dev(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A private copy on ``device`` (``.to`` alone aliases when the device is the host)."""
    return t.to(device, copy=True)


def _close(actual, expected, dtype, what):
    rtol, atol = op_tolerances(dtype)
    assert_close_to_reference(actual, expected, dtype, what, rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------ optimizers
_OPT_ARGS = {
    "fused_adam": [dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adam_w_mode=True,
                        bias_correction=True),
                   dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.05, adam_w_mode=False,
                        bias_correction=False)],
    "fused_lion": [dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)],
    "fused_lamb": [dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, bias_correction=True)],
}
_STATE_COUNT = {"fused_adam": 2, "fused_lion": 1, "fused_lamb": 2}


def _opt_lists(op: str, dtype: torch.dtype, state_dtype: torch.dtype):
    params = [torch.randn(s).to(dtype) for s in LIST_SHAPES]
    states = []
    for k in range(_STATE_COUNT[op]):
        if k == 0:
            states.append([torch.randn(s).mul(0.1).to(state_dtype) for s in LIST_SHAPES])
        else:  # second moments are non-negative
            states.append([torch.rand(s).mul(0.01).to(state_dtype) for s in LIST_SHAPES])
    return params, states


def _grads(dtype):
    return [torch.randn(s).to(dtype) for s in LIST_SHAPES]


def check_optimizer(op: str, fn, device: torch.device, dtype: torch.dtype) -> None:
    reference = getattr(ref, op)
    # 16-bit params are checked with fp32 states and with states of their own dtype; fp32 and fp64
    # params keep states of their own dtype (what polyaccel.optim allocates)
    state_dtypes = [dtype] if dtype in (torch.float32, torch.float64) else [torch.float32, dtype]
    for state_dtype in state_dtypes:
        for kw in _OPT_ARGS[op]:
            params, states = _opt_lists(op, dtype, state_dtype)
            mine_p = [_dev(p, device) for p in params]
            mine_s = [[_dev(s, device) for s in lst] for lst in states]
            for step in (3, 4):
                grads = _grads(dtype)
                extra = {}
                if op != "fused_lion":
                    # a 0-d tensor step (as a captured graph passes it) on the second call
                    extra["step"] = step if step == 3 else torch.tensor(float(step), device=device)
                fn(mine_p, [_dev(g, device) for g in grads], *mine_s, **kw, **extra)
                ref_extra = {"step": step} if op != "fused_lion" else {}
                reference(params, grads, *states, **kw, **ref_extra)
            where = f"{op} params {dtype}, states {state_dtype}, {kw}"
            for i, (got, want) in enumerate(zip(mine_p, params, strict=True)):
                assert got.dtype == dtype, f"{where}: param {i} changed dtype to {got.dtype}"
                _close(got, want, dtype, f"{where}: param {i} shape {tuple(want.shape)}")
            # after the first step the states depend on the rounded 16-bit params (L2 decay adds wd * p
            # to the gradient), and one ulp of difference there is legitimate: judge them at the params' precision
            state_tol_dtype = dtype if dtype in (torch.float16, torch.bfloat16) else state_dtype
            for k, (got_l, want_l) in enumerate(zip(mine_s, states, strict=True)):
                for i, (got, want) in enumerate(zip(got_l, want_l, strict=True)):
                    _close(got, want, state_tol_dtype, f"{where}: state {k} of param {i} shape {tuple(want.shape)}")


# ------------------------------------------------------------------------------ quantize
#: (shape, mode, group_size, symmetric)
QUANT_CASES = [
    ((5, 24), "int8", 8, True), ((3, 7), "int8", 7, False), ((1, 256), "int8", 128, True),
    ((5, 24), "int4", 8, True), ((9, 6), "int4", 6, False), ((2, 128), "int4", 128, True),
]
FP8_CASES = [((5, 24), "fp8", 8, True), ((1, 256), "fp8", 128, True)]


def _codes(qt) -> torch.Tensor:
    data = qt.data.cpu()
    if qt.mode == "int4":
        return unpack_int4(data, signed=qt.symmetric).to(torch.int32)
    if qt.mode == "fp8":
        return data.float()
    return data.to(torch.int32)


def quant_cases(fp8: bool):
    return QUANT_CASES + (FP8_CASES if fp8 else [])


def check_quantize(fn, device: torch.device, dtype: torch.dtype, fp8: bool) -> None:
    for shape, mode, group, sym in quant_cases(fp8):
        x = (torch.randn(shape) * 3 + (0.5 if not sym else 0.0)).to(dtype)
        where = f"quantize {mode} {'sym' if sym else 'asym'} group {group} {dtype} shape {shape}"
        got = fn(_dev(x, device), mode=mode, group_size=group, symmetric=sym)
        want = ref.quantize(x, mode=mode, group_size=group, symmetric=sym)
        for field in ("mode", "group_size", "dtype"):
            assert getattr(got, field) == getattr(want, field), (
                f"{where}: {field} is {getattr(got, field)!r}, expected {getattr(want, field)!r}")
        assert tuple(got.shape) == tuple(want.shape), f"{where}: shape {got.shape} != {want.shape}"
        assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape, (
            f"{where}: data is {got.data.dtype}{tuple(got.data.shape)}, expected "
            f"{want.data.dtype}{tuple(want.data.shape)} (the wire format is fixed)")
        assert got.scales.dtype == torch.float32, f"{where}: scales must be float32, got {got.scales.dtype}"
        assert_close_to_reference(got.scales, want.scales, torch.float32, f"{where}: scales", rtol=1e-6, atol=1e-12)
        assert (got.zero_points is None) == (want.zero_points is None), f"{where}: zero points presence differs"
        if want.zero_points is not None:
            dz = (got.zero_points.cpu().to(torch.int32) - want.zero_points.to(torch.int32)).abs().max()
            assert int(dz) <= 1, f"{where}: zero points differ by {int(dz)}"
        cg, cw = _codes(got), _codes(want)
        if mode == "fp8":
            bound = cw.abs() * 0.125 + 2.0 ** -6
            bad = ((cg - cw).abs() > bound).sum()
            assert int(bad) == 0, f"{where}: {int(bad)} fp8 codes differ by more than one step"
        else:
            diff = int((cg - cw).abs().max())
            assert diff <= 1, f"{where}: integer codes differ from the reference by up to {diff} (allowed: 1)"
        # the builder's own round trip must stay within one quantization step of the input
        deq = ref.dequantize(_to_host(got), dtype=torch.float32).reshape(-1, group)
        scale = got.scales.cpu()[:, None]
        xg = x.float().reshape(-1, group)
        if mode == "fp8":
            bound = xg.abs() * 0.0625 * (1 + 1e-3) + scale * 2.0 ** -6
        else:
            bound = scale * (0.5 if sym else 1.0) * (1 + 1e-3) + 1e-6
        err = (deq - xg).abs()
        assert bool((err <= bound).all()), (
            f"{where}: dequantize(quantize(x)) is off by up to {float(err.max()):.4g}, more than one step")


def _to_host(qt):
    return ref.QuantizedTensor(qt.data.cpu(), qt.scales.cpu(),
                               None if qt.zero_points is None else qt.zero_points.cpu(), qt.mode, qt.group_size,
                               qt.shape, qt.dtype)


def _to_device(qt, device):
    return ref.QuantizedTensor(_dev(qt.data, device), _dev(qt.scales, device),
                               None if qt.zero_points is None else _dev(qt.zero_points, device), qt.mode,
                               qt.group_size, qt.shape, qt.dtype)


def check_dequantize(fn, device: torch.device, dtype: torch.dtype, fp8: bool) -> None:
    for shape, mode, group, sym in quant_cases(fp8):
        x = (torch.randn(shape) * 2).to(dtype)
        qt = ref.quantize(x, mode=mode, group_size=group, symmetric=sym)
        where = f"dequantize {mode} {'sym' if sym else 'asym'} group {group} {dtype} shape {shape}"
        for out_dtype in (None, torch.float32):
            got = fn(_to_device(qt, device), dtype=out_dtype)
            want = ref.dequantize(qt, dtype=out_dtype)
            expect_dtype = out_dtype or dtype
            assert got.dtype == expect_dtype, f"{where}: result dtype {got.dtype}, expected {expect_dtype}"
            _close(got, want, expect_dtype, f"{where} -> {expect_dtype}")


# -------------------------------------------------------------------------------- swiglu
SWIGLU_SHAPES = [(3, 5), (0, 7), (129,), (2, 3, 17)]


def check_swiglu(fn, device: torch.device, dtype: torch.dtype) -> None:
    for shape in SWIGLU_SHAPES:
        gate, up, grad = (torch.randn(shape).to(dtype) for _ in range(3))
        where = f"swiglu {dtype} shape {shape}"
        g_d = _dev(gate, device).requires_grad_(True)
        u_d = _dev(up, device).requires_grad_(True)
        out = fn(g_d, u_d)
        assert out.shape == gate.shape and out.dtype == dtype, f"{where}: got {out.dtype}{tuple(out.shape)}"
        out.backward(_dev(grad, device))
        g_r, u_r = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
        want = ref.swiglu(g_r, u_r)
        want.backward(grad)
        _close(out, want, dtype, f"{where}: forward")
        assert g_d.grad is not None and u_d.grad is not None, f"{where}: backward produced no gradient"
        _close(g_d.grad, g_r.grad, dtype, f"{where}: d gate")
        _close(u_d.grad, u_r.grad, dtype, f"{where}: d up")


#: (rows, F, the inputs as the two halves of one [rows, 2F] tensor, weights in float32 rather than the
#: inputs' dtype): F over one column block of the kernels. The float32 weights (their own compile on a GPU)
#: are taken by some cases, the long rows among them, not by every case (benchmarks/conformance_compiles.py)
WEIGHTED_SWIGLU_CASES = [(3, 5, False, False), (0, 7, False, True), (37, 1100, True, True),
                         (6, 33, True, False), (1, 1, False, True)]


def check_weighted_swiglu(fn, device: torch.device, dtype: torch.dtype) -> None:
    rtol, atol = op_tolerances(dtype)
    for n, f, halves, fp32_weights in WEIGHTED_SWIGLU_CASES:
        w_dtype = torch.float32 if fp32_weights else dtype
        h, grad = torch.randn(n, 2 * f).to(dtype), torch.randn(n, f).to(dtype)
        weights = torch.rand(n).to(w_dtype) + 0.5
        halves_note = " (halves of one tensor)" if halves else ""
        where = f"weighted_swiglu {dtype} rows {n} F {f} weights {w_dtype}{halves_note}"
        h_d = _dev(h, device).requires_grad_(True)
        w_d = _dev(weights, device).requires_grad_(True)
        if halves:
            g_d, u_d = h_d.chunk(2, dim=-1)
        else:
            g_d = h_d[:, :f].detach().contiguous().requires_grad_(True)
            u_d = h_d[:, f:].detach().contiguous().requires_grad_(True)
        out = fn(g_d, u_d, w_d)
        assert out.shape == (n, f) and out.dtype == dtype, f"{where}: got {out.dtype}{tuple(out.shape)}"
        out.backward(_dev(grad, device))
        g_r = h[:, :f].double().requires_grad_(True)
        u_r = h[:, f:].double().requires_grad_(True)
        w_r = weights.double().requires_grad_(True)
        want = ref.weighted_swiglu(g_r, u_r, w_r)
        want.backward(grad.double())
        _close(out, want, dtype, f"{where}: forward")
        d_gate, d_up = (h_d.grad.chunk(2, dim=-1) if halves else (g_d.grad, u_d.grad))
        assert d_gate is not None and d_up is not None and w_d.grad is not None, (
            f"{where}: backward produced no gradient")
        _close(d_gate, g_r.grad, dtype, f"{where}: d gate")
        _close(d_up, u_r.grad, dtype, f"{where}: d up")
        assert w_d.grad.dtype == w_dtype, f"{where}: d weights is {w_d.grad.dtype}, expected {w_dtype}"
        if n:  # a sum over F: bounded relative to the sum of its terms' magnitudes, not to the cancelled sum
            g = h[:, :f].double()
            mag = (grad.double().abs() * (g * torch.sigmoid(g)).abs() * h[:, f:].double().abs()).sum(1)
            err = (w_d.grad.detach().cpu().double() - w_r.grad).abs()
            worst = float((err - (atol + rtol * mag)).max())
            assert worst <= 0, f"{where}: d weights error exceeds the bound by {worst:.3e}"


# ---------------------------------------------------------------------------- grouped_mm
#: (rows per expert, tail rows past the last offset, in features, out features). The first and third share one
#: compile on a GPU (no size or stride a multiple of 16); the last is the aligned K with one output column
GROUPED_CASES = [([5, 0, 11, 3], 2, 24, 11), ([0, 0, 0], 0, 8, 3), ([1, 6], 0, 33, 7), ([0, 4, 0], 3, 16, 1)]


def check_grouped_mm(fn, device: torch.device, dtype: torch.dtype) -> None:
    rtol, atol = op_tolerances(dtype)
    for counts, tail, k, n in GROUPED_CASES:
        for off_dtype in (torch.int64, torch.int32):
            rows = sum(counts) + tail
            x = torch.randn(rows, k).to(dtype)
            w = torch.randn(len(counts), k, n).to(dtype)
            offsets = torch.tensor(counts).cumsum(0).to(off_dtype)
            where = f"grouped_mm {dtype} rows/expert {counts} tail {tail} K={k} N={n} offsets {off_dtype}"
            got = fn(_dev(x, device), _dev(w, device), _dev(offsets, device))
            assert got.shape == (rows, n) and got.dtype == dtype, f"{where}: got {got.dtype}{tuple(got.shape)}"
            want = ref.grouped_mm(x.double(), w.double(), offsets)
            # dot-product error bound: relative to sum |x||w|, not to the (possibly cancelled) result
            mag = ref.grouped_mm(x.double().abs(), w.double().abs(), offsets)
            err = (got.detach().cpu().double() - want).abs()
            bound = atol + rtol * mag
            if rows:
                worst = float((err - bound).max())
                assert worst <= 0, f"{where}: error exceeds the bound by {worst:.3e} (max error {float(err.max()):.3e})"
            assert bool((got.detach().cpu()[rows - tail:] == 0).all()), f"{where}: rows past the last offset not zero"


# ---------------------------------------------------------------------------- gather_sum
#: (tokens, k, H, weighted: both / True / False): one slot, several, a row longer than one block of columns,
#: no tokens. Weighted and unweighted are two compiles on a GPU each: both for the first case, one each for
#: the others (one slot, the long row and the weights' gradient over its blocks weighted; many slots
#: unweighted). The first case's k and H are an expert-op case's (opcases_moe), whose combine compiles the
#: same kernels
GATHER_SUM_CASES = [(9, 2, 33, None), (5, 1, 3, True), (6, 3, 1100, True), (4, 8, 5, False), (0, 2, 4, None)]


def check_gather_sum(fn, device: torch.device, dtype: torch.dtype) -> None:
    for T, k, H, only in GATHER_SUM_CASES:
        for weighted in (True, False) if only is None else (only,):
            rows, grad = torch.randn(T * k, H).to(dtype), torch.randn(T, H).to(dtype)
            index = torch.randperm(T * k).view(T, k)
            weights = torch.rand(T, k).to(dtype) if weighted else None
            where = f"gather_sum {dtype} tokens {T} k {k} H {H} {'weighted' if weighted else 'unweighted'}"
            r_d = _dev(rows, device).requires_grad_(True)
            w_d = _dev(weights, device).requires_grad_(True) if weighted else None
            out = fn(r_d, _dev(index, device), w_d)
            assert out.shape == (T, H) and out.dtype == dtype, f"{where}: got {out.dtype}{tuple(out.shape)}"
            out.backward(_dev(grad, device))
            r_r = rows.to(torch.float64, copy=True).requires_grad_(True)
            w_r = weights.to(torch.float64, copy=True).requires_grad_(True) if weighted else None
            want = ref.gather_sum(r_r, index, w_r)
            want.backward(grad.double())
            _close(out, want, dtype, f"{where}: forward")
            assert r_d.grad is not None, f"{where}: backward produced no gradient for rows"
            _close(r_d.grad, r_r.grad, dtype, f"{where}: d rows")
            if weighted:
                assert w_d.grad is not None, f"{where}: backward produced no gradient for weights"
                # a dot product over H: bounded relative to sum |rows||grad|, not to the (cancelled) result
                rtol, atol = op_tolerances(dtype)
                per_slot = rows.double().abs()[index.reshape(-1)].view(T, k, H)
                mag = (per_slot * grad.double().abs().unsqueeze(1)).sum(-1)
                err = (w_d.grad.detach().cpu().double() - w_r.grad).abs()
                if T:
                    worst = float((err - (atol + rtol * mag)).max())
                    assert worst <= 0, f"{where}: d weights error exceeds the bound by {worst:.3e}"
