"""Compile every Triton kernel launch of the cuda backend for sm_90 (H100 / H200), on a machine with no GPU.

Triton's interpreter runs a kernel's Python body, so it accepts code that its compiler refuses: a module-level
`int` read inside `@triton.jit` code, a type the code generator cannot lower, a block shape that is not a
power of two. The first device run of this project found three such kernels (topk, indexer_topk, the FP8
quantizer) only on the GPU. This script finds them here:

1. record: run the cuda backend's conformance suite (`--suite smoke` by default) under `TRITON_INTERPRET=1`,
   recording each launch: the kernel, the argument types (a tensor's dtype, a scalar's width) and the
   `tl.constexpr` values, with the launch options (num_warps, num_stages);
2. compile: in a fresh process without the interpreter, `triton.compile` every distinct launch for
   `GPUTarget("cuda", 90, 32)` down to a cubin (Triton's wheel carries ptxas; no driver is needed).

Exit status 1 if any launch fails to compile, with the kernel, its arguments and the compiler's message.

    python bench/gpu/compile_sm90.py                 # smoke suite, every op
    python bench/gpu/compile_sm90.py --suite quick   # the suite bench/gpu/run.sh runs on the device
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_TENSOR_TYPES = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "float64": "fp64",
    "int8": "i8",
    "uint8": "u8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "bool": "i1",
    "float8_e4m3fn": "fp8e4nv",
    "float8_e5m2": "fp8e5",
}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _arg_type(value) -> str | None:
    """Triton's signature type of a runtime (non-constexpr) argument, None if it is not one we can name."""
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        name = str(value.dtype).removeprefix("torch.")
        return "*" + _TENSOR_TYPES[name] if name in _TENSOR_TYPES else None
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def _constexpr_value(value):
    """A constexpr as JSON: plain values as they are, a Triton dtype as {"dtype": name}."""
    import triton.language as tl

    value = getattr(value, "value", value)  # a tl.constexpr: its plain value
    if isinstance(value, tl.dtype):
        return {"dtype": value.name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"constexpr of type {type(value).__name__} cannot be recorded")


def _constexpr_from_json(value):
    import triton.language as tl

    return tl.dtype(value["dtype"]) if isinstance(value, dict) else value


def record(suite: str, out: Path) -> int:
    """Run the cuda conformance suite interpreted, writing one JSON line per distinct launch to `out`."""
    os.environ["TRITON_INTERPRET"] = "1"
    import inspect

    from triton.runtime import interpreter

    seen: set[str] = set()
    sink = out.open("w")
    original = interpreter.GridExecutor.__call__

    def recording_call(self, *args, **kwargs):
        fn = self.fn
        params = list(inspect.signature(fn).parameters)
        bound = dict(zip(params, args, strict=False))
        bound.update({k: v for k, v in kwargs.items() if k in params})
        signature, constexprs, unknown = {}, {}, []
        for name in params:
            value = bound.get(name)
            if name in self.constexprs or value is None:
                signature[name] = "constexpr"
                constexprs[name] = _constexpr_value(value)
            else:
                ty = _arg_type(value)
                if ty is None:
                    unknown.append(f"{name}: {type(value).__name__}")
                signature[name] = ty or "unknown"
        entry = {
            "module": fn.__module__,
            "kernel": fn.__name__,
            "signature": signature,
            "constexprs": constexprs,
            "options": {k: kwargs[k] for k in _OPTIONS if k in kwargs},
            "unknown": unknown,
        }
        key = json.dumps(entry, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            sink.write(key + "\n")
            sink.flush()
        return original(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = recording_call
    from glm5.cli import main

    try:
        main(["conformance", "--backend", "cuda", "--suite", suite], standalone_mode=False)
    except SystemExit as e:  # a failing case is not this script's business: the launches are recorded
        if e.code not in (0, 1, None):
            raise
    finally:
        sink.close()
    return len(seen)


def _resolve(module: str, name: str):
    import importlib

    obj = getattr(importlib.import_module(module), name)
    while not hasattr(obj, "arg_names"):  # an Autotuner / Heuristics wrapper: the JITFunction inside
        obj = obj.fn
    return obj


def compile_all(launches: Path) -> int:
    """Compile each recorded launch for sm_90; print failures; return their count."""
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    entries = [json.loads(line) for line in launches.read_text().splitlines() if line.strip()]
    failures = 0
    t0 = time.perf_counter()
    for i, e in enumerate(entries, 1):
        what = f"{e['module']}.{e['kernel']} {e['constexprs']} {e['options']}"
        if e["unknown"]:
            print(f"[{i}/{len(entries)}] SKIP {what}: arguments of unknown type {e['unknown']}")
            continue
        try:
            fn = _resolve(e["module"], e["kernel"])
            constexprs = {k: _constexpr_from_json(v) for k, v in e["constexprs"].items()}
            src = ASTSource(fn, e["signature"], constexprs=constexprs)
            kernel = triton.compile(src, target=target, options=e["options"])
            assert "cubin" in kernel.asm, "no cubin produced"
            status = f"ok ({kernel.metadata.shared} B shared)"
        except Exception as exc:  # every compiler error is a finding: report it and go on
            failures += 1
            message = " ".join(str(exc).split())[:600]
            status = f"FAILED: {type(exc).__name__}: {message}"
        print(f"[{i}/{len(entries)}] {what}: {status}", flush=True)
    print(
        f"{len(entries)} distinct launches compiled for sm_90 in {time.perf_counter() - t0:.0f} s: "
        f"{failures} failed"
    )
    return failures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="smoke", choices=["smoke", "quick", "full"])
    ap.add_argument("--launches", type=Path, help="keep the recorded launches (JSON lines) here")
    ap.add_argument("--record-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.record_only:
        print(f"{record(args.suite, args.launches)} distinct launches recorded", file=sys.stderr)
        return
    if args.compile_only:
        sys.exit(1 if compile_all(args.launches) else 0)
    with tempfile.TemporaryDirectory() as tmp:
        launches = args.launches or Path(tmp) / "launches.jsonl"
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        step = [sys.executable, __file__, "--suite", args.suite, "--launches", str(launches)]
        subprocess.run([*step, "--record-only"], env={**env, "TRITON_INTERPRET": "1"}, check=True)
        env.pop("TRITON_INTERPRET", None)
        sys.exit(subprocess.run([*step, "--compile-only"], env=env).returncode)


if __name__ == "__main__":
    main()
