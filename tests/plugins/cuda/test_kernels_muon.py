"""The cuda plugin's Triton newton_schulz and fused_muon under the interpreter: the ops' conformance checks on CPU
tensors, and matrices spanning several tiles (small tiles) against the reference's own 16-bit iteration."""

from __future__ import annotations

import pytest
import torch
from polyaccel.ops import reference as ref
from polyaccel.plugins.cuda.kernels import newton_schulz as kn
from polyaccel.testing.conformance import opcases_muon as om

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_newton_schulz_conformance_on_cpu_tensors(dtype):
    om.check_newton_schulz(kn.newton_schulz, CPU, dtype)


def test_fused_muon_conformance_on_cpu_tensors():
    om.check_fused_muon(kn.fused_muon, CPU, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(2, 40, 72), (3, 50, 33)], ids=str)  # wide, and tall (transposed in and out)
def test_several_tiles_match_the_reference(dtype, shape):
    """16-wide tiles: a 40- or 33-row wide side is 3 tile rows (6 upper-triangular tiles, ragged edges)."""
    cfg = kn.TileConfig(16, 16, 16, 1, 1, group_m=2)
    torch.manual_seed(0)
    x = torch.randn(shape).to(dtype)
    got = kn.newton_schulz(x, steps=5, coefficients=ref.muon.NS_COEFFICIENTS, eps=1e-7, config=cfg)
    assert got.shape == x.shape and got.dtype == dtype
    exact = ref.newton_schulz(x.double())
    same_dtype = ref.newton_schulz(x)
    err_exact = om.relative_errors(got, exact).max().item()
    err_same = om.relative_errors(got, same_dtype.double()).max().item()
    assert err_exact <= om.NS_BOUNDS[dtype], err_exact
    # the reference's iteration in the same dtype: only the rounding order of the products differs (a wrong or
    # missing tile is O(1) off)
    assert err_same <= om.NS_BOUNDS[dtype], err_same


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_batch_of_wide_blocks_gives_each_matrix_its_own_result(dtype):
    """ZeRO's Muon hands the op its blocks in the wide orientation, the transposes of tall blocks batched with
    wide blocks of that shape (engines/zero/muon.py). The iteration is per matrix: each result is, bit for bit,
    what the op gives the tall matrices alone (transposed inside the op) and the wide one alone."""
    cfg = kn.TileConfig(16, 16, 16, 1, 1, group_m=2)
    kw = {"steps": 2, "coefficients": ref.muon.NS_COEFFICIENTS, "eps": 1e-7, "config": cfg}
    torch.manual_seed(1)
    tall, wide = torch.randn(2, 40, 24).to(dtype), torch.randn(1, 24, 40).to(dtype)
    batch = torch.cat([tall.mT, wide])  # what orthogonalize_many builds
    got = kn.newton_schulz(batch, **kw)
    assert torch.equal(got[:2].mT, kn.newton_schulz(tall, **kw))
    assert torch.equal(got[2:], kn.newton_schulz(wide, **kw))
