"""The layout-invariant mode under torch.inference_mode (how vLLM runs a model's forward).

There, composite ops (F.linear, einsum, layer_norm, log_softmax.int, ...) reach the mode whole instead of as
mm / bmm / native_layer_norm / _log_softmax: the mode must decompose them, or a linear is the BLAS's product
and a row-parallel layer's pending exact sum is never taken (its partial then passes for the whole sum).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends import invariant as num
from glm5.parallel.group import Single
from glm5.parallel.invariant import layout_invariant, row_parallel_next


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


def test_row_parallel_marker_is_taken_by_a_linear_under_inference_mode():
    x, w = _inputs()
    with torch.inference_mode(), layout_invariant():
        row_parallel_next(Single(), x.shape[1])
        F.linear(x, w)
        assert num.take_row_parallel() is None
