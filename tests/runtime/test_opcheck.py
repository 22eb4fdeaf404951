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
from backends import SeqLayout, library
from backends.reference.w4a8_matmul import pack_int4


def _names() -> list[str]:
    env = os.environ.get("GLM5_OPCHECK_BACKENDS")
    if env:
        return [n.strip() for n in env.split(",") if n.strip()]
    return [n for n, ok, _ in backends.available() if ok]


def _samples(op: str, grad: bool) -> dict:
    if op.startswith("fp8_"):  # SPEC 7 (forward only)
        from tests.backends.reference._fp8_samples import fp8_sample

        return fp8_sample(op, backends.OPS[op].dtype_axis[0])
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    i8 = lambda *s: torch.randint(-127, 128, s, generator=g, dtype=torch.int8)  # noqa: E731
    # more keys than topk (2048): below that DSA equals dense attention
    lay = SeqLayout.from_lengths([3, 1], [2100, 2500], block_size=64, block_order=list(range(80))[::-1])
    nb = 80
    if op in ("indexer_logits", "indexer_topk"):
        a = dict(
            q=r(4, 2, 16).requires_grad_(grad),
            k_cache=r(nb, 64, 16).requires_grad_(grad),
            weights=r(4, 2).requires_grad_(grad),
            layout=lay,
        )
        return a | ({"topk": 64} if op == "indexer_topk" else {})  # 2100 keys > topk
    if op == "topk":
        return dict(x=r(5, 3000), k=64, lengths=torch.tensor([3000, 10, 0, 2999, 64]))
    if op == "sparse_mla_attention":
        idx = torch.randint(-1, 2100, (4, 64), generator=g, dtype=torch.int32)  # of 2100 keys
        return dict(
            q=r(4, 2, 40).requires_grad_(grad),
            kv_cache=r(nb, 64, 40).requires_grad_(grad),
            indices=idx,
            layout=lay,
            sm_scale=0.15,
            d_v=32,
            return_lse=True,
        )
    if op == "dynamic_quant_int8":
        return dict(x=r(5, 64))
    if op == "w8a8_matmul":
        return dict(
            x_q=i8(5, 64),
            x_scale=r(5).abs(),
            w_q=i8(7, 64),
            w_scale=r(7).abs(),
            bias=r(7),
            out_dtype=torch.float32,
        )
    if op == "w4a8_matmul":
        return dict(
            x_q=i8(5, 64),
            x_scale=r(5).abs(),
            w_packed=pack_int4(torch.randint(-8, 8, (7, 64), generator=g)),
            w_scale=r(7, 2).abs(),
            group_size=32,
            bias=None,
            out_dtype=torch.float32,
        )
    if op == "grouped_matmul":
        return dict(
            x=r(9, 32).requires_grad_(grad),
            w=r(3, 16, 32).requires_grad_(grad),
            group_offsets=torch.tensor([0, 4, 4, 9]),
            x_scale=None,
            w_scale=None,
            group_size=None,
            out_dtype=None,
        )
    if op == "linear_cross_entropy":
        return dict(
            h=r(6, 32).requires_grad_(grad),
            weight=r(50, 32).requires_grad_(grad),
            targets=torch.tensor([1, 2, -100, 49, 0, 3]),
            ignore_index=-100,
        )
    return None


def _smoke(op: str, caps, grad: bool) -> dict:
    from conformance.cases import cases, dtypes_of

    case = next(c for c in cases(op) if c.suite == "smoke" and set(dtypes_of(c)) & set(caps.dtypes))
    dt = next(d for d in dtypes_of(case) if d in caps.dtypes)
    args = case.inputs(dt)
    for name in case.grad_args if grad else ():
        args[name] = args[name].detach().requires_grad_()
    return args


CASES = [(b, op) for b in _names() for op in backends.OP_NAMES]


@pytest.mark.parametrize(("name", "op"), CASES, ids=[f"{b}-{op}" for b, op in CASES])
def test_opcheck(name, op):
    be = backends.get(name)
    impl = be.ops.get(op)
    if impl is None:
        pytest.skip(f"{name} does not implement {op}")
    grad = impl.caps.differentiable and bool(backends.OPS[op].grad_args)
    args = _samples(op, grad)
    if args is None:  # an op without a hand-made sample (the FP8 ops): its first smoke conformance case
        args = _smoke(op, impl.caps, grad)
    why = be.reasons(op, args)
    if why:
        pytest.skip(f"{name} declines these inputs: {why}")
    utils = torch.library._OPCHECK_DEFAULT_UTILS
    if any(isinstance(v, torch.Tensor) and v.dtype == torch.float8_e4m3fn for v in args.values()):
        # opcheck's schema test perturbs the inputs with a multiply, which CPU torch lacks for e4m3:
        # the other checks (fake tensor, autograd registration, AOT dispatch) still run
        utils = tuple(u for u in utils if u != "test_schema")
    torch.library.opcheck(library.CUSTOM_OPS[op], library.custom_op_args(op, args, be.key), test_utils=utils)
