"""W8A8 / W4A8 in the layout-invariant mode (SPEC 12, quant/invariant.py): the quantized tiny model's
logits and top-k sets are the same bits at TP 1 and TP 2 (row-parallel quantized linears: the activation
scale from the global row max, the integer partials or group terms combined over the ranks before the
scales); the normal mode's per-rank scales differ."""

from __future__ import annotations

import pytest
import torch

from glm5.parallel import plan
from glm5.parallel.group import TorchGroup
from tests.glm5.test_invariant_layouts import _forward, _ids, _model, _same
from tests.ranks import run_ranks


def _quantized(recipe: str, backend: str = "reference"):
    from quant.quantize import quantize_model

    model = _model(backend)
    quantize_model(model, recipe)
    return model.eval()


def _rank(rank: int, world: int, recipe: str) -> dict:
    model = _quantized(recipe)
    plan.apply(model, tp=TorchGroup(), ep=TorchGroup())  # experts whole per rank: tp-split ones are refused
    return {"invariant": _forward(model, _ids(), True), "normal": _forward(model, _ids(), False)}


@pytest.mark.parametrize("recipe", ["glm5-w8a8", "glm5-w4a8"])
def test_quantized_tp2_is_the_unsplit_bits_in_the_mode(recipe):
    model = _quantized(recipe)
    ref, ref_normal = _forward(model, _ids(), True), _forward(model, _ids(), False)
    results = run_ranks(_rank, 2, recipe)
    for r in results:
        assert _same(r["invariant"], ref)
    # the normal mode quantizes each rank's half with its own row max: the comparison above can fail
    assert not torch.equal(results[0]["normal"][0], ref_normal[0])


def test_a_quantized_linear_in_the_mode_is_the_reference_ops_formula():
    """Unsplit, the mode's W8A8 / W4A8 linear gives the reference ops' bits (SPEC 2.5-2.7)."""
    from glm5.parallel.invariant import layout_invariant
    from quant.modules import QuantLinear

    for recipe in ("glm5-w8a8", "glm5-w4a8"):
        model = _quantized(recipe)
        lin = model.model.layers[0].self_attn.o_proj
        assert isinstance(lin, QuantLinear)
        x = torch.randn(5, lin.in_features, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            normal = lin(x)
            with layout_invariant():
                inv = lin(x)
        assert torch.equal(inv, normal), recipe
