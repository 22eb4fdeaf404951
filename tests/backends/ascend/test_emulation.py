"""The operator emulations reject what the documentation says the real operators reject."""

from __future__ import annotations

import pytest
import torch

from backends.ascend.emulation import OperatorRejected, module_for

A3 = module_for("A3")
CU = torch.tensor([2], dtype=torch.int32)


def _li(**over):
    a = dict(
        query=torch.zeros(2, 4, 128, dtype=torch.bfloat16),
        key=torch.zeros(2, 16, 1, 128, dtype=torch.bfloat16),
        weights=torch.zeros(2, 4),
        actual_seq_lengths_query=CU,
        actual_seq_lengths_key=torch.tensor([20], dtype=torch.int32),
        block_table=torch.tensor([[0, 1]], dtype=torch.int32),
        layout_query="TND",
        layout_key="PA_BSND",
        sparse_count=8,
        sparse_mode=3,
    )
    return a | over


@pytest.mark.parametrize(
    "over, arg",
    [
        (dict(query=torch.zeros(2, 4, 64, dtype=torch.bfloat16)), "query"),
        (dict(query=torch.zeros(2, 4, 128)), "query"),
        (dict(query=torch.zeros(2, 65, 128, dtype=torch.bfloat16), weights=torch.zeros(2, 65)), "query"),
        (dict(key=torch.zeros(2, 8, 1, 128, dtype=torch.bfloat16)), "key"),
        (dict(sparse_count=2049), "sparse_count"),
        (dict(sparse_mode=1), "sparse_mode"),
        (dict(return_value=True), "return_value"),
    ],
)
def test_lightning_indexer_rejects(over, arg):
    a = _li(**over)
    with pytest.raises(OperatorRejected, match=arg):
        A3.npu_lightning_indexer(a.pop("query"), a.pop("key"), a.pop("weights"), **a)


def test_lightning_indexer_950_head_counts():
    a = _li()
    with pytest.raises(OperatorRejected, match="N1"):
        module_for("950").npu_lightning_indexer(
            a.pop("query"), a.pop("key"), a.pop("weights").bfloat16(), **a
        )


def test_lightning_indexer_breaks_ties_towards_higher_positions():
    a = _li(
        weights=torch.ones(2, 4),
        query=torch.ones(2, 4, 128, dtype=torch.bfloat16),
        key=torch.ones(2, 16, 1, 128, dtype=torch.bfloat16),
    )
    idx, _ = A3.npu_lightning_indexer(a.pop("query"), a.pop("key"), a.pop("weights"), **a)
    assert idx[1, 0, :3].tolist() == [19, 18, 17]  # causal: query 1 of 2 sees 0..19


def test_sparse_flash_attention_rejects_mode_and_heads():
    q, qr = torch.zeros(1, 3, 512, dtype=torch.bfloat16), torch.zeros(1, 3, 64, dtype=torch.bfloat16)
    k, kr = torch.zeros(4, 1, 512, dtype=torch.bfloat16), torch.zeros(4, 1, 64, dtype=torch.bfloat16)
    kw = dict(
        actual_seq_lengths_query=torch.tensor([1], dtype=torch.int32),
        actual_seq_lengths_kv=torch.tensor([4], dtype=torch.int32),
        query_rope=qr,
        key_rope=kr,
        layout_query="TND",
        layout_kv="TND",
        sparse_mode=0,
    )
    idx = torch.zeros(1, 1, 2, dtype=torch.int32)
    with pytest.raises(OperatorRejected, match="attention_mode"):
        A3.npu_sparse_flash_attention(q, k, k, idx, 0.1, **kw)
    with pytest.raises(OperatorRejected, match="N1"):
        A3.npu_sparse_flash_attention(q, k, k, idx, 0.1, attention_mode=2, **kw)


def test_dynamic_quant_rejects_fp32_and_has_no_scale_floor():
    with pytest.raises(OperatorRejected, match="input"):
        A3.npu_dynamic_quant(torch.zeros(2, 4))
    y, s = A3.npu_dynamic_quant(torch.zeros(2, 4, dtype=torch.bfloat16))
    assert s.tolist() == [0.0, 0.0] and not y.any()


def test_quant_matmul_rejects_last_dim_over_65535():
    with pytest.raises(OperatorRejected, match="65535"):
        A3.npu_quant_matmul(
            torch.zeros(1, 65536, dtype=torch.int8),
            torch.zeros(65536, 1, dtype=torch.int8),
            torch.ones(1),
            pertoken_scale=torch.ones(1),
            output_dtype=torch.bfloat16,
        )
