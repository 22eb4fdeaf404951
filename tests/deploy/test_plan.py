"""The planner on the published GLM-5 configurations (the vllm-ascend deployment guide's), its kernel
limits, machine profiles as files, and the `glm5 plan` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from glm5.cli import main
from glm5.core.config import GLM5Config
from glm5.deploy import Machine, Request, evaluate, make_plan, weights_for
from glm5.deploy.inventory import meta_model, totals
from glm5.deploy.machines import MACHINE_DIR, available, parse_bytes

GLM5 = GLM5Config.from_preset("glm5-744b")
A3, A2, H200 = (Machine.load(n) for n in ("atlas-800t-a3", "atlas-800t-a2", "h200x8"))
GiB = 1 << 30


def req(recipe: str, machine: Machine = A3, max_model_len: int = 32768, **kw) -> Request:
    return Request(GLM5, machine, recipe, max_model_len, **kw)


# -- the published verdicts (full-size GLM-5 on the meta device) ------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("recipe,max_model_len", [("glm5-w4a8", 200000), ("glm5-w8a8", 40960)])
def test_w4a8_and_w8a8_fit_one_atlas_a3_with_tp16_ep(recipe, max_model_len):
    """vllm-ascend guide: both fit 1 A3 with TP16, DP1, expert parallel (max-model-len 200000 / 40960)."""
    p = make_plan(req(recipe, max_model_len=max_model_len, tp=16))
    lay = p.layout
    assert p.fits and (lay.tp, lay.dp, lay.ep) == (16, 1, 16), lay.to_dict()
    pd = lay.per_device
    assert pd["total"] <= pd["usable"] == int(0.95 * 64 * GiB)
    assert lay.max_concurrent_seqs >= 1
    # the sequences it promises really fit: one more would not
    assert (
        pd["weights"] + pd["workspace"] + (lay.max_concurrent_seqs + 1) * pd["per_sequence_cache"]
        > pd["usable"]
    )
    assert make_plan(req(recipe, max_model_len=max_model_len)).fits  # and the free choice fits too


@pytest.mark.slow
def test_w8a8_at_200k_does_not_fit_tp16_and_says_why():
    lay = make_plan(req("glm5-w8a8", max_model_len=200000, tp=16)).layout
    assert not lay.fits and "KV + indexer cache" in lay.overflow and "short by" in lay.overflow


@pytest.mark.slow
def test_bf16_needs_two_a3_nodes():
    one = make_plan(req("bf16", max_model_len=4096))
    assert not one.fits
    assert all(c.per_device["weights"] > c.per_device["usable"] for c in one.candidates if c.per_device)
    assert "before any KV cache" in one.layout.overflow
    two = make_plan(req("bf16", max_model_len=32768, nodes=2, tp=16))
    assert two.fits and (two.layout.tp, two.layout.dp, two.layout.ep) == (16, 2, 32)
    assert make_plan(req("bf16", max_model_len=32768)).min_nodes == 2


@pytest.mark.slow
def test_w4a8_fits_one_atlas_a2_with_tp8():
    p = make_plan(req("glm5-w4a8", A2, max_model_len=32768, tp=8))  # guide: TP8, max-model-len 32768
    assert p.fits and p.layout.ep == 8


@pytest.mark.slow
def test_expert_bytes_by_hand():
    """Routed experts of the 75 main MoE layers in the msModelSlim layout (quant.md 2.1), by hand."""
    weights = weights_for(GLM5, "glm5-w4a8", "modelslim")
    e, d, i, layers = 256, 6144, 2048, 75
    gate_up = i // 2 * d + i * 4 * 2 + i * 4  # int4 pairs + scale + offset + scale_bias [N, 1]
    down = d // 2 * i + d * 4 * 2 + d * 16 * 4  # scale_bias [N, 16]
    main = sum(w.nbytes for w in weights if w.role == "routed_experts" and not w.mtp)
    assert main == layers * e * (2 * gate_up + down)
    counts = meta_model(GLM5).parameter_counts()
    bf16 = weights_for(GLM5, "bf16", "hf")
    routed_f = sum(w.nbytes for w in bf16 if w.role == "routed_experts")
    assert routed_f == 2 * counts["routed_experts"] + 2 * e * 3 * d * i  # + the MTP layer's experts
    assert sum(w.nbytes for w in bf16 if w.mtp) == sum(w.nbytes for w in weights if w.mtp)  # MTP stays float
    assert totals(bf16, "scheme") == {"FLOAT": sum(w.nbytes for w in bf16)}


# -- kernel limits --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ascend_limits():
    w4 = req("glm5-w4a8", max_model_len=8192)
    assert any("do not split over TP3" in v for v in evaluate(w4, 3, 1).violations)
    assert any("exceed the grouped matmul limit 128" in v for v in evaluate(w4, 1, 1).violations)
    no_ep = req("glm5-w4a8", max_model_len=8192, nodes=2, expert_parallel=False)
    v = evaluate(no_ep, 16, 2).violations
    assert any("scale_bias holds 16 K-slices" in x for x in v), v
    assert not any(
        "scale_bias" in x for x in evaluate(req("glm5-w4a8", expert_parallel=False), 16, 1).violations
    )
    assert any("spans nodes" in x for x in evaluate(req("glm5-w4a8", nodes=2), 32, 1).violations)
    with pytest.raises(ValueError, match="per channel"):
        make_plan(req("glm5-w4a8-g128"))


def test_heads_per_rank_power_of_two_on_ascend_only():
    cfg = GLM5Config.from_preset(
        "tiny", num_attention_heads=12, num_key_value_heads=12, n_routed_experts=16, n_group=1
    )
    small_a3 = Machine.from_dict(
        {
            **yaml.safe_load((MACHINE_DIR / "atlas-800t-a3.yaml").read_text()),
            "devices_per_node": 4,
            "memory_per_device": "8 GiB",
        }
    )
    on_a3 = evaluate(Request(cfg, small_a3, "glm5-w8a8", 1024, preset="tiny"), 4, 1)
    assert on_a3.violations == [
        "3 attention heads per rank: vllm-ascend sparse attention needs a power of two"
    ]
    h200 = evaluate(Request(cfg, H200, "glm5-w8a8", 1024, preset="tiny"), 4, 2)
    assert h200.fits, h200.violations
    odd = GLM5Config.from_preset("tiny", n_routed_experts=12, n_group=1)
    v = evaluate(Request(odd, small_a3, "glm5-w8a8", 1024, preset="tiny"), 2, 4).violations
    assert "12 experts are not divisible by the expert-parallel size 8" in v


# -- machine profiles are files -------------------------------------------------------------------------
def test_profiles_load():
    assert {"atlas-800t-a3", "atlas-800t-a2", "h200x8"} <= set(available())
    assert (A3.devices_per_node, A3.memory_per_device) == (16, 64 * GiB)
    assert (A2.devices_per_node, H200.memory_per_device) == (8, 143771 << 20)
    assert parse_bytes("141 GB", "x") == 141 * 10**9
    assert A3.env("glm5-w8a8")[
        "VLLM_ASCEND_ENABLE_MLAPO"
    ] == "1" and "VLLM_ASCEND_ENABLE_MLAPO" not in A3.env("glm5-w4a8")


def test_a_new_node_type_is_a_new_file(tmp_path):
    d = yaml.safe_load((MACHINE_DIR / "atlas-800t-a3.yaml").read_text())
    d.update(name="big-node", devices_per_node=8, memory_per_device="128 GiB")
    (tmp_path / "big.yaml").write_text(yaml.safe_dump(d))
    m = Machine.load(tmp_path / "big.yaml")
    tiny = GLM5Config.from_preset("tiny")
    small = make_plan(Request(tiny, A3, "glm5-w4a8", 2048, preset="tiny", tp=4, expert_parallel=False))
    big = make_plan(Request(tiny, m, "glm5-w4a8", 2048, preset="tiny", tp=4, expert_parallel=False))
    assert big.layout.per_device["usable"] == int(0.95 * 128 * GiB)
    assert big.layout.max_concurrent_seqs > small.layout.max_concurrent_seqs > 0


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("devices_per_node", 0, "machine.devices_per_node"),
        ("memory_per_device", "lots", "machine.memory_per_device"),
        ("caches", {"kv_cache": ["int4"], "indexer_cache": ["bf16"]}, "machine.caches.kv_cache"),
    ],
)
def test_bad_profile_names_the_field(field, value, match):
    d = yaml.safe_load((MACHINE_DIR / "h200x8.yaml").read_text())
    d[field] = value
    with pytest.raises(ValueError, match=match):
        Machine.from_dict(d)


def test_bad_request_names_the_argument():
    with pytest.raises(ValueError, match="max_model_len"):
        req("glm5-w4a8", max_model_len=300000)
    with pytest.raises(ValueError, match="indexer_cache"):
        req("glm5-w4a8", H200, indexer_cache="bf16")


# -- the command ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_json_and_serve_command():
    r = CliRunner().invoke(
        main,
        [
            "plan",
            "--config",
            "glm5-744b",
            "--machine",
            "atlas-800t-a3",
            "--recipe",
            "glm5-w4a8",
            "--max-model-len",
            "200000",
            "--tp",
            "16",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    p = json.loads(r.output)
    assert p["fits"] is True and p["max_concurrent_seqs"] >= 1
    assert set(p["per_device_bytes"]) >= {"weights", "kv_cache", "indexer_cache", "workspace"}
    cmd = p["serve_command"]
    for piece in [
        "vllm serve",
        "--tensor-parallel-size 16",
        "--data-parallel-size 1",
        "--enable-expert-parallel",
        "--quantization ascend",
        "--max-model-len 200000",
        "deepseek_mtp",
        "FULL_DECODE_ONLY",
    ]:
        assert piece in cmd, piece
    assert p["env"] == {
        "HCCL_OP_EXPANSION_MODE": "AIV",
        "HCCL_BUFFSIZE": "200",
        "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    }


@pytest.mark.slow
def test_cli_overflow_exits_nonzero():
    r = CliRunner().invoke(
        main, ["plan", "--machine", "atlas-800t-a3", "--recipe", "bf16", "--max-model-len", "32768"]
    )
    assert r.exit_code == 1
    assert "does not fit" in r.output and "exceed the usable" in r.output and "--nodes 2" in r.output
    r = CliRunner().invoke(
        main,
        [
            "plan",
            "--machine",
            "atlas-800t-a3",
            "--recipe",
            "bf16",
            "--max-model-len",
            "32768",
            "--nodes",
            "2",
            "--json",
        ],
    )
    assert r.exit_code == 0
    p = json.loads(r.output)
    assert p["layout"]["dp"] * p["layout"]["tp"] == 32 and len(p["serve_commands"]) == 2
    assert "--headless" in p["serve_commands"][1] and "--quantization" not in p["serve_command"]


def test_cli_takes_a_config_json_and_a_profile_path(tmp_path):
    cfg = GLM5Config.from_preset("tiny")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    args = [
        "plan",
        "--config",
        str(tmp_path / "config.json"),
        "--machine",
        str(MACHINE_DIR / "h200x8.yaml"),
        "--recipe",
        "glm5-w8a8",
        "--max-model-len",
        "2048",
        "--json",
    ]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    p = json.loads(r.output)
    direct = make_plan(Request(cfg, H200, "glm5-w8a8", 2048)).layout
    assert (
        p["per_device_bytes"] == direct.per_device and p["max_concurrent_seqs"] == direct.max_concurrent_seqs
    )
    # tiny on h200x8 (KV bf16, indexer fp8): 5 layers x (32 + 8) x 2 B + 4 indexer layers x (16 + 4) B
    # = 480 B per token
    # 2048 tokens + 3 MTP lookahead slots -> 33 blocks of 64 = 2112 slots
    assert p["per_device_bytes"]["per_sequence_cache"] == 480 * 2112
    free = direct.per_device["usable"] - direct.per_device["weights"] - direct.per_device["workspace"]
    assert p["cache_tokens_per_replica"] == free // (480 * 64) * 64


def test_cli_rejects_unknown_machine():
    r = CliRunner().invoke(main, ["plan", "--machine", "nope", "--max-model-len", "1024"])
    assert r.exit_code == 2 and "machine" in r.output


def test_docs_exist():
    doc = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
    text = doc.read_text()
    assert "glm5 plan" in text and "vllm serve" in text and "--quantization ascend" in text
