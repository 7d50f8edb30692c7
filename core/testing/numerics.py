"""Numerical helpers: compare an op's result with the reference, with per-dtype bounds."""

from __future__ import annotations

import torch

#: relative tolerance per dtype for elementwise results computed in fp32 and stored in dtype
RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
#: absolute tolerance per dtype
ATOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    return RTOL.get(dtype, 1e-5), ATOL.get(dtype, 1e-6)


def assert_close_to_reference(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                              what: str = "result", rtol: float | None = None, atol: float | None = None):
    """Assert ``actual`` matches ``expected`` (compared in float64) within the bounds for ``dtype``.

    NaN and infinities must sit where the reference has them: a NaN against a finite value fails.
    """
    dtype = dtype or actual.dtype
    r, a = tolerances(dtype)
    rtol = r if rtol is None else rtol
    atol = a if atol is None else atol
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    x = actual.detach().to("cpu", torch.float64)
    y = expected.detach().to("cpu", torch.float64)
    if x.numel() == 0:
        return
    # a non-finite element must be the same non-finite value (NaN for NaN, the same infinity): NaN compares
    # false with every bound, so without this a NaN result would pass against a finite reference
    finite = torch.isfinite(x) & torch.isfinite(y)
    same_special = (torch.isnan(x) & torch.isnan(y)) | (torch.isinf(x) & (x == y))
    err = torch.where(finite, x - y, torch.zeros_like(x)).abs()
    bound = atol + rtol * torch.where(finite, y, torch.zeros_like(y)).abs()
    bad = (finite & (err > bound)) | (~finite & ~same_special)
    if bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {x.numel()} elements out of tolerance (rtol={rtol}, atol={atol}); "
            f"first at flat index {i}: got {x.reshape(-1)[i].item()!r}, expected {y.reshape(-1)[i].item()!r}; "
            f"max abs error {err.max().item():.3e}"
        )
