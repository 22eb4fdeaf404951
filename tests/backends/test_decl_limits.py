"""Capabilities in one dialect: a bound is a typed `Limit` on a quantity the op's declaration measures
(free text is refused at load), and every quantity of every op gets its at-bound and just-past
conformance cases (conformance/cases/limits.py), so any limit any backend declares is tested both ways."""

from __future__ import annotations

import importlib

import pytest
import torch

import backends
from backends.caps import OpCaps
from backends.contract.limits import Limit
from backends.contract.ops import FLOATS, OPS
from conformance.cases import cases
from conformance.cases.limits import limit_cases


def test_a_free_text_limit_is_refused_at_load():
    with pytest.raises(
        ValueError, match=r"limits: expected backends.contract.limits.Limit entries, got free text"
    ):
        OpCaps(FLOATS, limits={"group_size": "<= 4096"})
    assert OpCaps(FLOATS, notes={"GPU": "sm_89+"}).limits == ()


def _variant(op: str, quantity: str) -> str | None:
    """The dtype-axis value a quantity exists on (grouped_matmul's group_size: the W4A8 variant)."""
    return "w4a8" if (op, quantity) == ("grouped_matmul", "group_size") else None


QUANTITIES = [(op, q) for op, d in OPS.items() for q in d.quantities]


@pytest.mark.parametrize(("op", "quantity"), QUANTITIES, ids=[f"{op}-{q}" for op, q in QUANTITIES])
def test_every_quantity_gets_its_at_and_past_cases(op, quantity):
    d = OPS[op]
    when = _variant(op, quantity)
    lim = Limit(quantity, max=64, reason="test bound", when=(when,) if when else ())
    made = limit_cases(op, (lim,), d.dtype_axis, next(c.outputs for c in cases(op) if c.outputs))
    dt = when or d.dtype_axis[0]
    by_name = {c.id: c for c, t in made if t == dt}
    assert set(by_name) == {"limits/" + f"{quantity}_at_64", f"limits/{quantity}_past_65"}
    for value, case in (
        (64, by_name[f"limits/{quantity}_at_64"]),
        (65, by_name[f"limits/{quantity}_past_65"]),
    ):
        args = case.inputs(dt)
        d.validate(**args)
        measured = d.quantities[quantity](args)
        assert measured == value or (value == 65 and measured == 66)  # packed int4: K stays even
        assert d.dtype_of(args) == dt
        assert bool(lim.violation(op, args, dt)) == (value > 64)


def test_the_cuda_bounds_that_were_free_text_are_typed_limits():
    """cuda's fp8_quant_group group_size <= 4096 and FP8 attention heads <= 128 (its modules need triton
    to import: where it is absent, the limits are checked as the module declares them, by text)."""
    try:
        quant = importlib.import_module("backends.cuda.fp8_quant_group")
        attn = importlib.import_module("backends.cuda.fp8_sparse_mla_attention")
    except ImportError:
        root = backends.__path__[0]
        quant_src = open(f"{root}/cuda/fp8_quant_group.py").read()
        attn_src = open(f"{root}/cuda/fp8_sparse_mla_attention.py").read()
        assert 'Limit("group_size", max=MAX_GROUP' in quant_src and "limits=(GROUP_LIMIT,)" in quant_src
        assert 'Limit("heads", max=MAX_HEADS' in attn_src and "limits=(HEADS_LIMIT,)" in attn_src
        return
    assert quant.IMPL.caps.limits == (Limit("group_size", max=4096, reason=quant.GROUP_LIMIT.reason),)
    assert attn.IMPL.caps.limits[0].quantity == "heads" and attn.IMPL.caps.limits[0].max == 128


@pytest.mark.parametrize(("op", "quantity", "bound"), [("fp8_quant_group", "group_size", 4096)])
def test_an_fp8_limit_case_at_the_bound_passes_on_the_reference(op, quantity, bound):
    lim = Limit(quantity, max=bound, reason="a group is one register tile")
    made = limit_cases(op, (lim,), ("float32",), next(c.outputs for c in cases(op) if c.outputs))
    at = next(c for c, _ in made if c.id.endswith(f"_at_{bound}"))
    ref = backends.get("reference")
    x_q, scale = ref.fp8_quant_group(**at.inputs("float32"))
    assert x_q.shape == (3, 2 * bound) and scale.shape == (3, 2) and torch.isfinite(scale).all()
