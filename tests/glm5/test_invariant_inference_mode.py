"""The layout-invariant mode under torch.inference_mode (how vLLM runs a model's forward).

There, composite ops (F.linear, einsum, layer_norm, log_softmax.int, ...) reach the mode whole instead of as
mm / bmm / native_layer_norm / _log_softmax: the mode must decompose them, or a linear is the BLAS's product
and its bits are the BLAS's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.invariant import engine as num
from glm5.parallel.group import Single
from glm5.parallel.invariant import RowSplit, layout_invariant, linear


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 512, generator=g)
    w = torch.randn(64, 512, generator=g)
    return x, w


def _ops(x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    y = F.linear(x, w)
    return [
        y,
        torch.einsum("mk,nk->mn", x, w),
        F.layer_norm(x, (512,)),
        torch.log_softmax(y, -1),
    ]


def test_composite_ops_under_inference_mode_are_the_modes():
    x, w = _inputs()
    with torch.no_grad(), layout_invariant():
        want = _ops(x, w)
    with torch.inference_mode(), layout_invariant():
        got = _ops(x, w)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"op {i}: max diff {(a - b).abs().max()}"
    assert torch.equal(want[0], num.exact_matmul(x, w.t()))
    assert not torch.equal(F.linear(x, w), want[0])  # the BLAS's product differs: the check can fail


def test_a_row_parallel_linear_takes_its_split_as_an_argument_under_inference_mode():
    x, w = _inputs()
    with torch.inference_mode(), layout_invariant():
        got = linear(x[None], w, None, RowSplit(Single(), x.shape[1]))
        after = F.linear(x, w)  # nothing is left pending for the next product
    assert torch.equal(got[0], num.exact_matmul(x, w.t()))
    assert torch.equal(after, got[0])
