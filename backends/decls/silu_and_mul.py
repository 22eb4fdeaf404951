"""silu_and_mul (SPEC 2.10): SwiGLU's activation on a fused gate-up projection, [M, 2N] -> [M, N]."""

from __future__ import annotations

from torch import Tensor

from backends.argcheck import FLOAT_DTYPES, check_tensor, fail
from backends.decl import OpDecl
from backends.decls._common import FLOATS, dtype_of, randn


def silu_and_mul(x: Tensor) -> Tensor:
    """x [M, 2N] float = [gate | up] -> silu(gate) * up [M, N], dtype of x."""


def check(x) -> None:
    check_tensor("x", x, dtype=FLOAT_DTYPES, ndim=2)
    if x.shape[1] % 2:
        fail("x", "an even last dimension ([M, 2N]: gate then up)", f"shape {list(x.shape)}")


DECL = OpDecl(
    name="silu_and_mul",
    spec_section="2.10",
    signature=silu_and_mul,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("x"),
    validate=check,
    fake=lambda a: a["x"].new_empty((a["x"].shape[0], a["x"].shape[1] // 2)),
    sample=lambda g, dt, grad: dict(x=randn(g, 7, 2 * 96, dtype=dt, grad=grad)),
    sharding="columns or rows local",  # the rank's I / tp columns of gate and of up, side by side
    grad_args=("x",),
    quantities={"N": lambda a: a["x"].shape[1] // 2},
    sized=lambda g, dt, quantity, n: dict(x=randn(g, 3, 2 * n, dtype=dt)),
)
