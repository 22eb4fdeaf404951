"""The streamed conversion (quant/stream.py): the same checkpoint as quantizing the whole model, tensor
for tensor and byte for byte, with at most one decoder layer materialized at any time, and a wrong source
refused before anything is written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm5.core.checkpoint import CheckpointError, weight_files
from glm5.core.model import GLM5ForCausalLM
from quant import quantize_model, stream
from quant.data import token_batch
from quant.formats import fp8
from quant.load import export, load_quantized
from quant.recipe import Recipe
from tests.quant.conftest import ids, tiny_model


def _read(path):
    """Every tensor of a checkpoint (whatever its sharding), plus its JSON files."""
    tensors = {}
    for f in sorted(set(weight_files(path).values())):
        tensors.update(load_file(f))
    meta = {p.name: json.loads(p.read_text()) for p in path.glob("*.json") if "index" not in p.name}
    return tensors, meta


def _same(a_path, b_path):
    (a, ma), (b, mb) = _read(a_path), _read(b_path)
    assert sorted(a) == sorted(b)
    for k in a:
        x, y = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (a[k], b[k]))
        assert x.dtype == y.dtype and torch.equal(x, y), k
    assert ma == mb


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    tiny_model(seed=5, dtype=torch.bfloat16).save_pretrained(root / "bf16")
    fp8.export(tiny_model(seed=6), root / "fp8")
    return root


def _whole(src, kind):
    if kind == "fp8":
        return fp8.load_fp8(src, backend="reference", fp8_modules=False)
    return GLM5ForCausalLM.from_pretrained(src, backend="reference").eval()


@pytest.mark.parametrize(
    "kind, recipe, fmt, calib",
    [
        ("bf16", "glm5-w4a8", "compressed-tensors", True),  # AWQ + SSZ int4, SmoothQuant int8
        ("bf16", "glm5-w8a8", "modelslim", False),
        ("fp8", "glm5-w8a8", "modelslim", True),  # the Ascend recipe from GLM-5-FP8
        ("fp8", "glm5-w4a8", "modelslim", False),  # Ascend W4A8 (per-channel int4) from GLM-5-FP8
        ("fp8", ("glm5-w4a8-g128", 16), "compressed-tensors", True),  # GPTQ Hessians per layer
        ("bf16", None, "fp8", False),
    ],
)
def test_streamed_equals_whole_model(sources, tmp_path, kind, recipe, fmt, calib):
    src = sources / kind
    calib_ids = token_batch("train", 2, 24, seed=0) if calib else None
    model = _whole(src, kind)
    if recipe is not None:
        recipe = Recipe.load(*recipe) if isinstance(recipe, tuple) else Recipe.load(recipe)
        with torch.no_grad():
            quantize_model(model, recipe, calib_ids)
    export(model, tmp_path / "whole", fmt)
    plan = stream.convert(src, tmp_path / "streamed", fmt, recipe, calib_ids, backend="reference")
    assert len(plan) == len(getattr(model, "quant_plan", {}))
    _same(tmp_path / "whole", tmp_path / "streamed")


def test_one_layer_in_memory_and_one_shard_per_layer(sources, tmp_path, monkeypatch):
    real = stream._materialize
    live: list[int] = []

    def counting(model, modules, scope, reader, copies):
        real(model, modules, scope, reader, copies)
        live.append(sum(not layer.input_layernorm.weight.is_meta for layer in model.model.layers))

    monkeypatch.setattr(stream, "_materialize", counting)
    stream.convert(
        sources / "fp8",
        tmp_path / "q",
        "modelslim",
        Recipe.load("glm5-w8a8"),
        token_batch("train", 2, 24, seed=0),
        backend="reference",
    )
    n_layers = 5  # tiny: 4 main layers and the MTP layer
    assert live == [0] + [1] * n_layers  # the head first, then each layer alone
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == n_layers + 1
    x = ids(1, 24)
    src = fp8.load_fp8(sources / "fp8", backend="reference", dtype=torch.float32, fp8_modules=False)
    got = load_quantized(tmp_path / "q", backend="reference", dtype=torch.float32)
    with torch.no_grad():
        a, b = got(x).logits.float().flatten(), src(x).logits.float().flatten()
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) >= 0.99


def _corrupt(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda t: t.pop("model.layers.2.self_attn.o_proj.weight"), "1 missing tensor(s): model.layers.2"),
        (lambda t: t.update(extra=torch.zeros(1)), "1 unexpected tensor(s): extra"),
        (
            lambda t: t.update({"model.norm.weight": torch.zeros(3)}),
            "mis-shaped tensor(s): model.norm.weight",
        ),
    ],
)
def test_a_source_that_does_not_fit_fails_before_writing(sources, tmp_path, edit, words):
    _corrupt(sources / "bf16", tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=words.replace("(", r"\(").replace(")", r"\)")):
        stream.convert(
            tmp_path / "bad",
            tmp_path / "out",
            "compressed-tensors",
            Recipe.load("glm5-w8a8"),
            backend="reference",
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]  # no output, no staging left


def test_cli_names_the_source_in_one_line(sources, tmp_path):
    from click.testing import CliRunner

    from glm5.cli import main

    _corrupt(sources / "bf16", tmp_path / "bad", lambda t: t.pop("model.layers.1.mlp.gate.weight"))
    res = CliRunner().invoke(
        main,
        [
            "quantize",
            "--model",
            str(tmp_path / "bad"),
            "--format",
            "modelslim",
            "--recipe",
            "glm5-w8a8",
            "--out",
            str(tmp_path / "q"),
            "--quiet",
        ],
    )
    assert res.exit_code == 2 and "Traceback" not in res.output
    err = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert len(err) == 1 and "'--model'" in err[0] and "model.layers.1.mlp.gate.weight" in err[0], res.output
    assert not (tmp_path / "q").exists()


def test_deepseek_style_mtp_copies_are_checked_and_dropped(sources, tmp_path):
    """DeepSeek-style checkpoints repeat the embedding and head inside the MTP layer: the streamed reader
    accepts equal copies (the output is as without them) and refuses a copy that differs, by name."""

    def with_copies(t, differ=False):
        t["model.layers.4.embed_tokens.weight"] = t["model.embed_tokens.weight"].clone()
        t["model.layers.4.shared_head.head.weight"] = t["lm_head.weight"].clone() + (1 if differ else 0)

    recipe = Recipe.load("glm5-w8a8")
    _corrupt(sources / "bf16", tmp_path / "copies", with_copies)
    stream.convert(sources / "bf16", tmp_path / "plain-out", "modelslim", recipe, backend="reference")
    stream.convert(tmp_path / "copies", tmp_path / "copies-out", "modelslim", recipe, backend="reference")
    _same(tmp_path / "plain-out", tmp_path / "copies-out")
    _corrupt(sources / "bf16", tmp_path / "bad", lambda t: with_copies(t, differ=True))
    with pytest.raises(CheckpointError, match="shared_head.head.weight .differs from lm_head.weight"):
        stream.convert(tmp_path / "bad", tmp_path / "bad-out", "modelslim", recipe, backend="reference")
    assert not [q for q in tmp_path.iterdir() if q.name.startswith((".bad-out", "bad-out"))]  # nor staging
