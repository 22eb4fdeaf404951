"""Indexer top-k (SPEC 2.2): the chunked reference against `topk` of `indexer_logits` and against
`indexer_topk_naive`, with more keys than topk, paged and ragged, shuffled block tables, ties across
key chunks, and the structural invariants of its output under fuzzed layouts.

Semantics: backends/reference/indexer_topk.py (SPEC 2.2)
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import backends
from backends.reference.indexer_logits import indexer_logits
from backends.reference.indexer_topk import indexer_topk, indexer_topk_naive
from backends.reference.topk import topk
from tests.backends.reference._cases import batches, int_valued, pack, visible_counts

# the package re-exports the function under the module's name, so `import ... as` would give the function
ref_mod = importlib.import_module("backends.reference.indexer_topk")


def make(q_lens, k_lens, h_i=2, d_i=8, seed=0, ints=False, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    t = sum(q_lens)
    if ints:  # exact dots: many real ties, identical on every backend
        q = int_valued((t, h_i, d_i), gen, dtype=dtype)
        keys = [int_valued((s, d_i), gen, -1, 2, dtype=dtype) for s in k_lens]
        w = int_valued((t, h_i), gen, 1, 3)
    else:
        q = torch.randn(t, h_i, d_i, generator=gen).to(dtype)
        keys = [torch.randn(s, d_i, generator=gen).to(dtype) for s in k_lens]
        w = torch.randn(t, h_i, generator=gen)
    return q, keys, w


def oracle(q, cache, w, layout, q_lens, k_lens, k):
    """`topk` of `indexer_logits` over the causal keys, lengths from the test's own causality rule."""
    logits = indexer_logits(q, cache, w, layout)
    lengths = torch.tensor(visible_counts(q_lens, k_lens), dtype=torch.int64)
    return topk(logits, k, lengths)[1]


def check_invariants(idx: torch.Tensor, q_lens, k_lens, k: int) -> None:
    """Causal, distinct, exactly min(k, visible) entries, -1 only at the tail."""
    assert idx.dtype == torch.int32 and idx.shape == (sum(q_lens), k)
    for row, vis in zip(idx.tolist(), visible_counts(q_lens, k_lens), strict=True):
        n = min(k, vis)
        assert all(0 <= j < vis for j in row[:n]), row
        assert row[n:] == [-1] * (k - n)
        assert len(set(row[:n])) == n


def test_hand_case():
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [1.0, -1.0]]])
    keys = torch.tensor([[1.0, 2.0], [-1.0, 3.0], [2.0, -2.0]])
    w = torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    cache, layout = pack([keys], [2], block_size=2)
    # logits [[5, 6, -inf], [1.5, 1.0, -4]]
    assert indexer_topk(q, cache, w, layout, 2).tolist() == [[1, 0], [0, 1]]
    assert indexer_topk(q, cache, w, layout, 4).tolist() == [[1, 0, -1, -1], [0, 1, 2, -1]]


@pytest.fixture
def small_chunks(monkeypatch):
    """Force several key chunks and query blocks on CPU-sized inputs."""
    monkeypatch.setattr(ref_mod, "KEY_CHUNK", 37)
    monkeypatch.setattr(ref_mod, "QUERY_BLOCK", 5)


@pytest.mark.parametrize("ints", [False, True])
@pytest.mark.parametrize("block_size", [None, 1, 7, 64])
def test_matches_oracle_more_keys_than_topk(small_chunks, ints, block_size):
    q_lens, k_lens, k = [9, 1, 12, 3], [300, 181, 12, 2], 64  # prefill chunk, decode, T==S, T>S
    q, keys, w = make(q_lens, k_lens, ints=ints, seed=block_size or 0)
    cache, layout = pack(keys, q_lens, block_size=block_size, seed=11)
    got = indexer_topk(q, cache, w, layout, k)
    assert torch.equal(got, oracle(q, cache, w, layout, q_lens, k_lens, k))
    assert torch.equal(got, indexer_topk_naive(q, cache, w, layout, k))
    check_invariants(got, q_lens, k_lens, k)


def test_ties_across_chunk_boundaries_keep_lower_index(small_chunks):
    # every key equal: the answer is 0..k-1 for every query, whichever chunk a key falls in
    q = torch.ones(4, 2, 4)
    keys = torch.ones(200, 4)
    w = torch.ones(4, 2)
    cache, layout = pack([keys], [4], block_size=9)
    got = indexer_topk(q, cache, w, layout, 50)
    assert torch.equal(got, torch.arange(50, dtype=torch.int32).expand(4, -1))
    # the maximum repeated at the end of every chunk: its copies come out in index order first
    keys[36::37] = 2.0
    cache, layout = pack([keys], [4], block_size=9)
    got = indexer_topk(q, cache, w, layout, 8)
    assert got[0].tolist() == [36, 73, 110, 147, 184, 0, 1, 2]


def test_default_chunk_size_with_more_keys_than_a_chunk():
    q_lens, k_lens, k = [2, 1], [2100, 2049], 64  # crosses KEY_CHUNK = 2048 with the real constants
    q, keys, w = make(q_lens, k_lens, ints=True, d_i=4)
    cache, layout = pack(keys, q_lens, block_size=13)
    got = backends.get("reference").indexer_topk(q, cache, w, layout, k)
    assert torch.equal(got, oracle(q, cache, w, layout, q_lens, k_lens, k))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(small_chunks, dtype):
    q_lens, k_lens = [5, 3], [120, 90]
    q, keys, w = make(q_lens, k_lens, dtype=dtype, seed=4)
    cache, layout = pack(keys, q_lens, block_size=16)
    got = indexer_topk(q, cache, w, layout, 32)
    assert torch.equal(got, oracle(q, cache, w, layout, q_lens, k_lens, 32))


def test_metamorphic_layout_batch_and_nan_filler(small_chunks):
    q_lens, k_lens, k = [6, 4, 2], [150, 4, 90], 40
    q, keys, w = make(q_lens, k_lens, seed=8)
    ragged = indexer_topk(q, *_args(pack(keys, q_lens, fill=0.0), w), k)
    paged_nan = indexer_topk(q, *_args(pack(keys, q_lens, block_size=5, seed=2), w), k)
    paged_junk = indexer_topk(q, *_args(pack(keys, q_lens, block_size=5, seed=2, fill=1e30), w), k)
    assert torch.equal(ragged, paged_nan) and torch.equal(paged_nan, paged_junk)
    q0 = 0
    for b, t_b in enumerate(q_lens):  # a request alone == the same request in a batch
        sl = slice(q0, q0 + t_b)
        alone = indexer_topk(q[sl], *_args(pack([keys[b]], [t_b], block_size=3, seed=b), w[sl]), k)
        assert torch.equal(alone, ragged[sl])
        q0 += t_b


def _args(cache_layout, w):
    return cache_layout[0], w, cache_layout[1]


def test_topk_larger_than_keys_returns_all_in_rule_order(small_chunks):
    q_lens, k_lens = [3], [20]
    q, keys, w = make(q_lens, k_lens, ints=True, seed=5)
    cache, layout = pack(keys, q_lens)
    got = indexer_topk(q, cache, w, layout, 64)
    check_invariants(got, q_lens, k_lens, 64)
    assert torch.equal(got, oracle(q, cache, w, layout, q_lens, k_lens, 64))


@settings(max_examples=60, deadline=None)
@given(batches(max_q=6, max_k=60), st.integers(1, 24), st.booleans(), st.sampled_from([3, 16, 2048]))
def test_fuzz_equals_naive_and_invariants(case, k, ints, chunk):
    q_lens, k_lens = case["q_lens"], case["k_lens"]
    q, keys, w = make(q_lens, k_lens, h_i=2, d_i=4, seed=case["seed"], ints=ints)
    cache, layout = pack(keys, q_lens, block_size=case["block_size"], seed=case["seed"], d=4)
    old = ref_mod.KEY_CHUNK, ref_mod.QUERY_BLOCK
    ref_mod.KEY_CHUNK, ref_mod.QUERY_BLOCK = chunk, max(1, chunk // 3)
    try:
        got = backends.get("reference").indexer_topk(q, cache, w, layout, k)
    finally:
        ref_mod.KEY_CHUNK, ref_mod.QUERY_BLOCK = old
    check_invariants(got, q_lens, k_lens, k)
    assert torch.equal(got, indexer_topk_naive(q, cache, w, layout, k))
    assert torch.equal(got, oracle(q, cache, w, layout, q_lens, k_lens, k))


def test_never_scores_more_than_one_chunk_at_a_time(small_chunks, monkeypatch):
    """SPEC 2.2 memory rule, structurally: every scoring call sees <= QUERY_BLOCK x KEY_CHUNK."""
    seen = []
    real = ref_mod.score_block

    def spy(q, keys, weights):
        seen.append((q.shape[0], keys.shape[0]))
        return real(q, keys, weights)

    monkeypatch.setattr(ref_mod, "score_block", spy)
    q_lens, k_lens = [12, 2], [300, 100]
    q, keys, w = make(q_lens, k_lens, seed=2)
    cache, layout = pack(keys, q_lens, block_size=8)
    got = indexer_topk(q, cache, w, layout, 16)
    assert torch.equal(got, indexer_topk_naive(q, cache, w, layout, 16))
    assert seen and max(t for t, _ in seen) <= 5 and max(s for _, s in seen) <= 37
    assert sum(s for t, s in seen if t == 5) >= 300  # the whole causal range was still scored
