"""`SeqLayout` (SPEC 1): every check raises ValueError naming the argument with expected vs actual
(one table row per check), and the helpers map logical positions as SPEC 1 says.
"""

from __future__ import annotations

import pytest
import torch

import backends
from backends import SeqLayout


def i32(*v, device: str = "cpu") -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int32, device=device)


def bt(rows, device: str = "cpu") -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32, device=device)


def assert_names(err: pytest.ExceptionInfo, arg: str, expected: str, actual: str) -> None:
    msg = str(err.value)
    assert msg.startswith(f"{arg}: expected "), msg
    assert expected in msg, msg
    assert f"got {actual}" in msg, msg


RAGGED = dict(cu_seqlens_q=i32(0, 2, 5), seqlens_k=i32(4, 3), cu_seqlens_k=i32(0, 4, 7))
PAGED = dict(cu_seqlens_q=i32(0, 2, 5), seqlens_k=i32(4, 3), block_table=bt([[0, 1], [2, 0]]))

# (id, base, overrides, arg, expected fragment, actual fragment)
CONSTRUCT = [
    (
        "cu_q-not-tensor",
        RAGGED,
        dict(cu_seqlens_q=[0, 2, 5]),
        "layout.cu_seqlens_q",
        "a torch.Tensor",
        "list",
    ),
    (
        "cu_q-dtype",
        RAGGED,
        dict(cu_seqlens_q=torch.tensor([0, 2, 5])),
        "layout.cu_seqlens_q",
        "dtype torch.int32",
        "torch.int64",
    ),
    (
        "cu_q-ndim",
        RAGGED,
        dict(cu_seqlens_q=bt([[0, 2, 5]])),
        "layout.cu_seqlens_q",
        "1 dims",
        "shape [1, 3]",
    ),
    (
        "cu_q-empty",
        RAGGED,
        dict(cu_seqlens_q=i32()),
        "layout.cu_seqlens_q",
        "at least one element",
        "torch.Size([0])",
    ),
    (
        "seqlens_k-dtype",
        RAGGED,
        dict(seqlens_k=torch.tensor([4, 3])),
        "layout.seqlens_k",
        "dtype torch.int32",
        "torch.int64",
    ),
    ("seqlens_k-shape", RAGGED, dict(seqlens_k=i32(4, 3, 1)), "layout.seqlens_k", "shape [2]", "shape [3]"),
    ("both", RAGGED, dict(block_table=bt([[0], [1]])), "layout", "exactly one of cu_seqlens_k", "both"),
    ("neither", RAGGED, dict(cu_seqlens_k=None), "layout", "exactly one of cu_seqlens_k", "neither"),
    ("cu_k-shape", RAGGED, dict(cu_seqlens_k=i32(0, 4)), "layout.cu_seqlens_k", "shape [3]", "shape [2]"),
    (
        "cu_k-dtype",
        RAGGED,
        dict(cu_seqlens_k=torch.tensor([0, 4, 7])),
        "layout.cu_seqlens_k",
        "dtype torch.int32",
        "torch.int64",
    ),
    (
        "table-dtype",
        PAGED,
        dict(block_table=torch.tensor([[0], [1]])),
        "layout.block_table",
        "dtype torch.int32",
        "torch.int64",
    ),
    ("table-ndim", PAGED, dict(block_table=i32(0, 1)), "layout.block_table", "2 dims", "shape [2]"),
    (
        "table-rows",
        PAGED,
        dict(block_table=bt([[0], [1], [2]])),
        "layout.block_table",
        "shape [B=2, max_blocks]",
        "(3, 1)",
    ),
    (
        "seqlens_k-device",
        RAGGED,
        dict(seqlens_k=i32(4, 3, device="meta")),
        "layout.seqlens_k",
        "device cpu (as cu_seqlens_q)",
        "meta",
    ),
    (
        "cu_k-device",
        RAGGED,
        dict(cu_seqlens_k=i32(0, 4, 7, device="meta")),
        "layout.cu_seqlens_k",
        "device cpu (as cu_seqlens_q)",
        "meta",
    ),
    (
        "table-device",
        PAGED,
        dict(block_table=bt([[0, 1], [2, 0]], device="meta")),
        "layout.block_table",
        "device cpu (as cu_seqlens_q)",
        "meta",
    ),
]


@pytest.mark.parametrize(
    ("base", "over", "arg", "expected", "actual"), [c[1:] for c in CONSTRUCT], ids=[c[0] for c in CONSTRUCT]
)
def test_construction_checks(base, over, arg, expected, actual):
    with pytest.raises(ValueError) as err:
        SeqLayout(**(base | over))
    assert_names(err, arg, expected, actual)


C7 = torch.zeros(7, 4)  # ragged cache rows for RAGGED
P3 = torch.zeros(3, 2, 4)  # paged cache: 3 blocks of 2 for PAGED

# (id, base, overrides, num_tokens, cache, arg, expected fragment, actual fragment)
VALUES = [
    (
        "cu_q-start",
        RAGGED,
        dict(cu_seqlens_q=i32(1, 2, 5)),
        5,
        C7,
        "layout.cu_seqlens_q",
        "non-decreasing offsets starting at 0",
        "[1, 2, 5]",
    ),
    (
        "cu_q-decreasing",
        RAGGED,
        dict(cu_seqlens_q=i32(0, 3, 2)),
        2,
        C7,
        "layout.cu_seqlens_q",
        "non-decreasing offsets starting at 0",
        "[0, 3, 2]",
    ),
    (
        "cu_q-total",
        RAGGED,
        {},
        6,
        C7,
        "layout.cu_seqlens_q",
        "last offset == number of query tokens T=6",
        "5",
    ),
    (
        "seqlens_k-negative",
        RAGGED,
        dict(seqlens_k=i32(-1, 3)),
        5,
        C7,
        "layout.seqlens_k",
        "non-negative key counts",
        "[-1, 3]",
    ),
    (
        "ragged-3d-cache",
        RAGGED,
        {},
        5,
        torch.zeros(7, 1, 4),
        "k_cache",
        "a ragged cache [rows, D]",
        "(7, 1, 4)",
    ),
    (
        "cu_k-negative",
        RAGGED,
        dict(cu_seqlens_k=i32(-1, 4, 7)),
        5,
        C7,
        "layout.cu_seqlens_k",
        "non-decreasing non-negative offsets",
        "[-1, 4, 7]",
    ),
    (
        "cu_k-decreasing",
        RAGGED,
        dict(cu_seqlens_k=i32(0, 4, 3), seqlens_k=i32(4, 0)),
        5,
        C7,
        "layout.cu_seqlens_k",
        "non-decreasing non-negative offsets",
        "[0, 4, 3]",
    ),
    (
        "cu_k-overlap",
        RAGGED,
        dict(seqlens_k=i32(5, 2)),
        5,
        C7,
        "layout.cu_seqlens_k",
        "request 0: cu_seqlens_k[b] + seqlens_k[b] <= cu_seqlens_k[b+1]",
        "0 + 5 > 4",
    ),
    (
        "cu_k-past-cache",
        RAGGED,
        {},
        5,
        torch.zeros(6, 4),
        "layout.cu_seqlens_k",
        "last offset <= cache rows (6)",
        "7",
    ),
    ("paged-2d-cache", PAGED, {}, 5, C7, "k_cache", "a paged cache [num_blocks, block_size, D]", "(7, 4)"),
    ("paged-block-size-0", PAGED, {}, 5, torch.zeros(3, 0, 4), "k_cache", "block_size >= 1", "(3, 0, 4)"),
    (
        "table-too-narrow",
        PAGED,
        {},
        5,
        torch.zeros(8, 1, 4),
        "layout.block_table",
        "request 0: >= 4 blocks for 4 keys of block size 1",
        "2 columns",
    ),
    (
        "table-negative-id",
        PAGED,
        dict(block_table=bt([[0, 1], [2, -1]])),
        5,
        P3,
        "layout.block_table",
        "request 1: block ids in [0, 3) for its 2 used blocks",
        "[2, -1]",
    ),
    (
        "table-id-past-cache",
        PAGED,
        dict(block_table=bt([[0, 5], [2, 1]])),
        5,
        P3,
        "layout.block_table",
        "request 0: block ids in [0, 3) for its 2 used blocks",
        "[0, 5]",
    ),
]


@pytest.mark.parametrize(
    ("base", "over", "num_tokens", "cache", "arg", "expected", "actual"),
    [c[1:] for c in VALUES],
    ids=[c[0] for c in VALUES],
)
def test_value_checks(base, over, num_tokens, cache, arg, expected, actual):
    layout = SeqLayout(**(base | over))
    with pytest.raises(ValueError) as err:
        layout.check(num_tokens, cache, "k_cache")
    assert_names(err, arg, expected, actual)


def test_value_checks_surface_through_an_op():
    layout = SeqLayout(**(PAGED | dict(block_table=bt([[0, 1], [2, 9]]))))
    with pytest.raises(ValueError, match=r"^layout\.block_table: expected request 1"):
        backends.get("reference").indexer_logits(torch.zeros(5, 2, 4), P3, torch.zeros(5, 2), layout)
    with pytest.raises(
        ValueError, match=r"^k_cache: expected a paged cache \[num_blocks, block_size >= 1, D\]"
    ):
        backends.get("reference").indexer_logits(
            torch.zeros(5, 2, 4), torch.zeros(3, 0, 4), torch.zeros(5, 2), SeqLayout(**PAGED)
        )


@pytest.mark.parametrize(
    ("kwargs", "arg", "expected", "actual"),
    [
        (dict(q_lens=[1, 2], k_lens=[3]), "k_lens", "one length per request (2)", "1"),
        (
            dict(q_lens=[1, 2], k_lens=[3, 4], block_size=2, block_order=[0, 1, 2]),
            "block_order",
            "at least 4 block ids",
            "3",
        ),
        (dict(q_lens=[1], k_lens=[3], block_size=0), "block_size", "an int >= 1", "0"),
        (dict(q_lens=[1], k_lens=[3], block_size=2.0), "block_size", "an int", "float"),
    ],
    ids=["lengths", "block_order", "block_size-0", "block_size-float"],
)
def test_from_lengths_checks(kwargs, arg, expected, actual):
    with pytest.raises(ValueError) as err:
        SeqLayout.from_lengths(**kwargs)
    assert_names(err, arg, expected, actual)


def test_from_lengths_ragged_and_paged():
    lay = SeqLayout.from_lengths([2, 0, 3], [5, 1, 3])
    assert lay.kind == "ragged" and lay.num_requests == 3 and lay.num_tokens == 5 and lay.max_seqlen_k == 5
    assert lay.cu_seqlens_q.tolist() == [0, 2, 2, 5] and lay.cu_seqlens_k.tolist() == [0, 5, 6, 9]
    assert lay.request_bounds() == [(0, 2, 5), (2, 2, 1), (2, 5, 3)]
    assert lay.physical_rows(2, torch.tensor([0, 2]), torch.zeros(9, 4)).tolist() == [6, 8]
    lay = SeqLayout.from_lengths([2, 0, 3], [5, 1, 3], block_size=2, block_order=[6, 0, 4, 2, 1, 3])
    assert lay.kind == "paged" and lay.block_table.tolist() == [[6, 0, 4], [2, -1, -1], [1, 3, -1]]
    cache = torch.zeros(7, 2, 4)
    lay.check(5, cache, "k_cache")
    # position p of request b: cache[block_table[b, p // 2], p % 2] -> flat row block * 2 + p % 2
    assert lay.physical_rows(0, torch.tensor([0, 1, 2, 4]), cache).tolist() == [12, 13, 0, 8]
    assert lay.physical_rows(2, torch.tensor([2]), cache).tolist() == [6]
    moved = lay.to("cpu")
    assert moved.kind == "paged" and torch.equal(moved.block_table, lay.block_table)


def test_empty_batch_is_valid():
    for bs in (None, 4):
        lay = SeqLayout.from_lengths([], [], block_size=bs)
        lay.check(0, torch.zeros(0, 4) if bs is None else torch.zeros(1, 4, 4), "k_cache")
        assert lay.num_requests == 0 and lay.num_tokens == 0 and lay.max_seqlen_k == 0
