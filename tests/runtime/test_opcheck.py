"""`torch.library.opcheck` on every contract op, on every backend that can run here.

opcheck checks the registration (schema, fake implementation against the real one on the same
inputs, autograd registration, and AOT dispatch with static and dynamic shapes), i.e. that
`torch.compile` and `torch.export` see the op as the backend computes it. Backends under test:
GLM5_OPCHECK_BACKENDS (comma-separated), default every available built-in backend on this machine;
the tox environments of cuda (interpreter) and ascend (emulation) run it on theirs.
"""

from __future__ import annotations

import os

import pytest
import torch

import backends
from backends.contract import library


def _names() -> list[str]:
    env = os.environ.get("GLM5_OPCHECK_BACKENDS")
    if env:
        return [n.strip() for n in env.split(",") if n.strip()]
    return [n for n, ok, _ in backends.available() if ok]


def _samples(op: str, grad: bool, caps) -> dict:
    """The op's declared sample (backends/reference/<op>.py) of the first dtype the backend claims."""
    d = backends.OPS[op]
    dt = next((t for t in d.dtype_axis if t in caps.dtypes), d.dtype_axis[0])
    return d.sample(torch.Generator().manual_seed(0), dt, grad)


CASES = [(b, op) for b in _names() for op in backends.OP_NAMES]


@pytest.mark.parametrize(("name", "op"), CASES, ids=[f"{b}-{op}" for b, op in CASES])
def test_opcheck(name, op):
    be = backends.get(name)
    impl = be.ops.get(op)
    if impl is None:
        pytest.skip(f"{name} does not implement {op}")
    grad = impl.caps.differentiable and bool(backends.OPS[op].grad_args)
    args = _samples(op, grad, impl.caps)
    why = be.reasons(op, args)
    if why:
        pytest.skip(f"{name} declines these inputs: {why}")
    utils = torch.library._OPCHECK_DEFAULT_UTILS
    if any(isinstance(v, torch.Tensor) and v.dtype == torch.float8_e4m3fn for v in args.values()):
        # opcheck's schema test perturbs the inputs with a multiply, which CPU torch lacks for e4m3:
        # the other checks (fake tensor, autograd registration, AOT dispatch) still run
        utils = tuple(u for u in utils if u != "test_schema")
    torch.library.opcheck(library.CUSTOM_OPS[op], library.custom_op_args(op, args, be.key), test_utils=utils)
