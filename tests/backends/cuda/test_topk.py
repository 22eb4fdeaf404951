"""cuda topk (SPEC 2.3): the threshold-select kernel against the reference rule, bitwise.

What is specific to this kernel: the running buffer's compaction path (rows longer than the buffer, and
ascending rows where every column survives the threshold filter), exact ties decided across buffer
compactions, NaN / -0.0 / -inf keys, `lengths`, k > columns, determinism and batch invariance.
Semantics: backends/reference/topk.py (SPEC 2.3)
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends import NotSupported
from backends.reference.topk import topk as ref_topk
from kernels_cuda.topk import MAX_K
from tests.backends.cuda.conftest import skip_bf16_interpreted


def assert_same(got, want) -> None:
    """Indices equal; values bitwise equal (so -0.0 stays -0.0 and NaN positions match)."""
    (v, i), (rv, ri) = got, want
    assert i.dtype == torch.int32 and v.dtype == rv.dtype
    assert torch.equal(i.cpu(), ri), (i, ri)
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[v.dtype]
    assert torch.equal(v.cpu().view(bits), rv.view(bits))


def run(cuda, device, x, k, lengths=None):
    got = cuda.topk(x.to(device), k, None if lengths is None else lengths.to(device))
    return got, ref_topk(x, k, lengths)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_random_rows_more_columns_than_k(cuda, device, launches, dtype):
    skip_bf16_interpreted(dtype)
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert_same(*run(cuda, device, x, 48))
    assert launches()["topk"] == 1


def test_ties_nan_signed_zero_and_infinities(cuda, device):
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(-2, 3, (4, 257), generator=gen).float()  # 5 distinct values: ties everywhere
    x[0, ::7] = float("nan")
    x[1, ::3] = -0.0
    x[2, 5::11] = float("-inf")
    x[2, 9::13] = float("inf")
    x[3] = float("nan")  # a row of NaN only: ranks by index
    for k in (1, 16, 64, 257):
        assert_same(*run(cuda, device, x, k))


def test_lengths_padding_and_k_beyond_columns(cuda, device):
    x = torch.randn(6, 90, generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([0, 1, 17, 64, 89, 90], dtype=torch.int32)
    assert_same(*run(cuda, device, x, 64, lengths))
    assert_same(*run(cuda, device, x, 100, lengths.to(torch.int64)))  # k > C: -1 / -inf tail


@pytest.mark.parametrize("order", ["ascending", "descending", "constant"])
def test_compaction_paths(cuda, device, order):
    """Ascending rows defeat the threshold filter (every column is appended, many compactions); constant
    rows make every compaction a pure tie-break by index."""
    c = 1000
    base = torch.arange(c, dtype=torch.float32)
    row = {"ascending": base, "descending": -base, "constant": torch.zeros(c)}[order]
    x = torch.stack([row, row.flip(0), row.roll(333)])
    assert_same(*run(cuda, device, x, 24))


def test_deterministic_and_batch_invariant(cuda, device):
    x = torch.randint(-3, 4, (7, 200), generator=torch.Generator().manual_seed(4)).to(torch.float16)
    a = cuda.topk(x.to(device), 32)
    b = cuda.topk(x.to(device), 32)
    alone = cuda.topk(x[3:4].to(device), 32)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])
    assert torch.equal(a[1][3:4], alone[1])


def test_k_above_limit_is_declined_with_reason(cuda, device):
    with pytest.raises(NotSupported, match=f"k={MAX_K + 1} > {MAX_K}"):
        cuda.topk(torch.zeros(1, 4, device=device), MAX_K + 1)


def test_non_contiguous_rows(cuda, device):
    x = torch.randn(40, 6, generator=torch.Generator().manual_seed(5)).t()  # [6, 40], column stride != 1
    assert_same(*run(cuda, device, x, 16))


@settings(max_examples=12, deadline=None)
@given(
    r=st.integers(1, 3),
    c=st.integers(1, 120),
    k=st.integers(1, 40),
    lo=st.integers(-3, 0),
    seed=st.integers(0, 2**16),
    with_len=st.booleans(),
)
def test_matches_reference_fuzzed(cuda, device, r, c, k, lo, seed, with_len):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(lo, 3, (r, c), generator=gen).float()
    x[torch.rand(r, c, generator=gen) < 0.05] = float("nan")
    lengths = torch.randint(0, c + 1, (r,), generator=gen) if with_len else None
    assert_same(*run(cuda, device, x, k, lengths))
