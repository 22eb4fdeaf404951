"""The deterministic top-k rule (SPEC 2.3): hand cases, a numpy.lexsort oracle, metamorphic properties.

Semantics: backends/reference/topk.py (SPEC 2.3)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import backends
from backends.reference.topk import topk

INF, NAN = float("inf"), float("nan")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def lexsort_topk(x: torch.Tensor, k: int, lengths: list[int] | None = None) -> tuple[list, list]:
    """Oracle: per row, numpy.lexsort on (class: number < NaN < non-candidate, value desc, index asc)."""
    vals, idxs = [], []
    for r, row in enumerate(x.double().numpy()):
        c = row.shape[0]
        n = c if lengths is None else lengths[r]
        cls = np.where(np.arange(c) >= n, 2, np.where(np.isnan(row), 1, 0))
        neg = np.where(np.isnan(row), 0.0, -row)  # -(-0.0) == 0.0 compares equal to -(+0.0)
        order = np.lexsort((np.arange(c), neg, cls))[: min(k, n)]
        got = [int(i) for i in order] + [-1] * (k - min(k, n))
        idxs.append(got)
        vals.append([float(row[i]) if i >= 0 else -INF for i in got])
    return vals, idxs


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def same_values(a: list[float], b: list[float]) -> bool:
    return all((math.isnan(u) and math.isnan(v)) or u == v for u, v in zip(a, b, strict=True))


def test_hand_case_ties_nan_signed_zero_inf():
    x = torch.tensor([[1.0, 3.0, 3.0, -INF, NAN, -0.0, 0.0, 2.0]])
    vals, idx = topk(x, 8)
    assert idx.tolist() == [[1, 2, 7, 0, 5, 6, 3, 4]]
    assert vals[0, :7].tolist() == [3.0, 3.0, 2.0, 1.0, 0.0, 0.0, -INF]
    assert math.isnan(vals[0, 7].item())
    assert idx.dtype == torch.int32 and vals.dtype == x.dtype


@pytest.mark.parametrize("row", [[-0.0, 0.0], [0.0, -0.0]])
def test_signed_zeros_are_one_value(row):
    # a bit-pattern sort would put +0.0 first in the first row
    assert topk(torch.tensor([row]), 2)[1].tolist() == [[0, 1]]


def test_nan_ranks_below_minus_inf_and_keeps_index_order():
    x = torch.tensor([[NAN, -INF, NAN, -INF]])
    assert topk(x, 4)[1].tolist() == [[1, 3, 0, 2]]


def test_lengths_pad_with_minus_one_and_minus_inf():
    x = torch.tensor([[5.0, 1.0, 9.0, 2.0], [4.0, 4.0, 4.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    vals, idx = topk(x, 3, torch.tensor([2, 4, 0], dtype=torch.int32))
    assert idx.tolist() == [[0, 1, -1], [0, 1, 2], [-1, -1, -1]]
    assert vals.tolist() == [[5.0, 1.0, -INF], [4.0, 4.0, 4.0], [-INF, -INF, -INF]]


def test_k_larger_than_columns_and_empty_shapes():
    vals, idx = topk(torch.tensor([[2.0, 7.0]]), 4)
    assert idx.tolist() == [[1, 0, -1, -1]] and vals.tolist() == [[7.0, 2.0, -INF, -INF]]
    vals, idx = topk(torch.empty(2, 0), 3)
    assert idx.tolist() == [[-1] * 3] * 2 and vals.shape == (2, 3)
    vals, idx = topk(torch.empty(0, 5), 3)
    assert idx.shape == (0, 3) and vals.shape == (0, 3)


def test_large_all_tied_row_is_index_order():
    # torch.topk on CPU/CUDA gives no tie order; the rule must return 0..k-1 whatever the size
    x = torch.zeros(3, 20000)
    x[1, ::2] = -0.0
    vals, idx = topk(x, 700)
    assert torch.equal(idx, torch.arange(700, dtype=torch.int32).expand(3, -1))


values = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, 1e-3, -1e30, 65504.0, INF, -INF, NAN])


@st.composite
def rows(draw):
    r, c = draw(st.integers(0, 5)), draw(st.integers(0, 24))
    data = [[draw(st.one_of(values, st.floats(-100, 100, width=16))) for _ in range(c)] for _ in range(r)]
    lens = [draw(st.integers(0, c)) for _ in range(r)] if draw(st.booleans()) else None
    return data, c, lens, draw(st.integers(1, 30)), draw(st.sampled_from(DTYPES))


@settings(max_examples=150, deadline=None)
@given(rows())
def test_matches_lexsort_oracle(case):
    data, c, lens, k, dtype = case
    x = torch.tensor(data, dtype=torch.float32).reshape(len(data), c).to(dtype)
    lengths = None if lens is None else torch.tensor(lens, dtype=torch.int64)
    vals, idx = topk(x, k, lengths)
    want_vals, want_idx = lexsort_topk(x, k, lens)
    assert idx.tolist() == want_idx
    for got, want in zip(vals.double().tolist(), want_vals, strict=True):
        assert same_values(got, want)
    # every row alone gives the same row, bitwise (batch invariance)
    for r in range(x.shape[0]):
        v1, i1 = topk(x[r : r + 1], k, None if lengths is None else lengths[r : r + 1])
        assert torch.equal(i1[0], idx[r]) and torch.equal(bits(v1[0]), bits(vals[r]))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 45), st.randoms(use_true_random=False))
def test_column_permutation_keeps_selected_values(c, k, rnd):
    """Permuting columns maps indices through the permutation; the ordered values do not change."""
    gen = torch.Generator().manual_seed(rnd.randint(0, 2**31))
    x = torch.randint(-3, 3, (4, c), generator=gen).float()  # many ties
    perm = torch.randperm(c, generator=gen)
    v0, i0 = topk(x, k)
    v1, i1 = topk(x[:, perm], k)
    assert torch.equal(v0, v1)
    mapped = torch.where(i1 >= 0, perm[i1.clamp_min(0).long()].to(torch.int32), -1)
    assert torch.equal(x.gather(1, mapped.clamp_min(0).long()), x.gather(1, i0.clamp_min(0).long()))


def test_appending_non_candidate_columns_changes_nothing():
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(-4, 4, (6, 30), generator=gen).float()
    lengths = torch.randint(0, 31, (6,), generator=gen)
    wide = torch.cat([x, torch.full((6, 9), 99.0)], dim=1)  # larger than anything, but not candidates
    assert torch.equal(topk(x, 12, lengths)[1], topk(wide, 12, lengths)[1])


def test_run_to_run_bitwise():
    x = torch.randn(64, 3000).round(decimals=1)
    a, b = topk(x, 256), topk(x, 256)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_method_matches_function(dtype):
    x = torch.randn(5, 40).to(dtype)
    lengths = torch.tensor([0, 1, 17, 39, 40], dtype=torch.int32)
    got = backends.get("reference").topk(x, 8, lengths)
    want = topk(x, 8, lengths)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
