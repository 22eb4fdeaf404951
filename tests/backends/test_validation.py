"""Input validation (SPEC 2): every op's validator (`check` in backends/reference/<op>.py, built on
backends/argcheck.py) raises ValueError naming the argument, the expected and the actual value. One
table row per check, run through a backend call
(the path every backend shares) on an otherwise valid input.
"""

from __future__ import annotations

import pytest
import torch

import backends
from backends import SeqLayout
from backends.reference.w4a8_matmul import pack_int4

F32, BF16, I8, I32, I64 = torch.float32, torch.bfloat16, torch.int8, torch.int32, torch.int64


def z(*shape, dtype=F32, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


def i8(*shape):
    return torch.ones(shape, dtype=I8)


def base(op: str) -> dict:
    """A valid call: T=3 queries of one request over 5 keys, or small GEMMs (M=3, N=2, K=4, E=2)."""
    lay = SeqLayout.from_lengths([3], [5])
    if op in ("indexer_logits", "indexer_topk"):
        a = dict(q=z(3, 2, 4), k_cache=z(5, 4), weights=z(3, 2), layout=lay)
        return a | ({"topk": 2} if op == "indexer_topk" else {})
    if op == "topk":
        return dict(x=z(3, 5), k=2, lengths=torch.tensor([0, 5, 3], dtype=I32))
    if op == "sparse_mla_attention":
        return dict(
            q=z(3, 2, 6),
            kv_cache=z(5, 6),
            indices=torch.zeros(3, 2, dtype=I32),
            layout=lay,
            sm_scale=0.5,
            d_v=4,
        )
    if op == "dynamic_quant_int8":
        return dict(x=z(3, 4))
    if op == "w8a8_matmul":
        return dict(x_q=i8(3, 4), x_scale=z(3), w_q=i8(2, 4), w_scale=z(2), bias=z(2), out_dtype=BF16)
    if op == "w4a8_matmul":
        return dict(
            x_q=i8(3, 4),
            x_scale=z(3),
            w_packed=pack_int4(torch.ones(2, 4)),
            w_scale=z(2, 2),
            group_size=2,
            bias=z(2),
            out_dtype=BF16,
        )
    if op == "grouped_matmul":
        return dict(x=z(3, 4), w=z(2, 2, 4), group_offsets=torch.tensor([0, 1, 3], dtype=I32))
    if op == "grouped_w8a8":
        return dict(
            x=i8(3, 4),
            w=i8(2, 2, 4),
            group_offsets=torch.tensor([0, 1, 3]),
            x_scale=z(3),
            w_scale=z(2, 2),
            out_dtype=BF16,
        )
    if op == "grouped_w4a8":
        return dict(
            x=i8(3, 4),
            w=pack_int4(torch.ones(2, 2, 4)),
            group_offsets=torch.tensor([0, 1, 3]),
            x_scale=z(3),
            w_scale=z(2, 2, 2),
            group_size=2,
            out_dtype=BF16,
        )
    if op == "linear_cross_entropy":
        return dict(h=z(3, 4), weight=z(6, 4), targets=torch.tensor([0, 5, -100]))
    raise AssertionError(op)


PAGED = SeqLayout.from_lengths([3], [5], block_size=2)
META_LAYOUT = SeqLayout.from_lengths([3], [5], device="meta")

# (op, overrides, arg, expected fragment, actual fragment)
CASES = [
    # check_tensor, through the attention-like ops
    ("indexer_logits", dict(q=[[0.0]]), "q", "a torch.Tensor", "list"),
    ("indexer_logits", dict(q=z(3, 2, 4, dtype=I32)), "q", "dtype one of torch.float32", "torch.int32"),
    ("indexer_logits", dict(q=z(3, 8)), "q", "3 dims", "shape [3, 8]"),
    ("indexer_logits", dict(k_cache=z(1, 5, 4, 1)), "k_cache", "2 or 3 dims", "shape [1, 5, 4, 1]"),
    (
        "indexer_logits",
        dict(k_cache=z(5, 4, dtype=BF16)),
        "k_cache",
        "dtype torch.float32 (as q)",
        "torch.bfloat16",
    ),
    ("indexer_logits", dict(weights=z(3, 2, dtype=BF16)), "weights", "dtype torch.float32", "torch.bfloat16"),
    ("indexer_logits", dict(weights=z(3, 3)), "weights", "shape [3, 2]", "shape [3, 3]"),
    ("indexer_logits", dict(weights=z(3, 2, device="meta")), "weights", "device cpu (as q)", "meta"),
    ("indexer_logits", dict(layout=(0, 3)), "layout", "a backends.SeqLayout", "tuple"),
    ("indexer_logits", dict(layout=META_LAYOUT), "layout", "device cpu (as k_cache)", "meta"),
    ("indexer_logits", dict(k_cache=z(5, 8)), "k_cache", "last dim 4", "shape [5, 8]"),
    ("indexer_logits", dict(k_cache=z(3, 2, 8), layout=PAGED), "k_cache", "last dim 4", "shape [3, 2, 8]"),
    ("indexer_topk", dict(topk=0), "topk", "an int >= 1", "0"),
    ("indexer_topk", dict(topk=2.0), "topk", "an int", "float"),
    ("indexer_topk", dict(topk=True), "topk", "an int", "bool"),
    # topk
    ("topk", dict(x=z(3, 5, dtype=I64)), "x", "dtype one of", "torch.int64"),
    ("topk", dict(x=z(15)), "x", "2 dims", "shape [15]"),
    ("topk", dict(k=0), "k", "an int >= 1", "0"),
    ("topk", dict(lengths=z(3)), "lengths", "dtype one of torch.int32, torch.int64", "torch.float32"),
    ("topk", dict(lengths=torch.tensor([1, 2])), "lengths", "shape [3]", "shape [2]"),
    ("topk", dict(lengths=torch.tensor([1, 2, 3], device="meta")), "lengths", "device cpu (as x)", "meta"),
    (
        "topk",
        dict(lengths=torch.tensor([1, 6, 3])),
        "lengths",
        "values in [0, 5] (columns of x)",
        "range [1, 6]",
    ),
    ("topk", dict(lengths=torch.tensor([-1, 2, 3])), "lengths", "values in [0, 5]", "range [-1, 3]"),
    # sparse_mla_attention
    ("sparse_mla_attention", dict(q=z(3, 2, 6, dtype=torch.float64)), "q", "dtype one of", "torch.float64"),
    (
        "sparse_mla_attention",
        dict(kv_cache=z(5, 6, dtype=BF16)),
        "kv_cache",
        "dtype torch.float32 (as q)",
        "torch.bfloat16",
    ),
    ("sparse_mla_attention", dict(kv_cache=z(5)), "kv_cache", "2 or 3 dims", "shape [5]"),
    (
        "sparse_mla_attention",
        dict(indices=torch.zeros(3, 2, dtype=I64)),
        "indices",
        "dtype torch.int32",
        "torch.int64",
    ),
    ("sparse_mla_attention", dict(indices=torch.zeros(6, dtype=I32)), "indices", "2 dims", "shape [6]"),
    (
        "sparse_mla_attention",
        dict(indices=torch.zeros(4, 2, dtype=I32)),
        "indices",
        "shape [T=3, topk]",
        "shape [4, 2]",
    ),
    (
        "sparse_mla_attention",
        dict(indices=torch.zeros(3, 2, dtype=I32, device="meta")),
        "indices",
        "device cpu (as q)",
        "meta",
    ),
    ("sparse_mla_attention", dict(kv_cache=z(5, 7)), "kv_cache", "last dim 6", "shape [5, 7]"),
    ("sparse_mla_attention", dict(kv_cache=z(3, 2, 6)), "kv_cache", "a ragged cache", "shape [3, 2, 6]"),
    ("sparse_mla_attention", dict(sm_scale=float("nan")), "sm_scale", "a finite float", "nan"),
    ("sparse_mla_attention", dict(sm_scale=float("-inf")), "sm_scale", "a finite float", "-inf"),
    ("sparse_mla_attention", dict(sm_scale=True), "sm_scale", "a finite float", "True"),
    ("sparse_mla_attention", dict(sm_scale="0.1"), "sm_scale", "a finite float", "0.1"),
    ("sparse_mla_attention", dict(d_v=0), "d_v", "an int >= 1", "0"),
    ("sparse_mla_attention", dict(d_v=4.0), "d_v", "an int", "float"),
    ("sparse_mla_attention", dict(d_v=7), "d_v", "<= d_qk (6)", "7"),
    # dynamic_quant_int8
    ("dynamic_quant_int8", dict(x=z(3, 4, dtype=I8)), "x", "dtype one of", "torch.int8"),
    ("dynamic_quant_int8", dict(x=z(12)), "x", "2 dims", "shape [12]"),
    ("dynamic_quant_int8", dict(x=z(3, 0)), "x", "shape [M, K] with K >= 1", "shape [3, 0]"),
    # w8a8_matmul
    ("w8a8_matmul", dict(x_q=z(3, 4)), "x_q", "dtype torch.int8", "torch.float32"),
    ("w8a8_matmul", dict(x_q=i8(12)), "x_q", "2 dims", "shape [12]"),
    ("w8a8_matmul", dict(w_q=torch.ones(2, 4, dtype=torch.uint8)), "w_q", "dtype torch.int8", "torch.uint8"),
    ("w8a8_matmul", dict(w_q=i8(2, 5)), "w_q", "shape [N, K=4] (K as x_q)", "shape [2, 5]"),
    ("w8a8_matmul", dict(x_scale=z(3, dtype=BF16)), "x_scale", "dtype torch.float32", "torch.bfloat16"),
    ("w8a8_matmul", dict(x_scale=z(3, 1)), "x_scale", "shape [3]", "shape [3, 1]"),
    ("w8a8_matmul", dict(w_scale=z(3)), "w_scale", "shape [2]", "shape [3]"),
    ("w8a8_matmul", dict(bias=z(3)), "bias", "shape [2]", "shape [3]"),
    ("w8a8_matmul", dict(bias=torch.zeros(2, dtype=I32)), "bias", "dtype one of", "torch.int32"),
    (
        "w8a8_matmul",
        dict(out_dtype=I8),
        "out_dtype",
        "one of torch.float32, torch.float16, torch.bfloat16",
        "torch.int8",
    ),
    ("w8a8_matmul", dict(w_scale=z(2, device="meta")), "w_scale", "device cpu (as x_scale)", "meta"),
    # w4a8_matmul
    ("w4a8_matmul", dict(x_q=i8(3, 5)), "x_q", "an even K (two int4 weights per byte)", "shape [3, 5]"),
    ("w4a8_matmul", dict(w_packed=i8(2, 2)), "w_packed", "dtype torch.uint8", "torch.int8"),
    (
        "w4a8_matmul",
        dict(w_packed=torch.ones(2, 4, dtype=torch.uint8)),
        "w_packed",
        "shape [N, K//2=2]",
        "shape [2, 4]",
    ),
    ("w4a8_matmul", dict(group_size=0), "group_size", "an int >= 1", "0"),
    ("w4a8_matmul", dict(group_size=3), "group_size", "a divisor of K=4", "3"),
    ("w4a8_matmul", dict(w_scale=z(2, 1)), "w_scale", "shape [2, 2]", "shape [2, 1]"),
    ("w4a8_matmul", dict(bias=z(1)), "bias", "shape [2]", "shape [1]"),
    ("w4a8_matmul", dict(out_dtype=torch.float64), "out_dtype", "one of torch.float32", "torch.float64"),
    # grouped_matmul: shared checks, float variant
    ("grouped_matmul", dict(x=z(3, 4, dtype=I32)), "x", "dtype one of", "torch.int32"),
    ("grouped_matmul", dict(w=z(2, 4)), "w", "3 dims", "shape [2, 4]"),
    (
        "grouped_matmul",
        dict(group_offsets=torch.tensor([0.0, 1.0, 3.0])),
        "group_offsets",
        "dtype one of torch.int32, torch.int64",
        "torch.float32",
    ),
    ("grouped_matmul", dict(group_offsets=torch.tensor([0, 3])), "group_offsets", "shape [3]", "shape [2]"),
    (
        "grouped_matmul",
        dict(group_offsets=torch.tensor([1, 2, 3])),
        "group_offsets",
        "non-decreasing offsets from 0 to at most M=3",
        "[1, 2, 3]",
    ),
    (
        "grouped_matmul",
        dict(group_offsets=torch.tensor([0, 2, 4])),
        "group_offsets",
        "non-decreasing offsets from 0 to at most M=3",
        "[0, 2, 4]",
    ),
    (
        "grouped_matmul",
        dict(group_offsets=torch.tensor([0, 3, 2])),
        "group_offsets",
        "non-decreasing offsets from 0 to at most M=3",
        "[0, 3, 2]",
    ),
    (
        "grouped_matmul",
        dict(group_offsets=torch.tensor([0, 1, 3], device="meta")),
        "group_offsets",
        "device cpu (as x)",
        "meta",
    ),
    ("grouped_matmul", dict(w=z(2, 2, 4, dtype=BF16)), "w", "dtype torch.float32 (as x)", "torch.bfloat16"),
    ("grouped_matmul", dict(w=z(2, 2, 5)), "w", "shape [E, N, K=4]", "shape [2, 2, 5]"),
    ("grouped_matmul", dict(x_scale=z(3)), "x_scale", "None for floating-point x", "Tensor"),
    ("grouped_matmul", dict(w_scale=z(2, 2)), "w_scale", "None for floating-point x", "Tensor"),
    ("grouped_matmul", dict(group_size=2), "group_size", "None for floating-point x", "int"),
    ("grouped_matmul", dict(out_dtype=I8), "out_dtype", "None or a float dtype", "torch.int8"),
    # grouped_matmul: quantized variants
    ("grouped_w8a8", dict(out_dtype=None), "out_dtype", "a float dtype for int8 x", "None"),
    ("grouped_w8a8", dict(w=i8(2, 2, 5)), "w", "shape [E, N, K=4]", "shape [2, 2, 5]"),
    ("grouped_w8a8", dict(group_size=2), "group_size", "None for W8A8 (per-channel scales)", "2"),
    ("grouped_w8a8", dict(x_scale=None), "x_scale", "a torch.Tensor", "NoneType"),
    ("grouped_w8a8", dict(w_scale=z(2)), "w_scale", "shape [2, 2]", "shape [2]"),
    (
        "grouped_w8a8",
        dict(w=z(2, 2, 4)),
        "w",
        "dtype int8 (W8A8) or uint8 (packed int4, W4A8) for int8 x",
        "torch.float32",
    ),
    (
        "grouped_w4a8",
        dict(w=torch.ones(2, 2, 4, dtype=torch.uint8)),
        "w",
        "packed int4 shape [E, N, K//2=2]",
        "shape [2, 2, 4]",
    ),
    ("grouped_w4a8", dict(group_size=None), "group_size", "an int", "NoneType"),
    ("grouped_w4a8", dict(group_size=3), "group_size", "a divisor of K=4", "3"),
    ("grouped_w4a8", dict(w_scale=z(2, 2)), "w_scale", "shape [2, 2, 2]", "shape [2, 2]"),
    # linear_cross_entropy
    ("linear_cross_entropy", dict(h=z(3, 4, dtype=I32)), "h", "dtype one of", "torch.int32"),
    ("linear_cross_entropy", dict(h=z(12)), "h", "2 dims", "shape [12]"),
    ("linear_cross_entropy", dict(weight=z(6, 5)), "weight", "shape [V, D=4]", "shape [6, 5]"),
    ("linear_cross_entropy", dict(weight=z(6, 4, dtype=I8)), "weight", "dtype one of", "torch.int8"),
    (
        "linear_cross_entropy",
        dict(targets=z(3)),
        "targets",
        "dtype one of torch.int64, torch.int32",
        "torch.float32",
    ),
    ("linear_cross_entropy", dict(targets=torch.tensor([0, 1])), "targets", "shape [3]", "shape [2]"),
    (
        "linear_cross_entropy",
        dict(targets=torch.tensor([0, 1, 2], device="meta")),
        "targets",
        "device cpu (as h)",
        "meta",
    ),
    ("linear_cross_entropy", dict(ignore_index=-1.0), "ignore_index", "an int", "float"),
    (
        "linear_cross_entropy",
        dict(targets=torch.tensor([0, 6, -100])),
        "targets",
        "values in [0, V=6) or ignore_index=-100",
        "range [0, 6]",
    ),
    (
        "linear_cross_entropy",
        dict(targets=torch.tensor([0, -1, -100])),
        "targets",
        "values in [0, V=6) or ignore_index=-100",
        "range [-1, 0]",
    ),
]


def _method(op: str) -> str:
    return "grouped_matmul" if op.startswith("grouped") else op


@pytest.mark.parametrize(
    ("op", "over", "arg", "expected", "actual"),
    CASES,
    ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(CASES)],
)
def test_check_raises_value_error_naming_the_argument(op, over, arg, expected, actual):
    ref = backends.get("reference")
    before = dict(ref.calls)
    with pytest.raises(ValueError) as err, ref.validating():  # value checks too (GLM5_VALIDATE=values)
        getattr(ref, _method(op))(**(base(op) | over))
    msg = str(err.value)
    assert msg.startswith(f"{arg}: expected "), msg
    assert expected in msg, msg
    assert f"got {actual}" in msg, msg
    assert dict(ref.calls) == before  # rejected before the implementation ran


@pytest.mark.parametrize(
    "op",
    [
        "indexer_logits",
        "indexer_topk",
        "topk",
        "sparse_mla_attention",
        "dynamic_quant_int8",
        "w8a8_matmul",
        "w4a8_matmul",
        "grouped_matmul",
        "grouped_w8a8",
        "grouped_w4a8",
        "linear_cross_entropy",
    ],
)
def test_every_base_case_is_valid(op):
    """The table's baseline passes, so each row fails for its own reason."""
    getattr(backends.get("reference"), _method(op))(**base(op))


def test_ignore_index_inside_the_vocabulary_is_not_a_target():
    ref = backends.get("reference")
    ref.linear_cross_entropy(z(2, 4), z(6, 4), torch.tensor([3, 9]), ignore_index=9)
    with pytest.raises(ValueError, match=r"^targets: expected values in \[0, V=6\) or ignore_index=3, got"):
        with ref.validating():
            ref.linear_cross_entropy(z(2, 4), z(6, 4), torch.tensor([3, 9]), ignore_index=3)


#: (op, overrides) whose only fault is in tensor VALUES: checked per call only in values mode
VALUE_ONLY = [
    ("topk", dict(lengths=torch.tensor([1, 6, 3]))),
    ("grouped_matmul", dict(group_offsets=torch.tensor([0, 4, 3]))),
]


@pytest.mark.parametrize(("op", "over"), VALUE_ONLY, ids=[c[0] for c in VALUE_ONLY])
def test_value_checks_run_only_in_values_mode(op, over, monkeypatch):
    """The hot path reads no tensor values: a values-only fault passes the default front door (the op
    then computes garbage, as a kernel would) and is caught under GLM5_VALIDATE=values."""
    from backends.contract.ops import OPS

    args = base(op) | over
    reads = []
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or [])
        m.setattr(torch.Tensor, "item", lambda self: reads.append(1) or 0)
        OPS[op].validate(**args)  # the always-on tier accepts it, without a host read
    assert reads == []
    ref = backends.get("reference")
    with pytest.raises(ValueError), ref.validating():
        getattr(ref, _method(op))(**args)
