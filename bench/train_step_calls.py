"""Op calls in one `glm5 train` step: how many times each op's forward and backward run.

One training step of the tiny preset (the `glm5 train --config tiny` stage and loss terms; batch 2 x 16
tokens, no evaluation) on one backend, counted twice: `Backend.calls` ("op" for a forward through the
front door, "op.backward" for its declared backward) and, on the reference backend, the runs of the
reference's own forward functions (`backends.counters.REFERENCE_CALLS`, which also sees a forward
recomputed inside a backward). Each differentiable forward runs once per use: the linear cross-entropy
forward once per loss term (the LM loss and one per MTP step), not again in the backward.

    python bench/train_step_calls.py [--backend reference] [--stage sparse] [--mtp-steps 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def step_calls(
    backend: str = "reference", stage: str = "sparse", mtp_steps: int = 1, **cfg
) -> tuple[Counter, Counter]:
    """(the backend's call counter, the reference forward functions' runs) in one training step."""
    from backends.counters import REFERENCE_CALLS
    from glm5.train.loop.trainer import TrainConfig, Trainer

    config = TrainConfig(
        backend=backend, stage=stage, mtp_steps=mtp_steps, steps=1, batch_size=2, seq_len=16, **cfg
    )
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(config, Path(out) / "run")
        trainer.model.backend.calls.clear()
        before = REFERENCE_CALLS.copy()
        trainer.train_step(0)
        return Counter(trainer.model.backend.calls), REFERENCE_CALLS - before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="reference")
    p.add_argument("--stage", default="sparse")
    p.add_argument("--mtp-steps", type=int, default=1)
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    a = p.parse_args()
    calls, forwards = step_calls(a.backend, a.stage, a.mtp_steps)
    if a.json:
        print(json.dumps({"calls": dict(sorted(calls.items())), "reference_forwards": dict(forwards)}))
        return
    print(f"{'op':32s} {'calls':>6s} {'reference forward runs':>24s}")
    for name, n in sorted(calls.items()):
        print(f"{name:32s} {n:6d} {forwards.get(name, '') if '.' not in name else '':>24}")


if __name__ == "__main__":
    main()
