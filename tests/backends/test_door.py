"""The front door is built once per op (backends/contract/door.py): a plain eager call reaches the
implementation in at most five Python frames (bench/walk_call.py counts them), and the door follows changes of
the hooks and of the validation mode."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import backends
from backends.hooks import Recorder

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from walk_call import hops, walk  # noqa: E402

MAX_HOPS = 5


def _calls():
    lay = backends.SeqLayout.from_lengths([2], [5])
    attention = {
        "q": torch.randn(2, 2, 16),
        "kv_cache": torch.randn(5, 16),
        "indices": torch.arange(2, dtype=torch.int32).repeat(2, 1),
        "layout": lay,
        "sm_scale": 0.25,
        "d_v": 8,
        "return_lse": False,
    }
    return {
        "topk": {"x": torch.randn(2, 8), "k": 3, "lengths": None},
        "silu_and_mul": {"x": torch.randn(4, 8)},
        "dynamic_quant_int8": {"x": torch.randn(4, 8)},
        "sparse_mla_attention": attention,
    }


@pytest.mark.parametrize("name", ["reference", "cpu"])
@pytest.mark.parametrize("op", list(_calls()))
def test_a_plain_eager_call_reaches_the_implementation_in_five_hops(name, op):
    be = backends.get(name)
    chain = hops(be, op, _calls()[op])
    assert len(chain) <= MAX_HOPS, "\n".join(chain)
    assert chain[0].endswith(f":{op}") and "door.py" in chain[1]


def test_the_walk_counts_every_frame_down_to_the_target():
    def leaf():
        return 1

    def middle():
        return leaf()

    assert [c.split(":")[-1] for c in walk(middle, leaf.__code__)] == ["leaf"]  # middle: the caller
    assert [c.split(":")[-1] for c in walk(lambda: middle(), leaf.__code__)] == ["middle", "leaf"]
    with pytest.raises(ValueError, match="did not run"):
        walk(lambda: None, leaf.__code__)


def test_installing_a_hook_rebuilds_the_doors_and_removing_it_restores_them():
    be = type(backends.get("reference"))()
    x = torch.randn(2, 8)
    plain = be._doors["topk"]
    with be.hooked(Recorder(["topk"])) as rec:
        be.topk(x, 2)
    assert len(rec.outputs("topk")) == 1
    be.topk(x, 2)
    assert len(rec.outputs("topk")) == 1 and be._doors["topk"] is not plain


def test_validating_rebuilds_the_doors_with_every_value_check():
    be = type(backends.get("reference"))()
    lengths = torch.tensor([9, 1], dtype=torch.int32)  # past the 8 columns: a value error
    be.topk(torch.randn(2, 8), 2, lengths)  # unchecked: mapped to the defined result
    with be.validating(), pytest.raises(ValueError, match="lengths"):
        be.topk(torch.randn(2, 8), 2, lengths)
    be.topk(torch.randn(2, 8), 2, lengths)
