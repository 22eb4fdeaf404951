"""The cpu backend's exact paths against the reference, on inputs built to reach each path: ties inside
the selection, ties across the k-th value, NaN rows, too few candidates, K below the int_mm minimum."""

from __future__ import annotations

import pytest
import torch

from backends import SeqLayout
from backends.counters import REFERENCE_CALLS
from backends.cpu import _intmm, _select


def _rows(g: torch.Generator, r: int, c: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(r, c, generator=g).to(dtype)
    x[0] = torch.randint(-3, 3, (c,), generator=g).to(dtype)  # ties everywhere, across the cut too
    x[1, ::7] = float("nan")
    x[2, : c // 2] = float("-inf")  # -inf candidates tied at the cut
    x[3] = -0.0
    x[3, ::2] = 0.0  # one zero: index order only
    x[4, 1::3] = x[4, 0::3][: x[4, 1::3].shape[0]]  # pairs of equal values inside the selection
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_topk_paths_bitwise(cpu, ref, dtype, with_lengths):
    g = torch.Generator().manual_seed(1)
    x = _rows(g, 9, 4096, dtype)
    lengths = torch.tensor([4096, 3000, 100, 4096, 2500, 0, 2048, 2049, 1]) if with_lengths else None
    before = sum(REFERENCE_CALLS.values())
    got = cpu.topk(x, 2048, lengths)
    assert sum(REFERENCE_CALLS.values()) == before  # the reference never runs inside cpu ops
    want = ref.topk(x, 2048, lengths)
    assert torch.equal(got[1], want[1])
    assert torch.equal(
        got[0].view(torch.int16 if dtype != torch.float32 else torch.int32),
        want[0].view(torch.int16 if dtype != torch.float32 else torch.int32),
    )


def test_cut_tie_path_taken():
    """A row tied across the cut goes through `_cut_ties` and matches the rule's full order."""
    x = torch.tensor([[3.0, 1.0, 2.0, 1.0, 1.0, 0.0, 1.0]])
    vals, cols, taken = _select.topk_rows(x, 3)
    assert cols.tolist() == [[0, 2, 1]] and taken is None
    order = _select.rule_order(x, torch.ones_like(x, dtype=torch.bool))[:, :3]
    assert torch.equal(cols, order)


def test_order_key_is_the_rule():
    v = torch.tensor([[-0.0, 0.0, -1.0, float("inf"), float("-inf"), 2.5, 2.5, -2.0]])
    idx = torch.arange(8)[None]
    vals, cols = _select.sort_pairs(v, idx)
    assert cols.tolist() == [[3, 5, 6, 0, 1, 2, 7, 4]]


@pytest.mark.parametrize("k", [1, 7, 64])
def test_int_matmul_exact(k):
    g = torch.Generator().manual_seed(k)
    a = torch.randint(-127, 128, (9, k), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (5, k), generator=g, dtype=torch.int8)
    assert torch.equal(_intmm.int_matmul(a, b).to(torch.int64), a.long() @ b.long().T)


def test_indexer_topk_ties_and_chunks_bitwise(cpu, ref):
    """Several key chunks, a ReLU plateau of zero logits (structural ties) and causal rows."""
    g = torch.Generator().manual_seed(3)
    s, t, h_i, d = 5000, 40, 2, 16
    q = torch.randn(t, h_i, d, generator=g)
    q[:10] = -q[:10].abs()
    k = torch.randn(s, d, generator=g).abs()  # q[:10] . k < 0: all-zero logits for those rows
    w = torch.randn(t, h_i, generator=g)
    lay = SeqLayout.from_lengths([t], [s])
    assert torch.equal(cpu.indexer_topk(q, k, w, lay, 2048), ref.indexer_topk(q, k, w, lay, 2048))


def test_sparse_mla_return_lse_false(cpu):
    g = torch.Generator().manual_seed(4)
    q, kv = torch.randn(3, 2, 24, generator=g), torch.randn(4096, 24, generator=g)
    idx = torch.randint(0, 4096, (3, 2048), generator=g, dtype=torch.int32)
    lay = SeqLayout.from_lengths([3], [4096])
    out, lse = cpu.sparse_mla_attention(q, kv, idx, lay, 0.2, 16, return_lse=False)
    full, lse_full = cpu.sparse_mla_attention(q, kv, idx, lay, 0.2, 16)
    assert lse is None and torch.equal(out, full) and lse_full.shape == (3, 2)


def test_indexer_topk_rows_with_fewer_keys_than_topk(cpu, ref):
    """Full causal prefill: the first rows see fewer keys than topk (the -inf tie shortcut of `_merge`),
    one request paged with shuffled blocks."""
    g = torch.Generator().manual_seed(5)
    s = 2600
    q, w = torch.randn(s, 2, 16, generator=g), torch.randn(s, 2, generator=g)
    k = torch.randn(s // 8, 8, 16, generator=g)
    lay = SeqLayout.from_lengths(
        [s], [s], block_size=8, block_order=torch.randperm(s // 8, generator=g).tolist()
    )
    assert torch.equal(cpu.indexer_topk(q, k, w, lay, 512), ref.indexer_topk(q, k, w, lay, 512))
