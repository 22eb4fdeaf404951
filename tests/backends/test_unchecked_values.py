"""Values the hot path does not check (SPEC 9, 10): topk `lengths`, `group_offsets` and cross-entropy
`targets` are value-checked (ValueError) only under GLM5_VALIDATE=values; without it every backend gives
the one defined result of SPEC 10 for out-of-range values: lengths clamped to [0, C], offsets clamped and
sorted, an out-of-range target makes the loss NaN. Also: a top-k far wider than its
candidates is refused before allocating, and tensors on another device (meta) get one NotSupported line
before any value check reads them.
"""

from __future__ import annotations

import pytest
import torch

import backends
from backends import NotSupported, SeqLayout
from backends.argcheck import MAX_PADDED_TOPK

BACKENDS = ["reference", "cpu", "onnxruntime"]


@pytest.fixture(params=BACKENDS)
def be(request, monkeypatch):
    try:
        b = backends.get(request.param)
    except backends.BackendUnavailable as exc:  # onnxruntime runs in its own tox env
        pytest.skip(str(exc).splitlines()[0])
    monkeypatch.setattr(b, "validate_values", False)  # the hot path, whatever GLM5_VALIDATE says here
    return b


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


# -- topk lengths --------------------------------------------------------------------------------------


def test_topk_lengths_out_of_range_are_clamped_to_columns(be):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g)
    bad = torch.tensor([-3, 2, 20, 8], dtype=torch.int32)
    values, indices = be.topk(x, 5, bad)
    ref_values, ref_indices = backends.get("reference").topk(x, 5, torch.tensor([0, 2, 8, 8]))
    assert torch.equal(indices, ref_indices)
    assert torch.equal(_bits(values), _bits(ref_values))
    assert (indices[0] == -1).all() and torch.isinf(values[0]).all()


def test_topk_lengths_out_of_range_raise_under_validation(be):
    with be.validating(), pytest.raises(ValueError, match=r"^lengths: expected values in \[0, 8\]"):
        be.topk(torch.randn(2, 8), 2, torch.tensor([-1, 3]))


# -- grouped_matmul group_offsets ------------------------------------------------------------------------

# given offsets (M = 6) -> the defined ones: 0, then the later ones clamped to [0, M] and sorted (ending
# short of M is legal: rows past the last offset are padding, zero in the output)
DEFINED_OFFSETS = [
    ([0, 3, 4], [0, 3, 4]),  # ends short of M: legal
    ([0, 4, 2], [0, 2, 4]),  # decreasing
    ([0, 2, 8], [0, 2, 6]),  # past M
    ([1, 3, 6], [0, 3, 6]),  # starts past 0
    ([0, -1, 6], [0, 0, 6]),  # negative
    ([0, 5, 2, 6], [0, 2, 5, 6]),  # inner offsets out of order
    ([0, 9, -4, 3], [0, 0, 3, 6]),  # both ways out of range
]


@pytest.mark.parametrize(("given", "defined"), DEFINED_OFFSETS, ids=[str(g) for g, _ in DEFINED_OFFSETS])
def test_grouped_matmul_bad_offsets_give_the_defined_grouping(be, given, defined):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(6, 4, generator=g), torch.randn(len(given) - 1, 5, 4, generator=g)
    out = be.grouped_matmul(x, w, torch.tensor(given))
    assert out.shape == (6, 5)  # every row of x has its output row
    want = be.grouped_matmul(x, w, torch.tensor(defined))
    assert torch.equal(_bits(out), _bits(want))
    ref = backends.get("reference").grouped_matmul(x, w, torch.tensor(defined))
    torch.testing.assert_close(out, ref)


def test_grouped_matmul_bad_offsets_raise_under_validation(be):
    with be.validating(), pytest.raises(ValueError, match=r"^group_offsets: expected non-decreasing"):
        be.grouped_matmul(torch.randn(6, 4), torch.randn(2, 5, 4), torch.tensor([0, 3, 7]))


def test_given_offsets_are_not_modified(be):
    offs = torch.tensor([1, 3, 4])
    be.grouped_matmul(torch.randn(6, 4), torch.randn(2, 5, 4), offs)
    assert offs.tolist() == [1, 3, 4]


# -- linear_cross_entropy targets ------------------------------------------------------------------------


@pytest.mark.parametrize("bad_target", [-5, 10, -101])
def test_cross_entropy_target_out_of_range_makes_the_loss_nan(be, bad_target):
    g = torch.Generator().manual_seed(2)
    h, weight = torch.randn(4, 8, generator=g), torch.randn(10, 8, generator=g)
    loss = be.linear_cross_entropy(h, weight, torch.tensor([1, 2, bad_target, 3]), -100)
    assert torch.isnan(loss)
    fine = be.linear_cross_entropy(h, weight, torch.tensor([1, 2, -100, 3]), -100)
    assert torch.isfinite(fine)  # ignore_index is still ignored, not counted as out of range


@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_cross_entropy_bad_target_gradients_are_zero(name, monkeypatch):
    b = backends.get(name)
    monkeypatch.setattr(b, "validate_values", False)
    h = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    loss = b.linear_cross_entropy(h, weight, torch.tensor([1, 10, 2, 3]), -100)
    loss.backward()
    assert torch.isnan(loss)
    assert torch.equal(h.grad, torch.zeros_like(h)) and torch.equal(weight.grad, torch.zeros_like(weight))


def test_cross_entropy_bad_target_raises_under_validation(be):
    with be.validating(), pytest.raises(ValueError, match=r"^targets: expected values in \[0, V=10\)"):
        be.linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, -5, 2, 3]), -100)


# -- a top-k far wider than its candidates ---------------------------------------------------------------


def test_topk_k_far_past_the_columns_is_refused_before_allocating(be):
    with pytest.raises(ValueError, match=r"^k: expected an int in \[1, max\(8, 65536\)\]"):
        be.topk(torch.randn(2, 8), 2**62)
    values, indices = be.topk(torch.randn(1, 8), MAX_PADDED_TOPK)  # padding up to the limit is served
    assert indices.shape == (1, MAX_PADDED_TOPK) and (indices[:, 8:] == -1).all()


def test_indexer_topk_far_past_the_cache_is_refused(be):
    lay = SeqLayout.from_lengths([3], [5])
    args = dict(q=torch.randn(3, 2, 4), k_cache=torch.randn(5, 4), weights=torch.randn(3, 2), layout=lay)
    with pytest.raises(ValueError, match=r"^topk: expected an int in \[1, max\(5, 65536\)\]"):
        be.indexer_topk(**args, topk=2**62)


def test_fp8_indexer_topk_far_past_the_cache_is_refused(be):
    from backends.reference.fp8_indexer_logits import quantize_indexer_inputs

    if be.name == "onnxruntime":
        pytest.skip("onnxruntime does not serve the FP8 ops")
    lay = SeqLayout.from_lengths([3], [5])
    q, k, ks, w = quantize_indexer_inputs(torch.randn(3, 2, 128), torch.randn(5, 128), torch.randn(3, 2))
    with pytest.raises(ValueError, match=r"^topk: expected an int in \[1, max\(5, 65536\)\]"):
        be.fp8_indexer_topk(q, k, ks, w, lay, 2**62)


# -- meta tensors ----------------------------------------------------------------------------------------


def test_meta_tensors_get_one_line_before_any_value_check(be):
    x, lengths = torch.randn(2, 8, device="meta"), torch.tensor([1, 2], device="meta")
    with be.validating(), pytest.raises(NotSupported, match=r"x is on meta; this backend runs on cpu"):
        be.topk(x, 2, lengths)
    with be.validating(), pytest.raises(NotSupported, match=r"x is on meta; this backend runs on cpu"):
        be.grouped_matmul(x, torch.randn(1, 3, 8, device="meta"), torch.tensor([0, 2], device="meta"))


def test_meta_layout_gets_one_line_not_a_copy_error(be):
    m = "meta"
    lay = SeqLayout(
        torch.tensor([0, 2], dtype=torch.int32, device=m),
        torch.tensor([4], dtype=torch.int32, device=m),
        cu_seqlens_k=torch.tensor([0, 4], dtype=torch.int32, device=m),
    )
    q, k_cache = torch.randn(2, 4, 8, device=m), torch.randn(4, 8, device=m)
    with pytest.raises(NotSupported, match=r"q is on meta; this backend runs on cpu"):
        be.indexer_logits(q, k_cache, torch.randn(2, 4, device=m), lay)


def test_meta_through_the_custom_op_uses_its_fake(be):
    values, indices = torch.ops.glm5.topk(torch.randn(2, 8, device="meta"), 3, None, be.key)
    assert values.device.type == "meta" and values.shape == (2, 3) and indices.dtype == torch.int32


def test_indexer_with_no_heads_and_a_list_for_a_tensor_are_one_value_error_on_every_backend(be):
    """Zero indexer heads failed in a reshape on reference and cpu and returned zeros on onnxruntime; a
    list for k_scale raised AttributeError: now the front door's ValueError naming the argument."""
    lay = SeqLayout.from_lengths([2], [4])
    q, k, w = torch.zeros(2, 0, 8), torch.zeros(4, 8), torch.zeros(2, 0)
    with pytest.raises(ValueError, match=r"^q: expected \[T, H_I, D_I\] with H_I >= 1"):
        be.indexer_topk(q, k, w, lay, topk=2)
    e4m3 = torch.float8_e4m3fn
    q8, k8, w8 = torch.zeros(2, 2, 8, dtype=e4m3), torch.zeros(4, 8, dtype=e4m3), torch.zeros(2, 2)
    with pytest.raises(ValueError, match="^k_scale: expected a torch.Tensor, got list"):
        be.fp8_indexer_topk(q8, k8, [1.0] * 4, w8, lay, topk=2)
