"""A training step's sparse MLA attention (forward + backward) on the cpu backend: the explicit backward
(`OpImpl.backward`, from the forward's saved out and lse) against the reference's declared backward on
the same saved outputs (the same backend with the reference's `backward`; the recomputing backward the
2026-12-01 figures compared with no longer exists), same run.

Shape: one request of --keys keys, --tokens queries, H 16 heads of d_qk 576 / d_v 512 (GLM-5's latent
widths), top-512 causal keys per query. Rounds interleave the variants; medians of --runs rounds.

    OMP_NUM_THREADS=1 python bench/bench_cpu_attention_backward.py [--runs 5] [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import cpu_context, emit, interleaved_s  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--keys", type=int, default=4096)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    import backends
    from backends import SeqLayout
    from backends.cpu import CpuBackend

    explicit = backends.get("cpu")
    recompute = CpuBackend()
    recompute.ops = dict(recompute.ops)
    from backends.reference.sparse_mla_attention import backward as reference_backward

    recompute.ops["sparse_mla_attention"] = dataclasses.replace(
        recompute.ops["sparse_mla_attention"], backward=reference_backward
    )
    g = torch.Generator().manual_seed(0)
    t, s, h, topk = a.tokens, a.keys, 16, 512
    layout = SeqLayout.from_lengths([t], [s])
    layout.trusted = True
    q0 = torch.randn(t, h, 576, generator=g) * 0.1
    kv0 = torch.randn(s, 576, generator=g) * 0.1
    idx = torch.stack([torch.randperm(s - t + i + 1, generator=g)[:topk] for i in range(t)]).int()
    d_out = torch.randn(t, h, 512, generator=g)
    grads = {}

    def step(be, name):
        def run():
            q, kv = q0.clone().requires_grad_(), kv0.clone().requires_grad_()
            out, _ = be.sparse_mla_attention(q, kv, idx, layout, 576**-0.5, 512, return_lse=False)
            (out * d_out).sum().backward()
            grads[name] = (q.grad, kv.grad)

        return run

    variants = {"explicit": step(explicit, "explicit"), "recompute": step(recompute, "recompute")}
    ms = {k: v * 1e3 for k, v in interleaved_s(variants, a.runs).items()}
    pairs = zip(grads["explicit"], grads["recompute"], strict=True)
    worst = max((x - y).abs().max().item() for x, y in pairs)
    emit(
        {
            "bench": "cpu_attention_backward",
            "shape": f"T{t} S{s} H{h} d576/512 top{topk}",
            "explicit_ms": round(ms["explicit"], 1),
            "recompute_ms": round(ms["recompute"], 1),
            "ratio recompute/explicit (speed)": round(ms["recompute"] / ms["explicit"], 3),
            "max_abs_grad_diff": worst,
            "runs": a.runs,
            **cpu_context(),
        },
        a.json,
    )


if __name__ == "__main__":
    main()
