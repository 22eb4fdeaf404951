"""The plugin binds its latent cache layers as the backend's `mla_cache` declares (cache_layout.py):
vLLM's one buffer per layer, reinterpreted as split pools with no copy, written by the model's
`cache.write` into both pools; the indexer cache and other block sizes stay one tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import SparseCacheRole  # noqa: E402

from backends.cache_layout import MLACacheLayout, MLAPools  # noqa: E402
from glm5.vllm.cache import Glm5CacheLayer, PagedCaches  # noqa: E402

C, R = 32, 16


def _layer(indexer: bool) -> Glm5CacheLayer:
    """A cache layer without a vLLM config (only what binding and writing use)."""
    layer = Glm5CacheLayer.__new__(Glm5CacheLayer)
    nn.Module.__init__(layer)
    layer.prefix, layer.width = "layers.0.latent_cache", C + R
    layer.role = SparseCacheRole.INDEXER if indexer else SparseCacheRole.SPARSE
    return layer


@pytest.mark.parametrize("block_size, split", [(4, True), (8, False)])
def test_latent_layers_bind_the_declared_pools(block_size, split):
    latent, index = _layer(False), _layer(True)
    caches = PagedCaches([latent], [index], MLACacheLayout(split=(C, R), block_size=4))
    buffer = torch.zeros(6, 1, block_size, C + R)  # vLLM's per-layer view [num_blocks, H=1, bs, D]
    latent.bind_kv_cache(buffer)
    index.bind_kv_cache(torch.zeros(6, 1, block_size, C + R))
    assert isinstance(latent.kv_cache, MLAPools) == split
    assert not isinstance(index.kv_cache, MLAPools)
    rows = torch.tensor([3, 17, 22])
    values = torch.randn(3, C + R)
    got = caches.write("kv", 0, rows, values)
    assert got is latent.kv_cache
    if split:
        assert got.latent.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        torch.testing.assert_close(got.rows(rows), values, rtol=0, atol=0)
    else:
        torch.testing.assert_close(got.view(-1, C + R)[rows], values, rtol=0, atol=0)
