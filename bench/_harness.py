"""Shared bits of the bench/bench_*.py scripts: device choice, timing, the result line.

On a CUDA device the scripts time compiled kernels with CUDA events; without one they need `--tiny`, which
switches Triton's interpreter on (before any kernel import) and runs tiny shapes on CPU tensors: that proves
the script runs end to end, its figures mean nothing. Without a device and without `--tiny` a script exits
0 with a "skipped" line, so `bench/gpu/run.sh` and CI can call every script unconditionally.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def parse(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--tiny", action="store_true", help="tiny shapes; without a GPU runs under TRITON_INTERPRET=1"
    )
    p.add_argument("--runs", type=int, default=None, help="timed runs per measurement (median reported)")
    p.add_argument("--json", default=None, help="append one JSON object per result to this file")
    args = p.parse_args()
    import torch

    args.cuda = torch.cuda.is_available()
    if not args.cuda:
        if not args.tiny:
            print(
                json.dumps(
                    {"bench": p.prog, "skipped": "no CUDA device (use --tiny to run interpreted on CPU)"}
                )
            )
            sys.exit(0)
        os.environ["TRITON_INTERPRET"] = "1"  # before kernels_cuda is imported
    args.device = "cuda" if args.cuda else "cpu"
    args.runs = args.runs or (10 if args.cuda else 2)
    return args


def median_ms(fn: Callable[[], Any], runs: int, cuda: bool, warmup: int = 2) -> float:
    """Median wall time of `fn` in milliseconds over `runs` runs (CUDA events on a device)."""
    import torch

    for _ in range(warmup if cuda else 1):
        fn()
    times = []
    for _ in range(runs):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def emit(record: dict[str, Any], json_path: str | None) -> None:
    """Print one result as a JSON line, and append it to `json_path` when given (--json)."""
    line = json.dumps(record)
    print(line, flush=True)
    if json_path:
        with open(json_path, "a") as f:
            f.write(line + "\n")


def report(args: argparse.Namespace, record: dict[str, Any]) -> None:
    """Print one GPU-bench result as a JSON line (and append it to --json)."""
    import torch

    record = {
        "device": torch.cuda.get_device_name() if args.cuda else "cpu (Triton interpreter)",
        "tiny": args.tiny,
        "runs": args.runs,
        **record,
    }
    emit(record, args.json)


# -- CPU benches (bench_cpu_*.py): no device, real shapes; the machine may be shared, so every result
# carries the load average next to it and baselines are timed interleaved with the measured code.


def cpu_context() -> dict[str, Any]:
    """Machine facts for a CPU result line: model, cores, torch threads, 1-minute load average."""
    import platform

    import torch

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "load1": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
    }


def interleaved_s(fns: dict[str, Callable[[], Any]], runs: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each callable over `runs` rounds, one call of each per round (so a change of
    load hits every variant alike)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def gloo_ranks(target: Callable[..., None], world: int, *args: Any) -> list[Any]:
    """target(rank, world, port, *args, queue) on `world` spawned processes, one thread each: each joins
    gloo at 127.0.0.1:port itself and puts (rank, result) on the queue. Returns the results in rank order."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["OMP_NUM_THREADS"] = "1"
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in range(world))
    for p in procs:
        p.join()
    return [results[r] for r in range(world)]
