"""One declaration per op (backends/contract/decl.py, in backends/reference/<op>.py): what is derived from it
is checked against it (the custom ops' schemas, the typed interface, the reference, the limit table, the op
table), and opcheck runs over every op's declared samples."""

from __future__ import annotations

import importlib
import inspect
import typing

import pytest
import torch

import backends
from backends import SeqLayout
from backends.contract import library
from backends.contract.decl import SHARDING, OpDecl, check_interface
from backends.contract.limits import QUANTITIES, quantities
from backends.contract.ops import OPS
from backends.interface import Backend

#: the public surface `torch.ops.glm5.<op>` (graphs, exported programs and the ONNX translation depend
#: on it): what the hand-written registrations had, before the schemas were generated
SCHEMAS = {
    "topk": "(Tensor x, SymInt k, Tensor? lengths, str backend) -> (Tensor, Tensor)",
    "sparse_mla_attention": "(Tensor q, Tensor kv_cache, Tensor indices, Tensor cu_seqlens_q, "
    "Tensor seqlens_k, Tensor? cu_seqlens_k, Tensor? block_table, SymInt max_seqlen_k, float sm_scale, "
    "SymInt d_v, bool return_lse, str backend) -> (Tensor, Tensor)",
    "grouped_matmul": "(Tensor x, Tensor w, Tensor group_offsets, Tensor? x_scale, Tensor? w_scale, "
    "SymInt? group_size, ScalarType? out_dtype, str backend) -> Tensor",
    "linear_cross_entropy": "(Tensor h, Tensor weight, Tensor targets, SymInt ignore_index, str backend) "
    "-> (Tensor, Tensor)",
    "fp8_quant_group": "(Tensor x, SymInt group_size, float eps, bool ue8m0, str backend) "
    "-> (Tensor, Tensor)",
    "w8a8_matmul": "(Tensor x_q, Tensor x_scale, Tensor w_q, Tensor w_scale, Tensor? bias, "
    "ScalarType out_dtype, str backend) -> Tensor",
}


def test_the_op_table_is_the_declarations():
    assert list(OPS) == list(backends.OP_NAMES)
    sections = [tuple(int(p) for p in d.spec_section.split(".")) for d in OPS.values()]
    assert sections == sorted(sections)
    for op, d in OPS.items():
        assert QUANTITIES[op] is d.quantities and quantities(op) is d.quantities
        assert d.sharding in SHARDING


@pytest.mark.parametrize("op", list(SCHEMAS))
def test_generated_schemas_are_the_public_ones(op):
    assert str(getattr(torch.ops.glm5, op).default._schema) == f"glm5::{op}{SCHEMAS[op]}"


@pytest.mark.parametrize("op", list(OPS))
def test_every_schema_is_the_declared_signature(op):
    d = OPS[op]
    args = getattr(torch.ops.glm5, op).default._schema.arguments
    assert [a.name for a in args] == [n for n, _ in d.flat_params()] + ["backend"]


@pytest.mark.parametrize("op", list(OPS))
def test_the_reference_takes_the_declared_signature(op):
    d = OPS[op]
    ref = getattr(importlib.import_module(f"backends.reference.{op}"), op)
    want, got = typing.get_type_hints(d.signature), typing.get_type_hints(ref)
    assert [(n, got[n], p.default) for n, p in inspect.signature(ref).parameters.items()] == [
        (n, want[n], p.default) for n, p in inspect.signature(d.signature).parameters.items()
    ]


def test_an_interface_method_that_drifts_fails_the_check():
    check_interface(Backend, OPS)  # as at import

    class Drifted(Backend):
        def topk(self, x: torch.Tensor, k: int, lengths: torch.Tensor | None = None, sorted: bool = True):
            raise NotImplementedError

    with pytest.raises(TypeError, match=r"Drifted.topk takes .*backends.reference.topk"):
        check_interface(Drifted, OPS)

    class Retyped(Backend):
        def topk(self, x: torch.Tensor, k: float, lengths: torch.Tensor | None = None):
            raise NotImplementedError

    with pytest.raises(TypeError, match="Retyped.topk"):
        check_interface(Retyped, OPS)


def test_custom_op_args_go_by_name_not_dict_order():
    x, lengths = torch.randn(2, 5), torch.tensor([5, 3])
    a = library.custom_op_args("topk", dict(lengths=lengths, k=2, x=x), "key")
    assert a[0] is x and a[1] == 2 and a[2] is lengths and a[3] == "key"
    with pytest.raises(TypeError, match="topk: expected arguments"):
        library.custom_op_args("topk", dict(x=x, k=2), "key")
    lay = SeqLayout.from_lengths([1], [3])
    flat = OPS["indexer_topk"].flatten(
        dict(topk=2, layout=lay, weights=torch.ones(1, 1), k_cache=torch.ones(3, 4), q=torch.ones(1, 1, 4))
    )
    assert flat[-2:] == (3, 2)  # max_seqlen_k, then topk: the schema's order


def test_a_declaration_refuses_what_no_schema_can_carry():
    def sig(x: torch.Tensor, names: list[str]) -> torch.Tensor: ...

    with pytest.raises(TypeError, match="argument 'names'"):
        OpDecl("bad", "2.99", sig, ("float32",), lambda a: "float32", lambda **_: None, None, None, "unsplit")

    def ok(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...

    with pytest.raises(ValueError, match="signature's order"):
        OpDecl("bad", "2.99", ok, ("float32",), None, None, None, None, "unsplit", grad_args=("y", "x"))
    with pytest.raises(ValueError, match="sharding"):
        OpDecl("bad", "2.99", ok, ("float32",), None, None, None, None, "everywhere")


def _samples():
    for op, d in OPS.items():
        yield op, d.dtype_axis[0], bool(d.grad_args)


@pytest.mark.parametrize(("op", "dt", "grad"), list(_samples()), ids=[op for op, *_ in _samples()])
def test_opcheck_on_every_declared_sample(op, dt, grad):
    """The declared fake, autograd registration and schema against the reference on the declared sample."""
    be = backends.get("reference")
    d = OPS[op]
    args = d.sample(torch.Generator().manual_seed(0), dt, grad)
    d.validate(**args)
    assert be.reasons(op, args) == []
    utils = torch.library._OPCHECK_DEFAULT_UTILS
    if any(isinstance(v, torch.Tensor) and v.dtype == torch.float8_e4m3fn for v in args.values()):
        utils = tuple(u for u in utils if u != "test_schema")  # CPU torch cannot perturb e4m3 inputs
    torch.library.opcheck(library.CUSTOM_OPS[op], library.custom_op_args(op, args, be.key), test_utils=utils)


def test_the_generated_backward_recomputes_lse_a_direct_call_did_not_ask_for():
    """`before_backward` (sparse attention): a direct custom-op call with return_lse=False gets the same
    gradients as one with it, from one more forward."""
    ref = backends.get("reference")
    d = OPS["sparse_mla_attention"]
    sample = d.sample(torch.Generator().manual_seed(0), "float32", True)
    grads = []
    for return_lse in (True, False):
        q, kv = (sample[n].detach().clone().requires_grad_() for n in ("q", "kv_cache"))
        args = {**sample, "q": q, "kv_cache": kv, "return_lse": return_lse}
        out, lse = library.CUSTOM_OPS["sparse_mla_attention"](
            *library.custom_op_args("sparse_mla_attention", args, ref.key)
        )
        assert lse.shape == ((4, 2) if return_lse else (0,))
        out.sum().backward()
        grads.append((q.grad, kv.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
