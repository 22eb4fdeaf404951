"""Saved-activation memory of one training step with per-layer activation modes
(glm5/train/loop/activations.py): none vs recompute vs offload, measured in one run on the same model and
batch.

The figure is what the backward will need, held on the compute device when the forward ends (the peak of
saved activations: the backward only frees them): the distinct storages autograd saved outside any
per-layer hook (embedding, final norm, loss, and every layer in mode 'none'), plus, in mode 'recompute',
the layer inputs the checkpoints keep. Parameters are not counted. 'offload' also reports the bytes its
layers copied to host memory. Ratios are against 'none' from the same run; seconds are the median step.
On a CUDA host (backend cuda) torch.cuda.max_memory_allocated's step peak is printed too.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_activation_memory.py [--backend cpu] [--batch 2]
        [--seq-len 128] [--mtp-steps 1] [--runs 3] [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from glm5.core.config import GLM5Config  # noqa: E402
from glm5.core.model import GLM5ForCausalLM  # noqa: E402
from glm5.train.loop.activations import MODES, checkpoint_layers  # noqa: E402
from glm5.train.loop.losses import lm_and_mtp  # noqa: E402


def _step(model: GLM5ForCausalLM, ids: torch.Tensor, mtp_steps: int) -> tuple[int, float]:
    """One forward + backward -> (device bytes saved for the backward at the end of the forward, seconds)."""
    resident = {p.untyped_storage().data_ptr() for p in (*model.parameters(), *model.buffers())}
    saved: dict[int, torch.Tensor] = {}  # storage address -> a tensor on it (held: no address reuse)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in resident and t.device.type == ids.device.type:
            saved.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = lm_and_mtp(model, ids, mtp_steps)
    total = out.lm + out.mtp if out.mtp is not None else out.lm
    held = sum(t.untyped_storage().nbytes() for t in saved.values())
    saved.clear()
    total.backward()
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    return held, time.perf_counter() - t0


def measure(mode: str, args: argparse.Namespace) -> dict:
    model = GLM5ForCausalLM(GLM5Config.from_preset(args.preset), backend=args.backend)
    model.init_weights(0)
    model.train()
    ids = torch.randint(
        0, model.config.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0)
    ).to(model.backend.device)
    _step(model, ids, args.mtp_steps)  # warm-up
    stats = checkpoint_layers(model, mode)
    cuda = ids.device.type == "cuda"
    held, secs = [], []
    for _ in range(args.runs):
        model.zero_grad(set_to_none=True)
        for s in stats.values():
            s.kept_input_bytes = s.offloaded_bytes = 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        h, t = _step(model, ids, args.mtp_steps)
        kept = sum(s.kept_input_bytes for s in stats.values())
        held.append(h + kept)
        secs.append(t)
    rec = {
        "mode": mode,
        "saved_bytes": held[-1],
        "host_bytes": sum(s.offloaded_bytes for s in stats.values()),
        "step_s": statistics.median(secs),
    }
    if cuda:
        rec["cuda_step_peak_bytes"] = torch.cuda.max_memory_allocated() - base
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--mtp-steps", type=int, default=1)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None, help="append one JSON object per mode to this file")
    args = p.parse_args()
    torch.manual_seed(0)
    recs = [measure(mode, args) for mode in MODES]
    for rec in recs:
        rec.update(
            bench="activation_memory",
            backend=args.backend,
            preset=args.preset,
            batch=args.batch,
            seq_len=args.seq_len,
            saved_ratio=rec["saved_bytes"] / recs[0]["saved_bytes"],
        )
        print(json.dumps(rec))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
