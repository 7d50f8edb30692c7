"""The owner's batched Newton-Schulz (``orthogonalize_many``): matrices whose blocks share a shape in the
wide orientation go to the op as one batch, and each result equals the reference's ``orthogonalized_update``
of that matrix alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from polyaccel.engines.zero import muon as zmuon
from polyaccel.ops.reference import muon as ref

# (shape, head split): six (64, 96) blocks (two whole matrices, a row-split and a column-split one of two
# blocks each) and their transpose (iterated as (64, 96) too) batched together, and one odd shape
MATRICES = [((64, 96), None), ((64, 96), None), ((128, 96), (0, 2)), ((64, 192), (1, 2)), ((96, 64), None),
            ((5, 7), None)]

# relative Frobenius bound against the one-matrix reference; for the 16-bit iterations it is well below the
# distance to an fp32 iteration of the same update (~2e-3 in fp16, ~1.5e-2 in bf16), so iterating in the
# wrong dtype fails
BOUNDS = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-4, torch.bfloat16: 1e-3}


def _settings(ns_dtype):
    return SimpleNamespace(ns_dtype=ns_dtype, ns_steps=5, ns_coefficients=ref.NS_COEFFICIENTS, eps=ref.NS_EPS)


@pytest.mark.parametrize("ns_dtype", list(BOUNDS), ids=str)
def test_each_matrix_equals_its_own_reference(ns_dtype):
    torch.manual_seed(0)  # the (5, 7) matrix's float16 distance (mm against bmm) reaches 5e-4 on some inputs
    us = [torch.randn(shape, dtype=torch.float64) for shape, _ in MATRICES]
    splits = [s for _, s in MATRICES]
    got = zmuon.orthogonalize_many(us, splits, _settings(ns_dtype))
    for (shape, split), u, g in zip(MATRICES, us, got, strict=True):
        want = ref.orthogonalized_update(u, split=split, ns_dtype=ns_dtype)
        assert g.shape == shape and g.dtype == torch.float64
        err = ((g - want).norm() / want.norm()).item()
        assert err <= BOUNDS[ns_dtype], (shape, split, ns_dtype, err)


def test_blocks_of_one_shape_share_one_call(monkeypatch):
    seen = []
    real = zmuon.ops.newton_schulz

    def recording(x, **kw):
        seen.append(tuple(x.shape))
        return real(x, **kw)

    monkeypatch.setattr(zmuon.ops, "newton_schulz", recording)
    us = [torch.randn(shape) for shape, _ in MATRICES]
    zmuon.orthogonalize_many(us, [s for _, s in MATRICES], _settings(torch.float32))
    assert sorted(seen) == sorted([(7, 64, 96), (1, 5, 7)])
