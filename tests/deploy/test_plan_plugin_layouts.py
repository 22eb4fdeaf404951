"""`glm5 plan --engine plugin`: the layouts the vLLM plugin serves (tensor parallel, expert parallel over the
TP group, quantized checkpoints split after a whole read), per-device memory of the sharded weights, the MTP
draft and the caches, its command; a request it cannot serve exits 2 with the reason, one that does not fit
exits 1."""

from __future__ import annotations

import dataclasses
import json
import shlex

from click.testing import CliRunner

from glm5.cli import main
from glm5.core.config import GLM5Config


def _plan(*extra: str, config: str = "tiny", machine: str = "h200x8"):
    args = ["plan", "--config", config, "--machine", machine, "--max-model-len", "2048", "--engine", "plugin"]
    return CliRunner().invoke(main, args + list(extra))


def _json(*extra: str, **kw):
    r = _plan("--json", *extra, **kw)
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_float_checkpoint_is_sharded_and_the_command_says_so():
    p = _json("--recipe", "bf16", "--tp", "2")
    lay, words = p["layout"], shlex.split(p["serve_command"])
    assert lay["fits"] and (lay["tp"], lay["dp"]) == (2, 4)
    assert words[:3] == ["GLM5_BACKEND=cuda", "vllm", "serve"]
    assert words[words.index("--tensor-parallel-size") + 1] == "2"
    assert words[words.index("--data-parallel-size") + 1] == "4"
    assert json.loads(words[words.index("--speculative-config") + 1]) == {
        "method": "mtp",
        "num_speculative_tokens": 3,
    }
    whole = _json("--recipe", "bf16", "--tp", "1")["layout"]["per_device_bytes"]
    # the sharded weights: well under the whole model's per rank (router, indexer, norms stay whole)
    assert lay["per_device_bytes"]["weights"] < 0.75 * whole["weights"]
    # the draft's MTP layer is split like the target's layers (its embedding and head are the target's)
    assert 0 < lay["per_device_bytes"]["mtp_draft"] < 0.75 * whole["mtp_draft"]
    assert _json("--recipe", "bf16", "--tp", "2", "--no-mtp")["layout"]["per_device_bytes"]["mtp_draft"] == 0


def test_expert_parallel_only_over_the_whole_tp_group(tmp_path):
    cfg = dataclasses.replace(GLM5Config.from_preset("tiny"), num_attention_heads=8, num_key_value_heads=8)
    path = tmp_path / "tiny8.json"
    path.write_text(json.dumps(cfg.to_dict()))
    p = _json("--recipe", "bf16", "--tp", "8", config=str(path))
    eps = {(c["tp"], c["dp"], c["expert_parallel"]) for c in p["candidates"]}
    assert eps == {(8, 1, False), (8, 1, True)}
    if p["layout"]["expert_parallel"]:
        assert "--enable-expert-parallel" in shlex.split(p["serve_command"])
    assert all(not c["expert_parallel"] for c in _json("--recipe", "bf16", "--tp", "4")["candidates"])


def test_fp8_cache_is_the_plugins_fp8_ds_mla():
    p = _json("--recipe", "bf16", "--kv-cache-dtype", "fp8")
    words = shlex.split(p["serve_command"])
    assert words[words.index("--kv-cache-dtype") + 1] == "fp8_ds_mla"
    assert p["layout"]["kv_cache"] == "fp8"


def test_quantized_checkpoint_is_split_and_each_rank_reads_its_slices():
    p = _json("--recipe", "glm5-w8a8", "--tp", "2")
    assert p["layout"]["fits"] and p["layout"]["tp"] == 2
    assert (
        shlex.split(p["serve_command"])[shlex.split(p["serve_command"]).index("--tensor-parallel-size") + 1]
        == "2"
    )
    # full size: each rank reads only its slices through vLLM's iterator, so GLM-5-FP8 loads on 8 x H200
    full = _json("--recipe", "fp8", config="glm5-744b")
    lay, per = full["layout"], full["layout"]["per_device_bytes"]
    assert lay["fits"] and lay["tp"] == 8 and full["serve_command"]
    held = per["weights"] + per["mtp_draft"]
    assert held < lay["load_peak_bytes"] <= held + 4 * 2**30 < per["usable"]  # + one weight in flight
    r = _plan("--recipe", "fp8", config="glm5-744b")
    assert "per device at load:" in r.output and "whole" not in r.output


def test_fp8_cache_on_ascend_exits_2():
    r = _plan("--recipe", "glm5-w8a8", "--kv-cache-dtype", "fp8", machine="atlas-800t-a3")
    assert r.exit_code == 2, r.output
    assert "no FP8 datapath" in r.output
