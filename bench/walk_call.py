"""The walk of one op call: the Python frames between the caller's and the backend's implementation.

`walk(call, target)` runs `call()` under `sys.setprofile` and, the first time the code object `target`
is entered, records the Python frames from that frame back up to `call`'s own (the caller, not
counted): the hops are the frames below the caller down to the implementation's own (a direct call is
one hop).
Frames torch enters in C (a custom op's dispatcher) are not Python frames and are not counted; the
Python ones torch runs on the way (torch.library's wrappers) are.

    python bench/walk_call.py                       # a plain eager call and a custom-op call, per op
    python bench/walk_call.py --op topk --frames    # with the frames listed
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _where(f: FrameType) -> str:
    path = Path(f.f_code.co_filename)
    try:
        path = path.resolve().relative_to(ROOT)
    except ValueError:
        path = Path(*path.parts[-2:])
    return f"{path}:{f.f_code.co_name}"


def walk(call: Callable[[], Any], target: CodeType) -> list[str]:
    """`file:function` of each frame from `call`'s callee down to the first entry into `target` (its
    own last). The hop count is the list's length; ValueError if `target` never runs."""
    start: list[FrameType] = []
    found: list[list[str]] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if found or event != "call" or frame.f_code is not target:
            return
        chain, f = [], frame
        while f is not None and f is not start[0]:
            chain.append(_where(f))
            f = f.f_back
        if f is not None:
            found.append(chain[::-1][1:])  # the first is `call`'s own frame: the caller

    def outer() -> None:
        start.append(sys._getframe())
        call()

    sys.setprofile(profile)
    try:
        outer()
    finally:
        sys.setprofile(None)
    if not found:
        raise ValueError(f"{target.co_name} ({target.co_filename}) did not run")
    return found[0]


def implementation(backend: Any, op: str) -> CodeType:
    """The code object of what serves `op` on `backend`: the function its op table names."""
    return backend.impl(op).fn.__code__


def hops(backend: Any, op: str, args: dict[str, Any], grad: bool = False) -> list[str]:
    """The walk of `backend.<op>(**args)`: plain eager (no grad), or, with `grad`, the differentiable
    call that goes through the custom op."""
    import torch

    method = getattr(backend, op)
    with torch.set_grad_enabled(grad):
        return walk(lambda: method(**args), implementation(backend, op))


def _samples() -> dict[str, tuple[dict[str, Any], bool]]:
    import torch

    import backends

    lay = backends.SeqLayout.from_lengths([2], [5])
    return {
        "topk": ({"x": torch.randn(2, 8), "k": 3, "lengths": None}, False),
        "silu_and_mul": ({"x": torch.randn(4, 8, requires_grad=True)}, True),
        "sparse_mla_attention": (
            {
                "q": torch.randn(2, 2, 16),
                "kv_cache": torch.randn(5, 16),
                "indices": torch.arange(2, dtype=torch.int32).repeat(2, 1),
                "layout": lay,
                "sm_scale": 0.25,
                "d_v": 8,
                "return_lse": False,
            },
            False,
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="reference")
    p.add_argument("--op", default=None, help="one op of the samples (default: each)")
    p.add_argument("--frames", action="store_true", help="list the frames of each walk")
    a = p.parse_args()
    import backends

    be = backends.get(a.backend)
    for op, (args, grad_too) in _samples().items():
        if a.op and op != a.op:
            continue
        for grad in (False, True) if grad_too else (False,):
            chain = hops(be, op, args, grad)
            route = "custom op (grad)" if grad else "plain eager"
            print(f"{op:22s} {route:17s} {len(chain):3d} hops")
            if a.frames:
                for i, frame in enumerate(chain, 1):
                    print(f"    {i:2d} {frame}")


if __name__ == "__main__":
    main()
