"""`glm5 export-onnx`: the tiny model's prefill graph, exported with the glm5 functions, runs in ONNX
Runtime with the reference backend's logits (fp32 default tolerances), inlined or not. Sequences are
longer than index_topk so that DSA is really sparse."""

from __future__ import annotations

from collections import Counter

import onnx
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner

from backends.onnxruntime.functions import DOMAIN
from glm5.cli import main
from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.onnx_export.export import run_onnx
from glm5.onnx_export.translation import translation_table

B, S = 2, 40


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    res = CliRunner().invoke(
        main,
        [
            "export-onnx",
            "--preset",
            "tiny",
            "--batch",
            str(B),
            "--seq-len",
            str(S),
            "--out",
            str(out),
            "--inline",
        ],
    )
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert "verified" in res.output
    return onnx.load(str(out)), onnx.load(str(out.with_suffix("")) + ".inlined.onnx")


@pytest.fixture(scope="module")
def reference_model():
    cfg = GLM5Config.from_preset("tiny")
    assert S > cfg.index_topk
    return GLM5ForCausalLM(cfg, backend="reference")


def test_graph_calls_the_glm5_functions(exported):
    model, flat = exported
    cfg = GLM5Config.from_preset("tiny")
    calls = Counter(n.op_type for n in model.graph.node if n.domain == DOMAIN)
    full = cfg.indexer_types.count("full")
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert calls["indexer_topk_ragged"] == full
    assert calls["sparse_mla_attention_ragged"] == cfg.num_hidden_layers
    assert calls["grouped_matmul"] == 3 * moe  # gate, up, down
    assert calls["topk"] >= moe  # router top-k (plus the group top-k)
    # one MLP per layer (dense, or the MoE's routed experts) plus each MoE layer's shared expert
    assert calls["silu_and_mul"] == cfg.num_hidden_layers + moe * bool(cfg.n_shared_experts)
    assert set(calls) == {
        "indexer_topk_ragged",
        "sparse_mla_attention_ragged",
        "grouped_matmul",
        "topk",
        "silu_and_mul",
    }
    assert {f.name for f in model.functions} >= set(calls)
    assert not flat.functions and all(n.domain in ("", "ai.onnx") for n in flat.graph.node)


@pytest.mark.parametrize("seed", [1, 2])
def test_logits_match_reference(exported, reference_model, seed):
    ids = torch.randint(
        0, reference_model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed)
    )
    with torch.no_grad():
        want = reference_model(ids).logits
    for proto in exported:
        torch.testing.assert_close(run_onnx(proto, ids), want)


def test_stable_argsort_exports_as_a_stable_topk():
    """The MoE groups (token, slot) pairs with a stable argsort; the export maps it to TopK(largest=0),
    whose lower-index tie rule must reproduce torch's stable order exactly."""

    class Sort(torch.nn.Module):
        def forward(self, x):
            return torch.argsort(x, stable=True)

    x = torch.randint(0, 8, (2000,), generator=torch.Generator().manual_seed(3))
    prog = torch.onnx.export(
        Sort(),
        (x,),
        dynamo=True,
        opset_version=18,
        optimize=False,
        custom_translation_table=translation_table(),
        input_names=["x"],
    )
    sess = ort.InferenceSession(prog.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x.numpy()})[0]
    assert torch.equal(torch.from_numpy(got), torch.argsort(x, stable=True))


@pytest.mark.parametrize("right", [False, True])
def test_searchsorted_exports_as_a_count_of_smaller_keys(right):
    """The MoE dispatch finds each expert's first sorted row with searchsorted (backends/moe/dispatch.py),
    which torch's ONNX table lacks; the export counts the sorted keys below each value (at or below:
    right)."""

    class Search(torch.nn.Module):
        def forward(self, keys, bounds):
            return torch.searchsorted(keys, bounds, right=right), torch.searchsorted(
                keys, bounds, right=right, out_int32=True
            )

    keys = torch.sort(torch.randint(0, 9, (300,), generator=torch.Generator().manual_seed(4))).values
    bounds = torch.arange(-1, 11, dtype=torch.int64)  # below, inside (with repeats) and above the keys
    prog = torch.onnx.export(
        Search(),
        (keys, bounds),
        dynamo=True,
        opset_version=18,
        optimize=False,
        custom_translation_table=translation_table(),
        input_names=["keys", "bounds"],
    )
    sess = ort.InferenceSession(prog.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    got64, got32 = sess.run(None, {"keys": keys.numpy(), "bounds": bounds.numpy()})
    want = torch.searchsorted(keys, bounds, right=right)
    assert torch.equal(torch.from_numpy(got64), want) and got64.dtype.name == "int64"
    assert torch.equal(torch.from_numpy(got32).long(), want) and got32.dtype.name == "int32"


def test_quantized_model_exports_with_the_int8_functions():
    """A W4A8-quantized model (W8A8 linears, W4A8 experts) traces on the reference backend like the float
    one; its int8 ops become glm5.dynamic_quant_int8 / w8a8_matmul / grouped_matmul_w4a8 calls and the
    logits in ONNX Runtime are the reference's."""
    from glm5.onnx_export.export import export_prefill
    from quant import quantize_model

    model = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="reference").eval()
    model.init_weights(0)
    quantize_model(model, "glm5-w4a8")
    proto = export_prefill(model, B, S)
    calls = Counter(n.op_type for n in proto.graph.node if n.domain == DOMAIN)
    assert {"dynamic_quant_int8", "w8a8_matmul", "grouped_matmul_w4a8"} <= set(calls)
    assert "grouped_matmul" not in calls  # no float expert left
    ids = torch.randint(0, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
    torch.testing.assert_close(run_onnx(proto, ids), want)


def test_cli_exports_a_quantized_checkpoint_and_never_overwrites(tmp_path):
    """`glm5 export-onnx --model` takes a W8A8 / W4A8 checkpoint (verified against the reference), refuses an
    existing --out without --overwrite (leaving it as it was), and refuses an FP8 checkpoint in one line."""
    from quant import quantize_model
    from quant.formats import fp8
    from quant.load import export

    model = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="reference").eval()
    model.init_weights(1)
    fp8.export(model, tmp_path / "fp8")
    quantize_model(model, "glm5-w4a8")
    export(model, tmp_path / "w4a8", "compressed-tensors")
    out = tmp_path / "q.onnx"
    out.write_text("mine")
    args = [
        "export-onnx",
        "--model",
        str(tmp_path / "w4a8"),
        "--seq-len",
        str(S),
        "--out",
        str(out),
        "--quiet",
    ]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and "--overwrite" in res.output and out.read_text() == "mine"
    res = CliRunner().invoke(main, args + ["--overwrite"])
    assert res.exit_code == 0 and "verified" in res.output, res.output
    calls = {n.op_type for n in onnx.load(str(out)).graph.node if n.domain == DOMAIN}
    assert {"dynamic_quant_int8", "w8a8_matmul", "grouped_matmul_w4a8"} <= calls
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8", "q.onnx", "w4a8"]  # no temporary left
    res = CliRunner().invoke(
        main, ["export-onnx", "--model", str(tmp_path / "fp8"), "--out", str(tmp_path / "f.onnx")]
    )
    err = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert res.exit_code == 2 and len(err) == 1 and "FP8" in err[0] and "glm5 quantize" in err[0], res.output
