"""`glm5 plan --recipe fp8`: GLM-5-FP8 as published (block FP8 weights) on 8 x H200, refused on Ascend."""

from __future__ import annotations

import pytest

from glm5.core.config import GLM5Config
from glm5.deploy import Machine, Request, make_plan, weights_for

GLM5 = GLM5Config.from_preset("glm5-744b")
GiB = 1 << 30


def test_routed_expert_bytes_by_hand():
    weights = weights_for(GLM5, "fp8", "fp8")
    e, d, i, layers = 256, 6144, 2048, 75
    per_proj = i * d + (i // 128) * (d // 128) * 4  # e4m3 weight + fp32 weight_scale_inv per 128x128 block
    main = sum(w.nbytes for w in weights if w.role == "routed_experts" and not w.mtp)
    assert main == layers * e * 3 * per_proj
    kept = {w.role for w in weights if w.scheme == "FLOAT" and len(w.parts[0].shape) == 2}
    assert {"embedding", "lm_head", "router"} <= kept and "routed_experts" not in kept
    assert any(w.module.endswith("indexer.weights_proj") and w.scheme == "FLOAT" for w in weights)


@pytest.mark.slow
def test_fp8_fits_one_h200x8_node():
    plan = make_plan(Request(GLM5, Machine.load("h200x8"), "fp8", 32768))
    lay = plan.layout
    assert lay.fits and lay.per_device["weights"] < 110 * GiB
    assert plan.request.checkpoint_format == "fp8"


def test_ascend_has_no_fp8_datapath():
    with pytest.raises(ValueError, match="has no FP8 datapath; convert GLM-5-FP8 with `glm5 quantize"):
        Request(GLM5, Machine.load("atlas-800t-a3"), "fp8", 32768)
