"""Per-row symmetric dynamic int8 quantization (SPEC 2.5; vLLM int8, torch_npu npu_dynamic_quant).

scale = max(amax_row, 1e-10) / 127
x_q   = clamp(round_half_even(x / scale), -127, 127), 0 where x / scale is NaN
This module is the op's declaration too (`DECL`: the function below is the signature).
"""

from __future__ import annotations

import torch

from backends.argcheck import FLOAT_DTYPES, check_tensor, fail
from backends.caps import OpCaps, OpImpl
from backends.contract.decl import OpDecl
from backends.counters import reference_op
from backends.reference._common import FLOATS, dim, dtype_of, randn


@reference_op("dynamic_quant_int8")
def dynamic_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (x_q int8 [M, K], scale fp32 [M])."""
    xf = x.float()  # [M, K]
    scale = xf.abs().amax(dim=1).clamp_min(1e-10) / 127  # [M] fp32
    q = torch.round(xf / scale[:, None]).clamp(-127, 127)  # torch.round is half-to-even
    x_q = q.nan_to_num(nan=0.0).to(torch.int8)  # a NaN quotient is code 0 (a float->int cast of NaN is UB)
    return x_q, scale


def check(x) -> None:
    check_tensor("x", x, dtype=FLOAT_DTYPES, ndim=2)
    if x.shape[1] < 1:
        fail("x", "shape [M, K] with K >= 1", f"shape {list(x.shape)}")


def fake(a: dict) -> tuple[torch.Tensor, torch.Tensor]:
    x = a["x"]
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0],), dtype=torch.float32)


DECL = OpDecl(
    name="dynamic_quant_int8",
    spec_section="2.5",
    signature=dynamic_quant_int8,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("x"),
    validate=check,
    fake=fake,
    sample=lambda g, dt, grad: dict(x=randn(g, 5, 64, dtype=dt)),
    sized=lambda g, dt, quantity, k: dict(x=randn(g, 3, k, dtype=dt)),  # quantity: K
    sharding="columns or rows local",
    quantities={"K": dim("x", 1)},
)
IMPL = OpImpl(dynamic_quant_int8, OpCaps(FLOATS))
