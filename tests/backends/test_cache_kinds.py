"""The cache kind picks the kernel at the front door (SPEC 7.9): a uint8 cache of FP8 rows given to
`sparse_mla_attention` / `indexer_topk` is served by the backend's entry for that kind (its FP8 kernel, with
its own caps), refused with the kind named by a backend that does not list it, inference only, and
shadow-checked against the reference's entry for the same kind."""

from __future__ import annotations

import pytest
import torch

import backends
from backends import Backend, NotSupported, OpCaps, OpImpl, SeqLayout
from backends.cache_layout import cache_kind
from backends.caps import by_kind
from backends.contract.ops import FLOATS
from backends.formats import index_cache_of
from backends.reference.fp8_mla_cache_quant import fp8_mla_cache_quant
from backends.reference.sparse_mla_attention import sparse_mla_attention as reference_attention


def _attention_inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 576, generator=g).bfloat16()
    rows = fp8_mla_cache_quant((torch.randn(10, 576, generator=g) / 10).bfloat16())
    idx = torch.tensor([[0, 1, 2], [3, 4, -1], [5, 9, 8]], dtype=torch.int32)
    return q, rows, idx, SeqLayout.from_lengths([3], [10])


def _indexer_inputs():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(3, 4, 32, generator=g).bfloat16(), torch.randn(10, 32, generator=g).bfloat16()
    return q, index_cache_of(k), torch.rand(3, 4, generator=g), SeqLayout.from_lengths([3], [10])


def test_the_kind_of_a_cache():
    q, rows, idx, lay = _attention_inputs()
    args = dict(q=q, kv_cache=rows, indices=idx, layout=lay)
    assert cache_kind(args) == "fp8_ragged"
    assert (
        cache_kind(
            args
            | {"kv_cache": rows.view(5, 2, 656), "layout": SeqLayout.from_lengths([3], [10], block_size=2)}
        )
        == "fp8_paged"
    )
    assert cache_kind(args | {"kv_cache": torch.zeros(10, 576)}) == "ragged"


@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_fp8_rows_take_the_backends_fp8_kernel(name):
    be = backends.get(name)
    q, rows, idx, lay = _attention_inputs()
    before = be.calls["fp8_sparse_mla_attention"]
    got = be.sparse_mla_attention(q, rows, idx, lay, 0.1, 512)
    want = be.fp8_sparse_mla_attention(q, rows, idx, lay, 0.1, 512)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert be.calls["fp8_sparse_mla_attention"] == before + 1  # only the direct call: one route each
    qi, cache, w, lay = _indexer_inputs()
    assert be.indexer_topk(qi, cache, w, lay, 4).shape == (3, 4)


def test_a_kind_answers_with_its_own_caps():
    """The kind's entry, not the op's, says which dtypes and limits it serves."""

    def fp8_only_f32(q, kv_cache, indices, layout, sm_scale, d_v, return_lse=True):
        return reference_attention(q, kv_cache, indices, layout, sm_scale, d_v, return_lse)

    class Narrow(Backend):
        name = "narrow"
        ops = {
            "sparse_mla_attention": by_kind(
                OpImpl(reference_attention, OpCaps(FLOATS, ("ragged", "paged"))),
                {"fp8_ragged": OpImpl(fp8_only_f32, OpCaps(("float32",), ("fp8_ragged",)))},
            )
        }

    be = Narrow()
    assert be.capabilities("sparse_mla_attention").layouts == ("ragged", "paged", "fp8_ragged")
    q, rows, idx, lay = _attention_inputs()
    with pytest.raises(NotSupported, match=r"dtype bfloat16 not in supported \['float32'\]"):
        be.sparse_mla_attention(q, rows, idx, lay, 0.1, 512)
    paged = SeqLayout.from_lengths([3], [10], block_size=2)
    with pytest.raises(NotSupported, match=r"fp8_paged cache layout not in supported"):
        be.sparse_mla_attention(q.float(), rows.view(5, 2, 656), idx, paged, 0.1, 512)


def test_a_backend_without_the_kind_refuses_it_naming_the_kind():
    from tests.runtime._fakes import NoReadBackend

    be = NoReadBackend()
    q, rows, idx, lay = _attention_inputs()
    with pytest.raises(NotSupported, match=r"fp8_ragged cache layout not in supported \['ragged', 'paged'\]"):
        be.sparse_mla_attention(q, rows, idx, lay, 0.1, 512)
    qi, cache, w, lay = _indexer_inputs()
    with pytest.raises(NotSupported, match=r"fp8_ragged cache layout not in supported"):
        be.indexer_topk(qi, cache, w, lay, 4)


def test_fp8_kinds_are_inference_only_and_validated():
    ref = backends.get("reference")
    q, rows, idx, lay = _attention_inputs()
    with pytest.raises(NotSupported, match="on a fp8_ragged cache is inference only"):
        ref.sparse_mla_attention(q.requires_grad_(), rows, idx, lay, 0.1, 512)
    with pytest.raises(ValueError, match=r"^q: expected shape \[T, H, 576\]"):
        ref.sparse_mla_attention(q.detach()[..., :64], rows, idx, lay, 0.1, 32)
    qi, cache, w, lay = _indexer_inputs()
    with pytest.raises(ValueError, match=r"^k_cache: expected last dim 36"):
        ref.indexer_topk(qi, cache[:, :30], w, lay, 4)


def test_shadow_mode_compares_the_same_kind(monkeypatch):
    monkeypatch.setenv("GLM5_VALIDATE", "reference")
    cpu = type(backends.get("cpu"))()
    assert cpu.shadow
    q, rows, idx, lay = _attention_inputs()
    cpu.sparse_mla_attention(q, rows, idx, lay, 0.1, 512)  # raises ShadowMismatch on a difference
    qi, cache, w, lay = _indexer_inputs()
    cpu.indexer_topk(qi, cache, w, lay, 4)
