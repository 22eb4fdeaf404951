"""Helpers of the vLLM plugin tests: run one engine in a fresh process (tests/vllm/engine.py: vLLM keeps
process-wide state), and the project's own greedy tokens to compare with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import backends
from glm5.core.model import GLM5ForCausalLM
from glm5.generate import generate
from glm5.loader import load_model

ENGINE = Path(__file__).with_name("engine.py")
PROMPT_LENS = (5, 40, 23)  # three lengths, submitted together
MAX_TOKENS = 16
NUM_DRAFT = 2  # MTP drafts per round: the second chains the MTP layer on its own output
# generous: under `tox p -p all` an engine shares 2 cores with the other envs (a tiny engine took 164 s to
# start and run on a machine loaded 4x); a hung engine still fails the test
ENGINE_TIMEOUT_S = 600


def fp8_exportable_bf16_model() -> GLM5ForCausalLM:
    """A tiny bf16 model whose split dims are multiples of 256, so FP8's 128-blocks split whole at TP=2."""
    from glm5.core.config import GLM5Config

    cfg = GLM5Config.from_dict(
        {
            **GLM5Config.from_preset("tiny").to_dict(),
            "hidden_size": 256,
            "intermediate_size": 256,
            "moe_intermediate_size": 256,
            "q_lora_rank": 128,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 48,
            "qk_rope_head_dim": 16,
            "v_head_dim": 64,
            "index_head_dim": 64,
        }
    )
    model = GLM5ForCausalLM(cfg, backend="reference", dtype=torch.bfloat16)
    model.init_weights(0)
    return model


def available(name: str) -> bool:
    return any(n == name and ok for n, ok, _ in backends.available())


def engine_env(backend: str, **extra: str) -> dict[str, str]:
    return dict(
        os.environ, GLM5_BACKEND=backend, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **extra
    )


def run_engine(
    cwd: Path,
    backend: str,
    env: dict[str, str] | None = None,
    script: Path = ENGINE,
    timeout: float = ENGINE_TIMEOUT_S,
    **spec,
) -> dict:
    """One vLLM engine in a fresh process (cwd: a scratch directory) -> its JSON result, with the tail of
    its stderr under "stderr"."""
    proc = subprocess.run(
        [sys.executable, str(script), json.dumps(spec)],
        env=env or engine_env(backend),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("GLM5-RESULT ")]
    if proc.returncode or not lines:
        raise AssertionError(f"engine failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    return {**json.loads(lines[-1].removeprefix("GLM5-RESULT ")), "stderr": proc.stderr[-20000:]}


def expected_tokens(model_dir: Path, backend: str, prompts: list[list[int]]) -> list[list[int]]:
    """The project's greedy generation (what `glm5 generate` runs), one request at a time."""
    model = load_model(model_dir, backend=backend).requires_grad_(False)
    dev = model.backend.device
    return [generate(model, torch.tensor([p], device=dev), MAX_TOKENS).tokens[0] for p in prompts]
