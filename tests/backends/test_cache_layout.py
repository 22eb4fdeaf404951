"""A backend's paged MLA cache layout (backends/cache_layout.py, SPEC 2.4): the declaration, the split-pool
pair the reference reads as the one tensor, validation of both, and KVCache allocating what the backend
declares."""

from __future__ import annotations

import pytest
import torch

import backends
from backends import NotSupported, SeqLayout
from backends.cache_layout import MLACacheLayout, MLAPools, write_rows
from backends.contract import library
from glm5.generate import generate
from tests.glm5._util import make_model, random_ids

C, R = 32, 16


def _inputs(block_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    lay = SeqLayout.from_lengths([2, 1], [20, 9], block_size=block_size, block_order=[5, 0, 3, 1, 7, 2, 4, 6])
    kv = torch.randn(8, block_size, C + R, generator=g)
    q = torch.randn(3, 4, C + R, generator=g)
    idx = torch.randint(-1, 12, (3, 8), generator=g, dtype=torch.int32)
    return q, kv, idx, lay


def _pools(kv: torch.Tensor) -> MLAPools:
    pools = MLACacheLayout(split=(C, R)).view(torch.full_like(kv, float("nan")), kv.shape[1])
    write_rows(pools, torch.arange(kv.shape[:2].numel()), kv.reshape(-1, C + R))
    return pools


def test_declaration_shapes_and_when_it_splits():
    split = MLACacheLayout(split=(512, 64), block_size=128)
    assert backends.get("reference").mla_cache == MLACacheLayout()  # the contract's one tensor by default
    assert split.shapes(3, 128, 576) == ((3, 128, 1, 512), (3, 128, 1, 64))
    assert MLACacheLayout().shapes(3, 16, 576) == ((3, 16, 576),)
    assert split.splits(128, 576, torch.bfloat16)
    assert not split.splits(None, 576, torch.bfloat16)  # ragged
    assert not split.splits(64, 576, torch.bfloat16)  # not the block size the pools need
    assert not split.splits(128, 48, torch.bfloat16)  # another row width
    assert not split.splits(128, 656, torch.uint8)  # FP8 rows stay one tensor
    with pytest.raises(ValueError, match="^split: expected"):
        MLACacheLayout(split=(512,))
    with pytest.raises(ValueError, match="^block_size: expected"):
        MLACacheLayout(split=(512, 64), block_size=0)


def test_pools_are_the_buffer_reinterpreted_without_a_copy():
    buffer = torch.zeros(5, 4, C + R)
    pools = MLACacheLayout(split=(C, R)).view(buffer, 4)
    assert pools.latent.is_contiguous() and pools.rope.is_contiguous()
    assert pools.latent.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    assert pools.latent.shape == (5, 4, 1, C) and pools.rope.shape == (5, 4, 1, R)
    assert pools.shape == (5, 4, C + R) and pools.dim() == 3


@pytest.mark.parametrize("return_lse", [True, False])
def test_reference_reads_split_pools_as_the_one_tensor(return_lse):
    ref = backends.get("reference")
    q, kv, idx, lay = _inputs()
    want = ref.sparse_mla_attention(q, kv, idx, lay, 0.1, C, return_lse)
    got = ref.sparse_mla_attention(q, _pools(kv), idx, lay, 0.1, C, return_lse)
    assert torch.equal(got[0], want[0]) and (got[1] is None) == (want[1] is None)
    if return_lse:
        assert torch.equal(got[1], want[1])


def test_split_pools_have_no_custom_op_and_refuse_where_one_is_needed(monkeypatch):
    """One op per contract op: split pools (two tensors, inference only) are read by the implementation
    itself, also under a dispatch mode (which sees its ops); compiling or exporting such a call is refused
    in one line, never served by copying the pools into one tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    ref = backends.get("reference")
    q, kv, idx, lay = _inputs()
    # no hand-made op beside the declared ones
    assert set(library.CUSTOM_OPS) == set(backends.contract.ops.OPS)
    with Passthrough():  # the one-tensor cache takes the custom op there, the pools the implementation
        want = ref.sparse_mla_attention(q, kv, idx, lay, 0.1, C)[0]
        assert torch.equal(ref.sparse_mla_attention(q, _pools(kv), idx, lay, 0.1, C)[0], want)
    assert torch.equal(ref.sparse_mla_attention(q, _pools(kv), idx, lay, 0.1, C)[0], want)
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)  # what torch.export sets while tracing
    with pytest.raises(NotSupported, match="on split pools cannot be compiled or exported"):
        ref.sparse_mla_attention(q, _pools(kv), idx, lay, 0.1, C)


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda p: MLAPools(p.latent, p.rope[:5]), r"^kv_cache.rope: expected shape \[8, 4, 1, r\]"),
        (lambda p: MLAPools(p.latent, p.rope[..., :8]), r"^kv_cache: expected pool widths c \+ r == d_qk"),
        (lambda p: MLAPools(p.latent.double(), p.rope), r"^kv_cache.latent: expected dtype"),
        (lambda p: MLAPools(p.latent[:, :, 0], p.rope), r"^kv_cache.latent: expected"),
    ],
)
def test_validation_names_the_bad_pool(make, pattern):
    q, kv, idx, lay = _inputs()
    with pytest.raises(ValueError, match=pattern):
        backends.get("reference").sparse_mla_attention(q, make(_pools(kv)), idx, lay, 0.1, C)


def test_split_pools_need_a_paged_layout_and_no_gradient():
    ref = backends.get("reference")
    q, kv, idx, lay = _inputs()
    ragged = SeqLayout.from_lengths([2, 1], [20, 9])
    with pytest.raises(ValueError, match="^kv_cache: expected one tensor"):
        ref.sparse_mla_attention(q, _pools(kv), idx, ragged, 0.1, C)
    with pytest.raises(NotSupported, match="inference only"):
        ref.sparse_mla_attention(q.requires_grad_(), _pools(kv), idx, lay, 0.1, C)


def test_a_backend_that_does_not_list_pools_declines_them():
    cpu = backends.get("cpu")
    if "pools" in cpu.capabilities("sparse_mla_attention").layouts:
        pytest.skip("the cpu backend serves split pools")
    q, kv, idx, lay = _inputs()
    with pytest.raises(NotSupported, match="pools cache layout not in supported"):
        cpu.sparse_mla_attention(q, _pools(kv), idx, lay, 0.1, C)


def test_kvcache_allocates_what_the_backend_declares(monkeypatch):
    """A backend declaring split pools (the tiny preset's widths, block size 4) gets MLAPools from
    KVCache, written and read through them, and generates the one-tensor cache's tokens."""
    model = make_model()
    cfg = model.config
    ids = random_ids(1, 12, seed=3)
    want = generate(model, ids, 4, block_size=4).tokens
    split = MLACacheLayout(split=(cfg.kv_lora_rank, cfg.qk_rope_head_dim), block_size=4)
    monkeypatch.setattr(model.backend, "mla_cache", split)
    cache = model.new_cache(1, 16, block_size=4)
    assert all(isinstance(kv, MLAPools) for kv in cache.kv)
    assert not isinstance(model.new_cache(1, 16, block_size=8).kv[0], MLAPools)  # not its block size
    assert not isinstance(model.new_cache(1, 16).kv[0], MLAPools)  # ragged
    calls = []
    real = model.backend.sparse_mla_attention
    monkeypatch.setattr(
        model.backend,
        "sparse_mla_attention",
        lambda q, kv_cache, *a, **k: calls.append(type(kv_cache)) or real(q, kv_cache, *a, **k),
    )
    assert generate(model, ids, 4, block_size=4).tokens == want
    assert calls and set(calls) == {MLAPools}
