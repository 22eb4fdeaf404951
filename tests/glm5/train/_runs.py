"""What the training tests read back from a run directory, and the CLI run the checkpoint tests start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

#: a small `glm5 train` run that evaluates and saves every second step
TRAIN_ARGS = [
    "--batch-size",
    "4",
    "--seq-len",
    "32",
    "--eval-every",
    "2",
    "--save-every",
    "2",
    "--quiet",
    "--no-rollout-check",
]


def records(run: Path) -> list[dict]:
    """The run's metrics.jsonl without the wall-clock field (`step_s`): what two runs must agree on."""
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        r.pop("step_s")
    return recs


def train_cli(out: Path, *args: str) -> subprocess.CompletedProcess:
    """`glm5 train --out OUT TRAIN_ARGS ARGS` in a fresh process, one thread; it must exit 0."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "glm5.cli", "train", "--out", str(out), *TRAIN_ARGS, *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
