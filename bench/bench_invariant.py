"""Forward tokens/s of the normal vs the layout-invariant mode (docs/spec.md section 12) on the cpu backend,
in the same run, interleaved: tiny and a wider config (hidden 1024, 8 heads), median of N, printed as a
ratio; idle, then (--load) with a process this script starts spinning one core. Beside it, the GEMM
throughput the mode's cost rests on: an fp32 GEMM, torch._int_mm (int8 x int8 -> int32) and the mode's
exact product by its fp64 engine (one certified fp64 GEMM up to K = 4096, two above) and, where the CPU
has int8 dot products, its int8 engine (16 int8 digit products as 7 level GEMMs), same shapes.

    python bench/bench_invariant.py [--repeats 5] [--tokens 256] [--load]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import statistics
import time

import torch

from backends.invariant import gemm as invariant_gemm
from backends.invariant.engine import exact_matmul
from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.parallel.invariant import layout_invariant

#: tiny widened; built by from_preset (validated, the derived fields re-derived), not set on a built config
WIDE = dict(
    hidden_size=1024,
    num_attention_heads=8,
    num_key_value_heads=8,
    intermediate_size=2048,
    q_lora_rank=256,
    kv_lora_rank=128,
    moe_intermediate_size=256,
)


def _seconds(model, ids, invariant: bool) -> tuple[float, float]:
    """(wall, process CPU) seconds of one forward: the CPU time hardly moves with the machine's load."""
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad(), layout_invariant(model.backend) if invariant else contextlib.nullcontext():
        model(ids)
    return time.perf_counter() - wall, time.process_time() - cpu


def _medians(model, ids, repeats: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """Median (wall, CPU) seconds per forward, normal and invariant, the two interleaved so that a load
    that comes and goes weighs on both alike; the first pair warms up (and fills the mode's weight grids)."""
    normal, inv = [], []
    for _ in range(repeats + 1):
        normal.append(_seconds(model, ids, False))
        inv.append(_seconds(model, ids, True))

    def med(runs):
        return tuple(statistics.median(r[i] for r in runs[1:]) for i in (0, 1))

    return med(normal), med(inv)


def _spin() -> None:
    while True:
        pass


def _median_seconds(fn, repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


def _gemm_row(m: int, k: int, n: int, repeats: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(m, k, generator=g), torch.nn.Parameter(torch.randn(k, n, generator=g))
    a8 = torch.randint(-64, 65, (m, k), dtype=torch.int8, generator=g)
    w8 = torch.randint(-64, 65, (n, k), dtype=torch.int8, generator=g).T
    few = max(1, repeats // 3)  # the slow ones
    row = {
        "fp32": _median_seconds(lambda: a @ w.data, repeats),
        "fp64": _median_seconds(lambda: a.double() @ w.data.double(), few),
        "int8 _int_mm": _median_seconds(lambda: torch._int_mm(a8, w8), few),
        "exact (fp64)": _median_seconds(lambda: exact_matmul(a, w, engine="fp64"), few),
    }
    if invariant_gemm.INT8_DOT or invariant_gemm.ENGINE == "int8":  # minutes where _int_mm has no VNNI
        row["exact (int8)"] = _median_seconds(lambda: exact_matmul(a, w, engine="int8"), few)
    return row


def gemms(repeats: int) -> None:
    """G(FL)OP/s of one [M, K] x [K, N] product: fp32, int8 (torch._int_mm), and the mode's exact product
    by each engine (the weight side cached, as in a forward); in brackets the time against fp32's."""
    for m, k, n in ((256, 1024, 2048), (256, 6144, 1024)):
        row = _gemm_row(m, k, n, repeats)
        flops = 2 * m * k * n
        print(
            f"gemm [{m}, {k}] x [{k}, {n}]: "
            + ", ".join(
                f"{name} {flops / sec / 1e9:.1f} G/s ({sec / row['fp32']:.2f}x)" for name, sec in row.items()
            )
        )


def forwards(args) -> None:
    for name, overrides in (("tiny", {}), ("wide", WIDE)):
        cfg = GLM5Config.from_preset("tiny", **overrides)
        model = GLM5ForCausalLM(cfg, backend="cpu")
        ids = torch.randint(0, cfg.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
        (normal, normal_cpu), (inv, inv_cpu) = _medians(model, ids, args.repeats)
        n = ids.numel()
        print(
            f"{name}: normal {n / normal:.0f} tok/s, invariant {n / inv:.0f} tok/s, cost {inv / normal:.2f}x "
            f"(CPU time: {inv_cpu / normal_cpu:.2f}x)"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--load", action="store_true", help="then again with a process spinning one core")
    args = ap.parse_args()
    cpu = torch.device("cpu")
    print(
        f"threads {torch.get_num_threads()}, exact GEMM engine: {invariant_gemm.engine_for(cpu, 1024)} at "
        f"K = 1024, {invariant_gemm.engine_for(cpu, 6144)} at K = 6144 (int8 dot products: "
        f"{'yes' if invariant_gemm.INT8_DOT else 'no'})"
    )
    gemms(args.repeats)
    print("idle:")
    forwards(args)
    if args.load:
        spinner = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
        spinner.start()
        try:
            print("loaded (one process spinning a core):")
            forwards(args)
        finally:
            spinner.terminate()
            spinner.join()


if __name__ == "__main__":
    main()
