"""cuda w4a8_matmul: in-kernel int4 unpack (SPEC 2.7 nibble order, -8), per-channel and per-group scales,
group sizes that do not tile the K step, bitwise equal to the reference, one launch per call.

Semantics: backends/reference/w4a8_matmul.py (SPEC 2.7)
"""

from __future__ import annotations

import pytest
import torch

from backends import NotSupported
from backends.cuda.w4a8_matmul import MAX_GROUP
from backends.reference.w4a8_matmul import pack_int4
from backends.reference.w4a8_matmul import w4a8_matmul as reference
from tests.backends.cuda.conftest import skip_bf16_interpreted

OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _args(m, n, k, group_size, *, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    return dict(
        x_q=torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8),
        x_scale=torch.rand(m, generator=g) * 0.02 + 1e-3,
        w_packed=pack_int4(w),
        w_scale=torch.rand(n, k // group_size, generator=g) * 0.1 + 1e-3,
        group_size=group_size,
        bias=torch.randn(n, generator=g) if bias else None,
    )


def _on(device, args):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize(
    "m,n,k,group_size,bias",
    [
        (1, 1, 2, 2, False),  # one byte
        (3, 40, 64, 64, True),  # per-channel
        (70, 33, 256, 32, False),  # per-group, several groups per K step on a GPU
        (5, 17, 384, 128, True),  # GLM-5-like group
        (9, 20, 192, 48, False),  # group not a multiple of any power-of-two K step
        (4, 6, 300, 300, False),  # per-channel, K not a multiple of the step
    ],
)
def test_bitwise_equal_to_reference(cuda, device, out_dtype, m, n, k, group_size, bias):
    skip_bf16_interpreted(out_dtype)
    a = _args(m, n, k, group_size, seed=m + n + k, bias=bias)
    out = cuda.w4a8_matmul(**_on(device, a), out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert torch.equal(out.cpu(), reference(**a, out_dtype=out_dtype))


def test_nibble_order_and_sign_extension(cuda, device):
    # one-hot activations read single weights back: column k must be w[n, k] from SPEC 2.7's packing
    w = torch.tensor([[-8, 7, -1, 0, 3, -5, 1, -2]], dtype=torch.int8)
    packed = pack_int4(w)
    assert packed.tolist() == [[0x78, 0x0F, 0xB3, 0xE1]]
    x = torch.eye(8, dtype=torch.int8)
    out = cuda.w4a8_matmul(
        x.to(device),
        torch.ones(8, device=device),
        packed.to(device),
        torch.ones(1, 1, device=device),
        8,
        out_dtype=torch.float32,
    )
    assert out.cpu()[:, 0].tolist() == w[0].float().tolist()


def test_group_sums_are_exact_and_in_group_order(cuda, device):
    # per-group partial sums of -128 * -8 * 1024 = 2**20 with scales that make fp32 order matter
    k, gs = 3072, 1024
    x = torch.full((2, k), -128, dtype=torch.int8)
    w = torch.full((3, k), -8, dtype=torch.int8)
    w[1, 5] = 7
    scales = torch.tensor([[1.0, 2**-24, -1.0]] * 3)
    a = dict(x_q=x, x_scale=torch.ones(2), w_packed=pack_int4(w), w_scale=scales, group_size=gs)
    out = cuda.w4a8_matmul(**_on(device, a), out_dtype=torch.float32)
    assert torch.equal(out.cpu(), reference(**a, out_dtype=torch.float32))


def test_one_launch(cuda, device, launches):
    cuda.w4a8_matmul(**_on(device, _args(4, 8, 64, 32)), out_dtype=torch.float32)
    assert launches() == {"w4a8_matmul": 1}


def test_huge_group_is_declined(cuda, device, launches):
    k = MAX_GROUP + 1  # 2**21: one group past the int32-safe size
    a = dict(
        x_q=torch.zeros(1, k, dtype=torch.int8),
        x_scale=torch.ones(1),
        w_packed=torch.zeros(1, k // 2, dtype=torch.uint8),
        w_scale=torch.ones(1, 1),
        group_size=k,
    )
    with pytest.raises(NotSupported, match="int32 group accumulator"):
        cuda.w4a8_matmul(**_on(device, a), out_dtype=torch.float32)
    assert not launches()


def test_bad_input_names_the_argument(cuda, device):
    a = _on(device, _args(4, 8, 64, 32))
    with pytest.raises(ValueError, match="^group_size: expected a divisor"):
        cuda.w4a8_matmul(**(a | {"group_size": 48}), out_dtype=torch.float32)
