"""Weights are laid out once: `Backend.prepare` runs when the model's backend is set (and after loading),
never per call, and one assignment of `model.backend` reaches every layer, quantized ones included."""

from __future__ import annotations

import dataclasses

import torch

import backends
from backends.reference import ReferenceBackend
from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from quant.modules import QuantExperts, QuantLinear
from quant.quantize import quantize_model


def _k_major(w: torch.Tensor) -> bool:
    return w.dim() == 2 and w.stride() == (1, w.shape[0])


class KMajor(ReferenceBackend):
    """The reference's ops, but w8a8_matmul wants its weight K-major (as npu_quant_matmul does): prepare
    makes that copy once; the op counts every call that had to re-lay out an unprepared weight."""

    name = "kmajor"

    def __init__(self) -> None:
        super().__init__()
        self.prepared = 0
        ref = ReferenceBackend.ops["w8a8_matmul"]

        def prepare(w):
            self.prepared += 1
            return w | {"w_q": w["w_q"].T.contiguous().T}  # same logical [N, K] and values, K-major storage

        def w8a8_matmul(x_q, x_scale, w_q, w_scale, bias=None, out_dtype=torch.bfloat16):
            if not _k_major(w_q):
                self.relayouts["w8a8_matmul"] += 1
                w_q = w_q.T.contiguous().T
            return ref.fn(x_q, x_scale, w_q, w_scale, bias, out_dtype)

        self.ops = dict(ReferenceBackend.ops) | {
            "w8a8_matmul": dataclasses.replace(ref, fn=w8a8_matmul, prepare=prepare)
        }


def test_prepared_once_and_reaches_every_quantized_layer():
    torch.manual_seed(0)
    cfg = GLM5Config.from_preset("tiny")
    model = GLM5ForCausalLM(cfg, "reference").eval()
    quantize_model(model, "glm5-w8a8")
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        want = model(ids).logits
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears and any(isinstance(m, QuantExperts) for m in model.modules())

    be = KMajor()
    model.backend = be  # one assignment: every layer, attention and quantized linears alike
    assert all(m.backend is be for m in linears)
    assert be.prepared == len(linears)
    with torch.no_grad():
        for _ in range(2):
            got = model(ids).logits
    assert be.prepared == len(linears)  # not per call
    assert be.relayouts["w8a8_matmul"] == 0 and be.calls["w8a8_matmul"] >= 2 * len(linears)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # prepare changes storage, never values


def test_an_unprepared_weight_is_seen_and_counted():
    be = KMajor()
    x_q = torch.randint(-127, 128, (3, 16), dtype=torch.int8)
    w_q = torch.randint(-127, 128, (5, 16), dtype=torch.int8)
    args = dict(x_scale=torch.rand(3), w_scale=torch.rand(5), bias=None, out_dtype=torch.float32)
    raw = be.w8a8_matmul(x_q, w_q=w_q, **args)
    assert be.relayouts["w8a8_matmul"] == 1
    prepared = be.prepare("w8a8_matmul", w_q=w_q)["w_q"]
    assert torch.equal(be.w8a8_matmul(x_q, w_q=prepared, **args), raw)
    assert be.relayouts["w8a8_matmul"] == 1
    assert backends.get("reference").prepare("w8a8_matmul", w_q=w_q)["w_q"] is w_q  # identity by default
