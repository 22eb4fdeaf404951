"""cuda grouped_matmul: one launch over all experts (device-side tile schedule), empty experts, experts
smaller and larger than a tile, float / W8A8 / W4A8 against the reference.

Semantics: backends/reference/grouped_matmul.py (SPEC 2.8)
"""

from __future__ import annotations

import pytest
import torch

from backends.reference.grouped_matmul import grouped_matmul as reference
from backends.reference.w4a8_matmul import pack_int4
from kernels_cuda.grouped_matmul import tile_schedule
from tests.backends.cuda.conftest import skip_bf16_interpreted

SIZES = [[3, 0, 40, 1], [0, 0, 5], [70], [1, 2, 3, 0, 5, 6, 7, 33], [0, 4, 0]]
#: default float tolerances (SPEC 4): the kernel's fp32 sum order differs from the reference's matmul
TOL = {torch.float32: (1.3e-6, 1e-5), torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}


def _offsets(sizes, dtype=torch.int64):
    return torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=dtype)


def _quant(sizes, n, k, variant, group_size=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    m, e = sum(sizes), len(sizes)
    a = dict(
        x=torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8),
        group_offsets=_offsets(sizes),
        x_scale=torch.rand(m, generator=g) * 0.02 + 1e-3,
    )
    if variant == "w8a8":
        a |= dict(
            w=torch.randint(-128, 128, (e, n, k), generator=g, dtype=torch.int8),
            w_scale=torch.rand(e, n, generator=g) * 0.01 + 1e-3,
        )
    else:
        a |= dict(
            w=pack_int4(torch.randint(-8, 8, (e, n, k), generator=g)),
            group_size=group_size,
            w_scale=torch.rand(e, n, k // group_size, generator=g) * 0.1 + 1e-3,
        )
    return a


def _on(device, args):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sizes", SIZES)
def test_float_matches_reference(cuda, device, dtype, sizes):
    skip_bf16_interpreted(dtype)
    g = torch.Generator().manual_seed(len(sizes))
    m, e, n, k = sum(sizes), len(sizes), 20, 48
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(e, n, k, generator=g).to(dtype)
    out = cuda.grouped_matmul(x.to(device), w.to(device), _offsets(sizes).to(device))
    assert out.dtype == dtype
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.cpu(), reference(x, w, _offsets(sizes)), rtol=rtol, atol=atol)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sizes", SIZES)
def test_w8a8_bitwise_equal_to_reference(cuda, device, out_dtype, sizes):
    skip_bf16_interpreted(out_dtype)
    a = _quant(sizes, 24, 80, "w8a8", seed=sum(sizes))
    out = cuda.grouped_matmul(**_on(device, a), out_dtype=out_dtype)
    assert torch.equal(out.cpu(), reference(**a, out_dtype=out_dtype))


@pytest.mark.parametrize("group_size", [96, 32, 48])
@pytest.mark.parametrize("sizes", SIZES)
def test_w4a8_bitwise_equal_to_reference(cuda, device, group_size, sizes):
    a = _quant(sizes, 24, 96, "w4a8", group_size, seed=sum(sizes))
    out = cuda.grouped_matmul(**_on(device, a), out_dtype=torch.float16)
    assert torch.equal(out.cpu(), reference(**a, out_dtype=torch.float16))


def test_one_launch_for_all_experts(cuda, device, launches):
    cuda.grouped_matmul(**_on(device, _quant([5, 0, 9, 2, 0, 1], 16, 32, "w8a8")), out_dtype=torch.float32)
    assert launches() == {"grouped_matmul": 1}


def test_tile_schedule_numbers_every_tile_once(device):
    sizes = [0, 5, 0, 64, 65, 1, 0]
    offs, tile_expert, tile_first, t_max = tile_schedule(_offsets(sizes).to(device), sum(sizes), 32)
    tiles = [-(-s // 32) for s in sizes]  # ceil(s / 32) per expert
    expect = [e for e, t in enumerate(tiles) for _ in range(t)]
    got = tile_expert.cpu().tolist()
    assert got[: len(expect)] == expect and all(t == len(sizes) for t in got[len(expect) :])
    assert tile_first.cpu().tolist() == [sum(tiles[:e]) for e in range(len(sizes))]
    assert offs.cpu().tolist() == _offsets(sizes).tolist()
    assert t_max >= len(expect)


def test_rows_do_not_depend_on_order_within_expert(cuda, device):
    a = _quant([7, 12], 16, 64, "w8a8", seed=4)
    perm = torch.cat([torch.randperm(7), 7 + torch.randperm(12)])
    out = cuda.grouped_matmul(**_on(device, a), out_dtype=torch.float32).cpu()
    shuffled = dict(a, x=a["x"][perm], x_scale=a["x_scale"][perm])
    assert torch.equal(cuda.grouped_matmul(**_on(device, shuffled), out_dtype=torch.float32).cpu(), out[perm])


def test_bad_offsets_name_the_argument(cuda, device):
    a = _on(device, _quant([2, 3], 8, 32, "w8a8"))
    with pytest.raises(ValueError, match="^group_offsets: expected non-decreasing"), cuda.validating():
        cuda.grouped_matmul(
            **(a | {"group_offsets": torch.tensor([0, 4, 3], device=device)}), out_dtype=torch.float32
        )
