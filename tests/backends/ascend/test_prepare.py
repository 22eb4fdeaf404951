"""Backend.prepare on Ascend: weights laid out once, never per call.

Prepared weights: `relayouts` stays 0 over several calls and the outputs are bitwise those of the
unprepared call; unprepared weights: every call re-lays out and `relayouts[op]` rises by one per call.
A prepared weight keeps the contract's logical shape, dtype and values (so the reference takes it too).
"""

from __future__ import annotations

import pytest
import torch

from backends.ascend import _adapters as ad
from backends.reference.w4a8_matmul import pack_int4

CALLS = 3
OFFS = torch.tensor([0, 4, 4, 11, 13])  # an empty expert


def _w8a8(g):
    return dict(
        x_q=torch.randint(-128, 128, (5, 64), generator=g, dtype=torch.int8),
        x_scale=torch.rand(5, generator=g),
        w_q=torch.randint(-128, 128, (24, 64), generator=g, dtype=torch.int8),
        w_scale=torch.rand(24, generator=g),
        out_dtype=torch.bfloat16,
    )


def _w4a8(g):
    return dict(
        x_q=torch.randint(-128, 128, (5, 64), generator=g, dtype=torch.int8),
        x_scale=torch.rand(5, generator=g),
        w_packed=pack_int4(torch.randint(-8, 8, (24, 64), generator=g)),
        w_scale=torch.rand(24, 1, generator=g),
        group_size=64,
        out_dtype=torch.bfloat16,
    )


def _grouped(kind):
    def build(g):
        x_q = torch.randint(-128, 128, (13, 32), generator=g, dtype=torch.int8)
        q = dict(x=x_q, group_offsets=OFFS, x_scale=torch.rand(13, generator=g), out_dtype=torch.bfloat16)
        if kind == "float":
            w = torch.randn(4, 24, 32, generator=g).bfloat16()
            return dict(x=torch.randn(13, 32, generator=g).bfloat16(), w=w, group_offsets=OFFS)
        if kind == "w8a8":
            w = torch.randint(-128, 128, (4, 24, 32), generator=g, dtype=torch.int8)
            return q | dict(w=w, w_scale=torch.rand(4, 24, generator=g))
        w = pack_int4(torch.randint(-8, 8, (4, 24, 32), generator=g))
        return q | dict(w=w, w_scale=torch.rand(4, 24, 1, generator=g), group_size=32)

    return build


CASES = {
    "w8a8_matmul": ("w8a8_matmul", _w8a8, ("w_q", "w_scale")),
    "w4a8_matmul": ("w4a8_matmul", _w4a8, ("w_packed", "w_scale")),
    "grouped_float": ("grouped_matmul", _grouped("float"), ("w",)),
    "grouped_w8a8": ("grouped_matmul", _grouped("w8a8"), ("w", "w_scale")),
    "grouped_w4a8": ("grouped_matmul", _grouped("w4a8"), ("w", "w_scale")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_prepared_weights_are_never_relaid_out(backend, reference, name):
    op, build, weight_names = CASES[name]
    args = build(torch.Generator().manual_seed(0))
    call = getattr(backend, op)
    unprepared = [call(**args) for _ in range(CALLS)]
    assert backend.relayouts[op] == CALLS  # the test can fail: unprepared weights re-lay out per call
    prepared = backend.prepare(op, **{n: args[n] for n in weight_names})
    for n in weight_names:  # the contract's logical weight: shape, dtype, values
        assert prepared[n].shape == args[n].shape and torch.equal(prepared[n], args[n])
    before = backend.relayouts[op]
    outs = [call(**(args | prepared)) for _ in range(CALLS)]
    assert backend.relayouts[op] == before
    for out in outs:
        assert torch.equal(out, unprepared[0])
    assert torch.equal(getattr(reference, op)(**(args | prepared)), getattr(reference, op)(**args))


def test_k_major_storage_is_what_the_operator_is_given(backend, monkeypatch):
    args = _w8a8(torch.Generator().manual_seed(1))
    w = backend.prepare("w8a8_matmul", w_q=args["w_q"])["w_q"]
    seen = []
    orig = backend.provider.module.npu_quant_matmul
    monkeypatch.setattr(
        backend.provider.module,
        "npu_quant_matmul",
        lambda x1, x2, *a, **k: seen.append(x2) or orig(x1, x2, *a, **k),
    )
    backend.w8a8_matmul(**(args | {"w_q": w}))
    assert seen[0].data_ptr() == w.data_ptr() and seen[0].is_contiguous()  # the prepared storage itself


def test_an_in_place_edit_invalidates_the_stored_int4_form(backend, reference):
    args = _w4a8(torch.Generator().manual_seed(2))
    prepared = backend.prepare("w4a8_matmul", w_packed=args["w_packed"], w_scale=args["w_scale"])
    a = args | prepared
    backend.w4a8_matmul(**a)
    assert backend.relayouts["w4a8_matmul"] == 0
    a["w_scale"].mul_(2)  # the stored repack holds the old scale: it must not be used
    assert torch.equal(backend.w4a8_matmul(**a), reference.w4a8_matmul(**a))
    assert backend.relayouts["w4a8_matmul"] == 1


def test_wide_w8a8_weights_keep_their_blocks(backend, reference, monkeypatch):
    from backends.ascend import w8a8_matmul as mod

    monkeypatch.setattr(mod, "QMM_MAX_LAST_DIM", 10)  # stand-in for 65535; 24 columns: blocks 10, 10, 4
    args = _w8a8(torch.Generator().manual_seed(3))
    args["x_q"] = args["x_q"][:, :8].contiguous()  # K = 8 stays under the stand-in limit
    args["w_q"] = args["w_q"][:, :8].contiguous()
    prepared = backend.prepare("w8a8_matmul", w_q=args["w_q"])
    out = backend.w8a8_matmul(**(args | prepared))
    assert backend.relayouts["w8a8_matmul"] == 0 and backend.provider.calls["npu_quant_matmul"] == 3
    assert torch.equal(out, backend.w8a8_matmul(**args))  # the unprepared call, blocks copied per call
    assert backend.relayouts["w8a8_matmul"] == 1


def test_repack_helper_is_the_stored_form():
    g = torch.Generator().manual_seed(4)
    w = pack_int4(torch.randint(-8, 8, (2, 16, 8), generator=g))
    s = torch.rand(2, 16, generator=g)
    weight, bits, bias, n8 = ad.repack_w4_for_npu(w, s)
    assert weight.dtype == torch.int32 and weight.shape == (2, 8, 2) and n8 == 16
