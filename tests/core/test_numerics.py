"""The comparison helper vendors use against the reference: non-finite values must match, not slip through."""

import pytest
import torch
from polyaccel.testing.numerics import assert_close_to_reference

NAN, INF = float("nan"), float("inf")


def test_matching_values_and_specials_pass():
    ref = torch.randn(64, dtype=torch.float64)
    ref[3], ref[7] = NAN, -INF
    got = (ref * (1 + 1e-7)).float()
    assert_close_to_reference(got, ref, torch.float32)


@pytest.mark.parametrize("got", [NAN, INF, -INF, 2.5])
def test_a_wrong_value_where_the_reference_is_finite_fails(got):
    ref = torch.randn(16, dtype=torch.float64)
    actual = ref.clone()
    actual[5] = got if got != 2.5 else ref[5] + 2.5
    with pytest.raises(AssertionError, match="flat index 5"):
        assert_close_to_reference(actual, ref, torch.float64)


@pytest.mark.parametrize("special,got", [(NAN, 1.0), (INF, -INF), (INF, NAN), (-INF, 3.0)])
def test_a_finite_or_other_special_where_the_reference_is_non_finite_fails(special, got):
    ref = torch.randn(16, dtype=torch.float64)
    ref[9] = special
    actual = ref.clone()
    actual[9] = got
    with pytest.raises(AssertionError, match="flat index 9"):
        assert_close_to_reference(actual, ref, torch.float64)
