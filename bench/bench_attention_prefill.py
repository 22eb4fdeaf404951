"""Attention-layer prefill on CPU with GLM-5's attention shapes (issue 5), three ways in one run:

  (a) dsa    our path: indexer_topk (lightning indexer + deterministic top-k) + sparse_mla_attention,
             through the backend interface (absorbed MLA: one 576-wide latent row per key);
  (b) sdpa   dense causal attention, torch scaled_dot_product_attention(is_causal=True) with the
             memory-efficient (flash) CPU kernel, same absorbed shapes (K = V = the latent row);
  (c) eager  dense attention with a materialised [S, S] additive mask, as Hugging Face eager does.

Time is the median of --repeats runs; peak memory is the rise of the process's peak RSS over the
inputs (VmHWM, reset through /proc/self/clear_refs before each run). Heads are reduced to fit a
small CPU (default H=2, H_I=1, keeping GLM-5's 64:32 ratio): dense and sparse attention FLOPs scale
with H and indexer FLOPs with H_I, so the FLOP-model speed-up (3.4x at 16K, 5.6x at 32K for H=64)
is unchanged. (c) is skipped, and said so, where its [H, S, S] buffers exceed --eager-max-gib.

    python bench/bench_attention_prefill.py --seqlens 4096,8192,16384,32768

Chunked prefill (issue 14): `--queries T` keeps only the last T queries of the request (S keys each way
as before, right-down causal: query i sees keys <= S - T + i). SDPA then takes that causal mask as an
explicit [T, S] boolean (its is_causal is top-left aligned), a row `indexer` times indexer_topk alone
with its peak memory, and the ideal is the FLOP model over the causal pairs of those T queries: indexer
2*H_I*D_I per causal pair plus 2*H*(d_qk+d_v) per selected pair, against 2*H*(d_qk+d_v) per causal pair.

    python bench/bench_attention_prefill.py --backend cpu --heads 64 --index-heads 32 --queries 512 \
        --seqlens 8192,16384,32768,65536 --eager-max-gib 0
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

import backends
from backends import SeqLayout

C, R, D_I = 512, 64, 128  # kv_lora_rank, qk_rope_head_dim, index_head_dim (GLM-5)
SM_SCALE = (192 + 64) ** -0.5  # GLM-5: (qk_nope + qk_rope) ** -0.5


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024  # MiB
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_peak() -> float:
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def inputs(s: int, h: int, h_i: int, seed: int = 0, t: int | None = None) -> dict[str, torch.Tensor]:
    """S keys; the last t (default all S) queries."""
    g = torch.Generator().manual_seed(seed)
    t = s if t is None else t
    return {
        "q": torch.randn(t, h, C + R, generator=g) * 0.1,
        "kv": torch.randn(s, C + R, generator=g) * 0.1,
        "q_i": torch.randn(t, h_i, D_I, generator=g),
        "k_i": torch.randn(s, D_I, generator=g),
        "w": torch.randn(t, h_i, generator=g) * (h_i**-0.5 * D_I**-0.5),
    }


def _layout(x: dict) -> SeqLayout:
    return SeqLayout.from_lengths([x["q"].shape[0]], [x["kv"].shape[0]])


def run_indexer(x: dict, be, topk: int) -> torch.Tensor:
    return be.indexer_topk(x["q_i"], x["k_i"], x["w"], _layout(x), topk)


def run_dsa(x: dict, be, topk: int) -> torch.Tensor:
    layout = _layout(x)
    idx = be.indexer_topk(x["q_i"], x["k_i"], x["w"], layout, topk)
    return be.sparse_mla_attention(x["q"], x["kv"], idx, layout, SM_SCALE, C)[0]


def run_sdpa(x: dict) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    t, s = x["q"].shape[0], x["kv"].shape[0]
    q = x["q"].transpose(0, 1)[None]  # [1, H, T, 576]
    kv = x["kv"][None, None]  # [1, 1, S, 576]: one latent head shared (MQA)
    # right-down causality; for T == S that is is_causal (top-left and right-down coincide)
    mask = None if t == s else torch.ones(t, s, dtype=torch.bool).tril_(s - t)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # V = the whole row; its first C columns are the value
        o = torch.nn.functional.scaled_dot_product_attention(
            q, kv, kv, attn_mask=mask, is_causal=mask is None, scale=SM_SCALE, enable_gqa=True
        )
    return o[0, :, :, :C].transpose(0, 1)


def ideal_speedup(s: int, t: int, h: int, h_i: int, topk: int) -> float:
    """FLOP model: dense attention over the causal pairs of the last t queries vs indexer + sparse."""
    visible = torch.arange(s - t + 1, s + 1, dtype=torch.float64)
    pairs, selected = float(visible.sum()), float(visible.clamp(max=topk).sum())
    per_pair = 2 * h * (C + R + C)
    return pairs * per_pair / (pairs * 2 * h_i * D_I + selected * per_pair)


def run_eager(x: dict) -> torch.Tensor:
    s = x["q"].shape[0]
    q = x["q"].transpose(0, 1)  # [H, S, 576]
    mask = torch.full((s, s), float("-inf")).triu_(1)  # materialised [S, S], as HF eager builds it
    scores = torch.matmul(q, x["kv"].T) * SM_SCALE + mask
    p = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return torch.matmul(p, x["kv"][:, :C]).transpose(0, 1)


def measure(fn, repeats: int) -> tuple[float, float, torch.Tensor]:
    times, peaks, out = [], [], None
    for _ in range(repeats):
        out = None
        base = _reset_peak()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        peaks.append(_status("VmHWM") - base)
    return statistics.median(times), max(peaks), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", default="4096,8192,16384,32768")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--index-heads", type=int, default=1)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=None, help="only the last T queries (chunked prefill)")
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--eager-max-gib", type=float, default=8.0)
    ap.add_argument("--json", default=None, help="also write the rows here")
    a = ap.parse_args()
    be = backends.get(a.backend)
    print(
        f"backend={be.name} H={a.heads} H_I={a.index_heads} topk={a.topk} threads={torch.get_num_threads()} "
        f"(GLM-5: H=64, H_I=32; heads reduced for CPU)",
        flush=True,
    )
    print(
        f"{'S':>6} {'variant':>6} {'time_s':>9} {'peak_MiB':>9} {'vs sdpa':>8} {'ideal':>6} "
        f"{'max|d| vs sdpa':>15}"
    )
    rows: list[dict] = []
    for s in (int(v) for v in a.seqlens.split(",")):
        t = s if a.queries is None else min(a.queries, s)
        x = inputs(s, a.heads, a.index_heads, t=t)
        ideal = ideal_speedup(s, t, a.heads, a.index_heads, a.topk)
        eager_gib = 3 * a.heads * t * s * 4 / 2**30
        runs = {
            "sdpa": lambda x=x: run_sdpa(x),
            "dsa": lambda x=x: run_dsa(x, be, a.topk),
            "eager": (lambda x=x: run_eager(x)) if eager_gib <= a.eager_max_gib and t == s else None,
        }
        if a.queries is not None:
            runs["indexer"] = lambda x=x: run_indexer(x, be, a.topk)
        base = None
        for name, fn in runs.items():  # one row at a time: a run cut by `timeout` keeps what it printed
            if fn is None:
                print(
                    f"{s:>6} {name:>6}  skipped: ~{eager_gib:.1f} GiB of [H, S, S] buffers > --eager-max-gib"
                )
                rows.append({"S": s, "variant": name, "skipped": f"needs ~{eager_gib:.1f} GiB"})
                continue
            secs, peak, out = measure(fn, a.repeats)
            base = base or (secs, out)
            diff = float((out - base[1]).abs().max()) if out.dtype.is_floating_point else float("nan")
            speed = base[0] / secs
            print(
                f"{s:>6} {name:>6} {secs:>9.3f} {peak:>9.1f} {speed:>7.2f}x "
                f"{ideal if name == 'dsa' else 1:>5.1f}x {diff:>15.3g}"
                + (f"   {speed / ideal:.2f} of ideal" if name == "dsa" else ""),
                flush=True,
            )
            row = {
                "S": s,
                "T": t,
                "variant": name,
                "time_s": secs,
                "peak_mib": peak,
                "speedup_vs_sdpa": speed,
                "ideal_flop_speedup": ideal,
                "max_abs_diff_vs_sdpa": diff,
                "heads": a.heads,
                "index_heads": a.index_heads,
                "topk": a.topk,
                "backend": be.name,
            }
            rows.append(row)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(rows, f, indent=2)
            del out
        del x, base
        gc.collect()


if __name__ == "__main__":
    main()
