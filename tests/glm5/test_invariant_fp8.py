"""The FP8 checkpoint path in the layout-invariant mode (SPEC 12, quant/fp8_modules.py): activations quantized
per 1 x 128 group as the FP8 path does, activations and 128 x 128 weight blocks de-quantized to fp32, then
the mode's exact product. The FP8 tiny model's logits and top-k sets are the same bits at TP 2 + EP 2 (the
row-parallel FP8 linears take the split), batch 1 vs 4, prefill vs decode and on both backends; the
normal mode's row-parallel float sum is not. The FP8 caches' kernels do not declare the mode: refused."""

from __future__ import annotations

import pytest
import torch

import backends
from backends.formats import quantize_weight_blocks
from backends.invariant.gemm import grid_bits
from glm5.parallel import plan
from glm5.parallel.group import TorchGroup
from glm5.parallel.invariant import NotLayoutInvariant, layout_invariant
from quant.fp8 import to_fp8_modules
from quant.fp8_modules import FP8Linear
from tests.glm5.test_invariant_layouts import _forward, _ids, _model, _same, assert_batch_and_decode_bitwise
from tests.ranks import run_ranks

#: tiny, widened so every TP 2 split is whole 128-blocks: q_b_proj 4 heads x (56 + 8) rows, o_proj 4 x 64
#: columns, the dense MLP's 512 (four K blocks: the normal mode's fp32 block sum then differs when split)
#: and the shared expert's 256
WIDE = dict(qk_nope_head_dim=56, v_head_dim=64, intermediate_size=512, moe_intermediate_size=256)


def _fp8(backend: str):
    model = _model(backend, **WIDE)
    return to_fp8_modules(model, model.backend).eval()


def _rank(rank: int, world: int, backend: str) -> dict:
    model = _fp8(backend)
    plan.apply(model, tp=TorchGroup(), ep=TorchGroup())
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "FP8Linear"
    return {"invariant": _forward(model, _ids(), True), "normal": _forward(model, _ids(), False)}


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_fp8_tp2_ep2_is_the_unsplit_bits_in_the_mode(backend):
    model = _fp8(backend)
    ref, ref_normal = _forward(model, _ids(), True), _forward(model, _ids(), False)
    results = run_ranks(_rank, 2, backend)
    for r in results:
        assert _same(r["invariant"], ref)
    # the normal mode adds the ranks' fp32 block sums, not the blocks in order: the comparison can fail
    assert not torch.equal(results[0]["normal"][0], ref_normal[0])


def test_fp8_batch_and_decode_bitwise_and_the_same_on_both_backends():
    model, ids = _fp8("cpu"), _ids()
    full = assert_batch_and_decode_bitwise(model, ids)
    assert _same(_forward(_fp8("reference"), ids, True), full)
    # the FP8 ops of both backends are batch invariant too, so what can fail here is the path: the mode's
    # logits are not the FP8 GEMMs'
    assert not torch.equal(_forward(model, ids, False)[0], full[0])


def test_an_fp8_linear_in_the_mode_is_the_fp8_path_within_the_grid_rounding():
    """Both quantize x to e4m3 the same way; they differ in the product: the normal path sums exact block
    dots in fp32 (K/128 + 3 roundings of terms bounded by sum |a b|), the mode rounds x_deq and W_deq once
    each (fp32 products) and each row of x_deq / column of W_deq^T to the grid of t bits below its max
    (an element off by at most max 2^-t, so the product by at most ~2 K 2^-t row max x column max), then
    rounds once."""
    g = torch.Generator().manual_seed(4)
    k, n = 320, 200  # a partial last group and block
    w = torch.randn(n, k, generator=g) * 0.05
    lin = FP8Linear(k, n, backend=backends.get("cpu"), bias=True)
    lin.set_fp8(*quantize_weight_blocks(w), torch.randn(n, generator=g))
    x = torch.randn(3, 7, k, generator=g)
    with torch.no_grad():
        normal = lin(x)
        with layout_invariant(lin.backend):
            exact = lin(x)
    xq, xs = lin.backend.fp8_quant_group(x.reshape(-1, k), 128, 1e-4, False)
    a = (xq.float() * xs.repeat_interleave(128, -1)[:, :k]).double()
    b = lin.dequantized().double().T
    grid = 3 * k * 2.0 ** -grid_bits(k) * a.abs().amax(1, keepdim=True) * b.abs().amax(0, keepdim=True)
    sums = (k / 128 + 8) * 2.0**-23 * (a.abs() @ b.abs())
    bound = (grid + sums).float().view(3, 7, n) + 2.0**-23 * normal.abs()
    diff = (exact - normal).abs()
    assert (diff <= bound).all(), float((diff - bound).max())
    assert 0 < diff.max() and bound.max() < 1e-4 * normal.abs().max()  # not bitwise: the grid's path ran
    assert set(lin.state_dict()) == {"weight", "weight_scale_inv", "bias"}  # W_deq is no buffer
    fresh = FP8Linear(k, n, backend=lin.backend, bias=True)
    fresh.set_fp8(*quantize_weight_blocks(-w), lin.bias)
    lin.set_fp8(*quantize_weight_blocks(-w))  # new weights in place: de-quantized again
    with torch.no_grad(), layout_invariant(lin.backend):
        assert torch.equal(lin(x), fresh(x)) and not torch.equal(lin(x), exact)
    q, scale = quantize_weight_blocks(w)
    lin.weight.data.copy_(q)  # a `.data` write: no version bump, still de-quantized again
    lin.weight_scale_inv.data.copy_(scale)
    with torch.no_grad(), layout_invariant(lin.backend):
        assert torch.equal(lin(x), exact)


def test_the_mode_refuses_the_fp8_caches():
    model = _model("reference")
    model.kv_cache_dtype = "fp8_ds_mla"
    _forward(model, _ids()[:1], False)  # the normal mode reads them
    with pytest.raises(NotLayoutInvariant, match="^fp8_ragged cache: indexer_topk's kernel"):
        _forward(model, _ids()[:1], True)
