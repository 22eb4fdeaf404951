"""The cost of the front door, and a decode step eager vs `torch.compile`, measured in one run.

1. Per op at decode shapes (GLM-5 per-layer shapes for one token of 8 requests, the latent cache at
   4K context): median microseconds of `backend.<op>(...)` (validation, capabilities, the custom op)
   against the raw implementation `backend.ops[op].fn(...)` on the same inputs, and the difference.
   The backend is a no-op one (its ops return preallocated outputs), so the figure is the front door
   alone, not the op; `--backend NAME` times a real backend's ops instead.
2. One decode step of the tiny model (batch 8, 64 tokens of context, paged cache) on the reference
   backend: eager vs `torch.compile(fullgraph=True)` (inductor), medians over --runs steps.

    python bench/bench_dispatch.py [--runs 200] [--steps 20] [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _median_us(fn, runs: int) -> float:
    for _ in range(5):
        fn()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def _decode_args(torch, backends):
    """Per-op arguments of one decode step: 8 requests, 1 token each, 4K context, GLM-5 layer shapes."""
    from backends.reference.w4a8_matmul import pack_int4

    b, ctx = 8, 4096
    lay = backends.SeqLayout.from_lengths([1] * b, [ctx] * b, block_size=64)
    nb = b * ctx // 64
    r = torch.randn
    i8 = lambda *s: torch.randint(-127, 128, s, dtype=torch.int8)  # noqa: E731
    return {
        "indexer_topk": dict(
            q=r(b, 32, 128), k_cache=r(nb, 64, 128), weights=r(b, 32), layout=lay, topk=2048
        ),
        "topk": dict(x=r(b, 256), k=8, lengths=None),
        "sparse_mla_attention": dict(
            q=r(b, 64, 576),
            kv_cache=r(nb, 64, 576),
            indices=torch.zeros(b, 2048, dtype=torch.int32),
            layout=lay,
            sm_scale=0.04,
            d_v=512,
            return_lse=False,
        ),
        "dynamic_quant_int8": dict(x=r(b, 6144)),
        "w8a8_matmul": dict(
            x_q=i8(b, 6144),
            x_scale=r(b),
            w_q=i8(2048, 6144),
            w_scale=r(2048),
            bias=None,
            out_dtype=torch.bfloat16,
        ),
        "w4a8_matmul": dict(
            x_q=i8(b, 6144),
            x_scale=r(b),
            w_packed=pack_int4(torch.zeros(256, 6144)),
            w_scale=r(256, 1),
            group_size=6144,
            bias=None,
            out_dtype=torch.bfloat16,
        ),
        "grouped_matmul": dict(
            x=i8(64, 6144),
            w=i8(8, 256, 6144),
            group_offsets=torch.arange(0, 72, 8),
            x_scale=r(64),
            w_scale=r(8, 256),
            group_size=None,
            out_dtype=torch.bfloat16,
        ),
    }


def _noop_backend(torch, args_by_op):
    """A backend whose every op returns a preallocated output: the front door is all that is timed."""
    import backends
    from backends import Backend
    from backends.caps import OpCaps, OpImpl
    from backends.contract.ops import FLOATS

    ref = backends.get("reference")
    with torch.no_grad():
        outputs = {
            op: getattr(ref, op)(**a) for op, a in args_by_op.items() if op in ("topk", "dynamic_quant_int8")
        }
    for op, a in args_by_op.items():
        if op not in outputs:
            outputs[op] = _fake_output(torch, op, a)

    def make(op):
        return lambda **kw: outputs[op]

    caps = OpCaps(FLOATS + ("w8a8", "w4a8"), ("ragged", "paged"))

    class NoOp(Backend):
        name = "noop"
        ops = {op: OpImpl(make(op), caps) for op in args_by_op}

    return NoOp()


def _fake_output(torch, op, a):
    if op == "indexer_topk":
        return torch.zeros(a["q"].shape[0], a["topk"], dtype=torch.int32)
    if op == "sparse_mla_attention":
        return torch.zeros(a["q"].shape[0], a["q"].shape[1], a["d_v"]), None
    if op == "grouped_matmul":
        return torch.zeros(a["x"].shape[0], a["w"].shape[1], dtype=a["out_dtype"])
    w = a.get("w_q", a.get("w_packed"))
    return torch.zeros(a["x_q"].shape[0], w.shape[0], dtype=a["out_dtype"])


def front_door(torch, backends, runs: int, name: str | None) -> list[dict]:
    args_by_op = _decode_args(torch, backends)
    if "return_lse" not in inspect.signature(backends.Backend.sparse_mla_attention).parameters:
        args_by_op["sparse_mla_attention"].pop("return_lse")  # an older front door, for a before/after
    be = backends.get(name) if name else _noop_backend(torch, args_by_op)
    rows = []
    with torch.no_grad():
        for op, a in args_by_op.items():
            if op not in be.ops or be.reasons(op, a):
                continue
            door = _median_us(lambda op=op, a=a: getattr(be, op)(**a), runs)
            raw = _median_us(lambda op=op, a=a: be.ops[op].fn(**a), runs)
            rows.append(
                {
                    "op": op,
                    "backend": be.name,
                    "front_door_us": round(door, 1),
                    "raw_us": round(raw, 1),
                    "overhead_us": round(door - raw, 1),
                }
            )
    return rows


def decode_step(torch, steps: int) -> dict:
    from glm5.core.config import GLM5Config
    from glm5.core.model import GLM5ForCausalLM

    cfg = GLM5Config.from_preset("tiny")
    model = GLM5ForCausalLM(cfg, "reference").eval()
    out = {}
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        fn = torch.compile(model, fullgraph=True) if mode == "compiled" else model
        cache = model.new_cache(8, 64 + 2 * steps + 8, block_size=16)
        ids = torch.randint(0, cfg.vocab_size, (8, 64))
        with torch.no_grad():
            model(ids, cache)
            tok = ids[:, -1:]
            for _ in range(3):  # warm-up (compilation, recompiles for dynamic lengths)
                tok = fn(tok, cache).logits[:, -1:].argmax(-1)
            ts = []
            for _ in range(steps):
                t0 = time.perf_counter()
                tok = fn(tok, cache).logits[:, -1:].argmax(-1)
                ts.append(time.perf_counter() - t0)
        out[f"{mode}_ms"] = round(statistics.median(ts) * 1e3, 3)
    out["compiled_speedup"] = round(out["eager_ms"] / out["compiled_ms"], 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=200, help="timed calls per op (median)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per mode (median)")
    p.add_argument("--backend", default=None, help="time a real backend's ops instead of the no-op one")
    p.add_argument("--skip-compile", action="store_true", help="only the per-op front-door figures")
    p.add_argument("--json", default=None, help="append one JSON object per result to this file")
    args = p.parse_args()
    import torch

    import backends

    results = front_door(torch, backends, args.runs, args.backend)
    if not args.skip_compile:
        results.append({"decode_step_tiny_batch8": decode_step(torch, args.steps)})
    for r in results:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
