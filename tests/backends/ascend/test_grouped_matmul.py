"""grouped_matmul through the emulated npu_grouped_matmul (MoE form)."""

from __future__ import annotations

import torch

from backends.ascend import grouped_matmul as mod
from backends.reference.w4a8_matmul import pack_int4

OFFS = torch.tensor([0, 4, 4, 11, 13])  # an empty expert


def _args(kind: str, g: torch.Generator):
    x = torch.randn(13, 32, generator=g)
    if kind == "float":
        return dict(x=x.bfloat16(), w=torch.randn(4, 24, 32, generator=g).bfloat16(), group_offsets=OFFS)
    x_q = torch.randint(-128, 128, (13, 32), generator=g, dtype=torch.int8)
    base = dict(x=x_q, group_offsets=OFFS, x_scale=torch.rand(13, generator=g), out_dtype=torch.bfloat16)
    if kind == "w8a8":
        return base | dict(
            w=torch.randint(-128, 128, (4, 24, 32), generator=g, dtype=torch.int8),
            w_scale=torch.rand(4, 24, generator=g),
        )
    gs = 32 if kind == "w4a8" else 8
    return base | dict(
        w=pack_int4(torch.randint(-8, 8, (4, 24, 32), generator=g)),
        w_scale=torch.rand(4, 24, 32 // gs, generator=g),
        group_size=gs,
    )


def test_every_variant_matches_reference(backend, reference):
    g = torch.Generator().manual_seed(0)
    for kind in ("float", "w8a8", "w4a8", "w4a8_group"):
        a = _args(kind, g)
        assert torch.equal(backend.grouped_matmul(**a), reference.grouped_matmul(**a)), kind


def test_counts_passed_as_cumulative_make_conformance_fail(backend, reference, monkeypatch):
    monkeypatch.setattr(mod, "group_list", lambda offs: (offs[1:] - offs[:-1]).to(torch.int64))
    a = _args("float", torch.Generator().manual_seed(0))
    try:
        broke = not torch.equal(backend.grouped_matmul(**a), reference.grouped_matmul(**a))
    except RuntimeError:
        broke = True
    assert broke


def test_group_list_as_counts_is_equivalent(backend, reference, monkeypatch):
    monkeypatch.setattr(mod, "GROUP_LIST_TYPE", 1)
    a = _args("w8a8", torch.Generator().manual_seed(1))
    assert torch.equal(backend.grouped_matmul(**a), reference.grouped_matmul(**a))


def test_forms_outside_the_operator_run_kernels_per_expert(backend, reference):
    g = torch.Generator().manual_seed(2)
    a = _args("float", g)
    a["x"], a["w"] = a["x"].float(), a["w"].float()
    torch.testing.assert_close(
        backend.grouped_matmul(**a), reference.grouped_matmul(**a), rtol=2e-5, atol=1e-5
    )
    for kind in ("w8a8", "w4a8"):
        a = _args(kind, g) | {"out_dtype": torch.float32}
        assert torch.equal(backend.grouped_matmul(**a), reference.grouped_matmul(**a)), kind
    assert any("per expert" in route for _, route in backend.provider.routes)
