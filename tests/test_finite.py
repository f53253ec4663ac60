"""The fast finite check (hvd_slowmo/finite.py) against an element-by-element check."""

import pytest
import torch

from hvd_slowmo.finite import all_finite

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=str)
def test_one_bad_element_anywhere_is_found(dtype, bad):
    for n in (1, 7, 1000, 100003):
        for at in sorted({0, n // 2, n - 1}):
            t = torch.randn(n).to(dtype)
            t[at] = bad
            assert not all_finite([torch.ones(3, dtype=dtype), t]), (n, at)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_finite_tensors_pass_even_when_their_norm_overflows(dtype):
    huge = torch.finfo(dtype).max / 2
    tensors = [torch.full((1000,), huge, dtype=dtype), torch.randn(5).to(dtype)]
    assert not torch.stack(torch._foreach_norm(tensors, 2)).isfinite().all()  # the slow path
    assert all_finite(tensors)
    assert all_finite([torch.randn(100).to(dtype), torch.zeros(0, dtype=dtype)])
    assert all_finite([])


def test_mixed_dtypes_are_checked_per_group():
    assert all_finite([torch.randn(4), torch.randn(4, dtype=torch.float64)])
    assert not all_finite([torch.randn(4), torch.tensor([1.0, float("nan")], dtype=torch.float64)])
