"""`glm5 plan` prints the vLLM plugin's serve command beside the engine's own and which quantized formats
each engine serves on the machine (W4A8-int8 experts: vllm-ascend yes, vLLM on NVIDIA no)."""

from __future__ import annotations

import importlib.util
import json
import shlex

from click.testing import CliRunner

from glm5.cli import main


def _plan(machine: str, recipe: str = "glm5-w4a8", *extra: str):
    args = ["plan", "--config", "tiny", "--machine", machine, "--recipe", recipe, "--max-model-len", "2048"]
    return CliRunner().invoke(main, args + list(extra))


def test_plan_json_has_the_plugin_command_and_formats():
    r = _plan("h200x8", "glm5-w8a8", "--json")  # W4A8 is refused there: vLLM cannot serve it
    assert r.exit_code == 0, r.output
    p = json.loads(r.output)
    words = shlex.split(p["plugin"]["serve_command"])
    assert words[:3] == ["GLM5_BACKEND=cuda", "vllm", "serve"]
    i = words.index("--hf-overrides")
    assert json.loads(words[i + 1]) == {"architectures": ["Glm5BackendsForCausalLM"]}
    assert words[words.index("--tensor-parallel-size") + 1] == "1"  # a quantized checkpoint loads whole
    assert json.loads(words[words.index("--speculative-config") + 1])["method"] == "mtp"  # the plugin's MTP
    assert "--hf-overrides" not in shlex.split(p["serve_command"])
    native = p["formats"]["vllm"]
    assert native["W4A8"]["ok"] is False and "AMX" in native["W4A8"]["why"]
    assert native["W8A8"]["ok"] is True and native["bf16"]["ok"] is True
    assert native["FP8"]["ok"] is True  # the plan's default recipe on h200x8 has its row
    plugin = p["formats"]["vllm + plugin (cuda)"]
    # the cuda backend declares grouped_matmul[w4a8]; without triton its table is empty, so "unknown"
    assert plugin["W4A8"]["ok"] is (True if importlib.util.find_spec("triton") else None)


def test_plan_text_on_ascend_says_vllm_ascend_serves_w4a8():
    r = _plan("atlas-800t-a2")
    assert r.exit_code == 0, r.output
    assert "vllm-ascend: bf16 yes, FP8 no, W8A8 yes, W4A8 yes" in r.output
    assert "serve with the glm5 vLLM plugin" in r.output and "GLM5_BACKEND=ascend vllm serve" in r.output
