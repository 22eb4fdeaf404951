"""Hostile and broken checkpoints (issue 21): every reader (the float loader, the FP8 loaders, the
quantized loader, the streamed converter) refuses them with one line naming the file and what is wrong,
never a traceback from safetensors, never a silently wrong model."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from glm5.cli import main
from glm5.core.checkpoint import BadCheckpointFile, CheckpointError
from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.loader import load_model
from quant.formats import fp8
from quant.load import load_quantized
from quant.stream import convert

SINGLE = "model.safetensors"


def _model(**overrides):
    model = GLM5ForCausalLM(GLM5Config.from_preset("tiny", **overrides), backend="reference")
    model.init_weights(0)
    return model


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    model = _model()
    model.save_pretrained(root / "float")
    model.save_pretrained(root / "sharded", max_shard_size=40_000)
    # an intermediate size above one 128-block, so FP8 scales of the dense MLP have 3 blocks, not 1
    fp8.export(_model(intermediate_size=384), root / "fp8")
    from quant.load import export
    from quant.quantize import quantize_model

    quantize_model(model, "glm5-w8a8")
    export(model, root / "quant", "compressed-tensors")
    export(model, root / "modelslim", "modelslim")
    return root


def _copy(sources, kind, tmp_path):
    dst = tmp_path / kind
    shutil.copytree(sources / kind, dst)
    return dst


def _edit(path, change, fname=SINGLE):
    t = load_file(path / fname)
    change(t)
    save_file(t, path / fname, metadata={"format": "pt"})


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


FLOAT_LOADERS = {
    "float": lambda p: GLM5ForCausalLM.from_pretrained(p, backend="reference"),
    "streamed": lambda p: convert(p, p.parent / "out", "fp8"),
}
FP8_LOADERS = {
    "fp8-modules": lambda p: load_model(p, backend="reference"),
    "dequantized": lambda p: fp8.load_fp8(p, backend="reference", fp8_modules=False),
    "streamed": lambda p: convert(p, p.parent / "out", "fp8"),
}
DENSE = "model.layers.0.mlp"


# -- (1) FP8: one fit check (scales included) and one dtype rule for every loader ----------------------


def _scale(name, shape):
    return lambda t: t.__setitem__(f"{DENSE}.{name}.weight_scale_inv", torch.ones(shape))


@pytest.mark.parametrize("loader", sorted(FP8_LOADERS))
@pytest.mark.parametrize(
    "change, words",
    [
        (_scale("gate_proj", (1, 1)), "gate_proj.weight_scale_inv (expected [3, 1], got [1, 1])"),
        (_scale("down_proj", (1, 1)), "down_proj.weight_scale_inv (expected [1, 3], got [1, 1])"),
        (_scale("gate_proj", (4, 1)), "gate_proj.weight_scale_inv (expected [3, 1], got [4, 1])"),
        (
            lambda t: t.__setitem__(f"{DENSE}.gate_proj.weight", t[f"{DENSE}.gate_proj.weight"][:1]),
            "gate_proj.weight (expected [384, 64], got [1, 64])",
        ),
    ],
    ids=["scale-1x1", "scale-1xkb", "scale-too-large", "weight-1xK"],
)
def test_fp8_shapes_are_checked_by_every_loader(sources, tmp_path, loader, change, words):
    path = _copy(sources, "fp8", tmp_path)
    _edit(path, change)
    with pytest.raises(CheckpointError) as e:
        FP8_LOADERS[loader](path)
    assert words in _one_line(e.value)


@pytest.mark.parametrize("loader", sorted(FP8_LOADERS))
def test_fp8_weight_stored_in_bf16_is_refused_by_every_loader(sources, tmp_path, loader):
    path = _copy(sources, "fp8", tmp_path)
    name = f"{DENSE}.gate_proj.weight"
    _edit(path, lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)))
    with pytest.raises(BadCheckpointFile) as e:
        FP8_LOADERS[loader](path)
    msg = _one_line(e.value)
    assert name in msg and SINGLE in msg and "float8_e4m3fn, got bfloat16" in msg


# -- (2) a tensor in two files, with no index to say which ------------------------------------------------


@pytest.mark.parametrize("loader", sorted(FLOAT_LOADERS))
def test_a_tensor_in_two_files_without_index_is_refused(sources, tmp_path, loader):
    path = _copy(sources, "float", tmp_path)
    save_file({"model.norm.weight": torch.zeros(64)}, path / "zz-extra.safetensors")
    with pytest.raises(BadCheckpointFile) as e:
        FLOAT_LOADERS[loader](path)
    msg = _one_line(e.value)
    assert "model.norm.weight" in msg and SINGLE in msg and "zz-extra.safetensors" in msg


# -- unreadable safetensors: one ValueError naming the file ---------------------------------------------


def _header(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _with_header(data: bytes, edit) -> bytes:
    header, body = _header(data)
    edit(header)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def _overflow(header):
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [0, 2**64 - 1]


BROKEN = {
    "truncated": lambda d: d[: len(d) // 2],
    "empty": lambda d: b"",
    "huge-header": lambda d: struct.pack("<Q", 1 << 40) + d[8:],
    "bad-json": lambda d: struct.pack("<Q", 5) + b"{abc}" + d[13:],
    "overflowing-offsets": lambda d: _with_header(d, _overflow),
}
ALL_LOADERS = {
    **{f"float/{k}": ("float", f) for k, f in FLOAT_LOADERS.items()},
    "fp8/fp8-modules": ("fp8", FP8_LOADERS["fp8-modules"]),
    "quant": ("quant", lambda p: load_quantized(p, backend="reference")),
}


@pytest.mark.parametrize("loader", sorted(ALL_LOADERS))
@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_an_unreadable_safetensors_file_is_one_line_naming_it(sources, tmp_path, loader, broken):
    kind, load = ALL_LOADERS[loader]
    path = _copy(sources, kind, tmp_path)
    f = path / SINGLE
    f.write_bytes(BROKEN[broken](f.read_bytes()))
    with pytest.raises(BadCheckpointFile) as e:
        load(path)
    assert str(f) in _one_line(e.value)


@pytest.mark.parametrize("loader", sorted(FLOAT_LOADERS))
def test_a_shard_lacking_a_tensor_its_index_names_is_named(sources, tmp_path, loader):
    path = _copy(sources, "sharded", tmp_path)
    wmap = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    _edit(path, lambda t: t.pop(name), wmap[name])
    with pytest.raises(BadCheckpointFile) as e:
        FLOAT_LOADERS[loader](path)
    msg = _one_line(e.value)
    assert name in msg and wmap[name] in msg


@pytest.mark.parametrize("command", ["generate", "quantize"])
def test_cli_on_a_truncated_checkpoint_is_one_line_exit_2(sources, tmp_path, command):
    path = _copy(sources, "float", tmp_path)
    f = path / SINGLE
    f.write_bytes(f.read_bytes()[:1000])
    args = {
        "generate": ["generate", "--model", str(path), "--max-new-tokens", "1"],
        "quantize": ["quantize", "--model", str(path), "--format", "fp8", "--out", str(tmp_path / "o")],
    }
    res = CliRunner().invoke(main, args[command])
    assert res.exit_code == 2, (res.output, repr(res.exception))
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert len(errors) == 1 and SINGLE in errors[0] and "Traceback" not in res.output, res.output


# -- config.json: type and range of every field -----------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("hidden_size", "64"),
        ("hidden_size", 64.0),
        ("tie_word_embeddings", 1),
        ("vocab_size", -1),
        ("n_group", 0),
        ("num_experts_per_tok", 0),
        ("rope_parameters", None),
        ("eos_token_id", []),
        ("rms_norm_eps", -1),
        ("max_position_embeddings", -1),
        ("num_nextn_predict_layers", 1_000_000),
        ("indexer_types", "full" * 10_000),
    ],
)
@pytest.mark.parametrize("loader", sorted(FLOAT_LOADERS))
def test_a_config_field_of_the_wrong_type_or_range_is_one_line(sources, tmp_path, field, value, loader):
    path = _copy(sources, "float", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg[field] = value
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BadCheckpointFile) as e:
        FLOAT_LOADERS[loader](path)
    msg = _one_line(e.value)
    assert str(path / "config.json") in msg and f"{field}: expected" in msg


@pytest.mark.parametrize(
    "kind, fname",
    [("float", "config.json"), ("quant", "config.json"), ("modelslim", "quant_model_description.json")],
)
def test_a_json_file_symlinked_outside_the_checkpoint_is_refused(sources, tmp_path, kind, fname):
    path = _copy(sources, kind, tmp_path)
    outside = tmp_path / "elsewhere.json"
    shutil.move(path / fname, outside)
    (path / fname).symlink_to(outside)
    quantized = {"quant": lambda p: load_quantized(p, backend="reference")}
    for load in (FLOAT_LOADERS if kind == "float" else quantized).values():
        with pytest.raises(ValueError, match="outside"):
            load(path)


# -- tensor values and dtypes ----------------------------------------------------------------------------


def _poison(name, value):
    def change(t):
        t[name] = t[name].clone()
        t[name].view(-1)[0] = value

    return change


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("loader", sorted(FLOAT_LOADERS))
def test_nonfinite_float_weights_are_refused(sources, tmp_path, loader, value):
    path = _copy(sources, "float", tmp_path)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    _edit(path, _poison(name, value))
    with pytest.raises(BadCheckpointFile) as e:
        FLOAT_LOADERS[loader](path)
    msg = _one_line(e.value)
    assert name in msg and SINGLE in msg and "NaN or inf" in msg


@pytest.mark.parametrize("loader", sorted(FP8_LOADERS))
@pytest.mark.parametrize("tensor", ["weight_scale_inv", "weight"])
def test_nonfinite_fp8_weights_and_scales_are_refused(sources, tmp_path, loader, tensor):
    path = _copy(sources, "fp8", tmp_path)
    name = f"{DENSE}.up_proj.{tensor}"
    _edit(path, _poison(name, float("inf") if tensor == "weight_scale_inv" else float("nan")))
    with pytest.raises(BadCheckpointFile) as e:
        FP8_LOADERS[loader](path)
    msg = _one_line(e.value)
    assert name in msg and SINGLE in msg and "NaN or inf" in msg


@pytest.mark.parametrize("loader", sorted(FP8_LOADERS))
@pytest.mark.parametrize("value", [-1.0, 0.0])
def test_fp8_scales_that_are_not_positive_are_refused_by_name(sources, tmp_path, loader, value):
    path = _copy(sources, "fp8", tmp_path)
    name = f"{DENSE}.up_proj.weight_scale_inv"  # a negative multiplier would load the block negated
    _edit(path, _poison(name, value))
    with pytest.raises(BadCheckpointFile) as e:
        FP8_LOADERS[loader](path)
    msg = _one_line(e.value)
    assert name in msg and SINGLE in msg and "scale <= 0" in msg


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float64, torch.float8_e4m3fn])
@pytest.mark.parametrize("loader", sorted(FLOAT_LOADERS))
def test_a_tensor_of_a_dtype_a_float_checkpoint_does_not_hold_is_refused(sources, tmp_path, loader, dtype):
    path = _copy(sources, "float", tmp_path)
    name = "model.norm.weight"
    _edit(path, lambda t: t.__setitem__(name, t[name].to(dtype)))
    with pytest.raises(BadCheckpointFile) as e:
        FLOAT_LOADERS[loader](path)
    msg = _one_line(e.value)
    assert name in msg and SINGLE in msg and f"got {str(dtype).removeprefix('torch.')}" in msg


def test_config_from_json_names_the_file(sources, tmp_path):
    cfg = json.loads((sources / "float" / "config.json").read_text())
    cfg["hidden_size"] = 64.0
    f = tmp_path / "config.json"
    f.write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        GLM5Config.from_json(f)
    assert str(f) in _one_line(e.value) and "hidden_size: expected int, got 64.0" in str(e.value)


@pytest.mark.parametrize("kind", ["quant", "modelslim"])
def test_a_quantized_scale_of_the_wrong_shape_is_refused_by_name(sources, tmp_path, kind):
    path = _copy(sources, kind, tmp_path)
    name = "model.layers.0.self_attn.q_a_proj.weight_scale"
    _edit(path, lambda t: t.__setitem__(name, torch.ones(1, 1)))
    with pytest.raises(ValueError) as e:
        load_quantized(path, backend="reference")
    assert name in _one_line(e.value)


def _self_link(path):
    (path / SINGLE).unlink()
    (path / SINGLE).symlink_to(SINGLE)


def _config_list(path):
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = [1]
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "change, words",
    [
        (_self_link, ("model.safetensors", "cannot be resolved")),
        (_config_list, ("quantization_config", "list")),
    ],
)
@pytest.mark.parametrize("command", ["generate", "quantize"])
def test_a_self_symlink_and_a_list_quantization_config_are_one_line(
    sources, tmp_path, change, words, command
):
    path = _copy(sources, "float", tmp_path)
    change(path)
    args = ["--model", str(path)]
    args += (
        ["--prompt-ids", "1,2"]
        if command == "generate"
        else ["--out", str(tmp_path / "q"), "--format", "fp8"]
    )
    res = CliRunner().invoke(main, [command, *args])
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert res.exit_code == 2 and "Traceback" not in res.output, (res.output, repr(res.exception))
    assert len(errors) == 1 and all(w in errors[0] for w in words), res.output
