"""Every global a Triton kernel reads is one the compiler accepts.

Triton's interpreter runs a kernel's Python body, so a module-level `int` or `float` read inside `@triton.jit`
code works there and fails to compile on a GPU ("Cannot access global variable ... from within @jit'ed
function"): the first device run found three kernels that did (topk, indexer_topk, the FP8 quantizer). The
compiler accepts a global that is a `tl.constexpr`, another jitted function, a module or a dtype; this
test reads each kernel's source and checks the names it loads. `bench/gpu/compile_sm90.py` goes further (it
compiles every launch of the smoke suite for sm_90) but takes minutes.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import kernels_cuda  # noqa: E402


def _jitted(obj):
    """The Python function of a jitted (or interpreted) Triton function, else None."""
    fn = getattr(obj, "fn", None)
    if isinstance(fn, types.FunctionType) and type(obj).__name__ in ("JITFunction", "InterpretedFunction"):
        return fn
    return None


def _kernels():
    for info in pkgutil.iter_modules(kernels_cuda.__path__):
        module = importlib.import_module(f"kernels_cuda.{info.name}")
        for name, obj in vars(module).items():
            fn = _jitted(obj)
            if fn is not None and fn.__module__ == module.__name__:
                yield f"{module.__name__}.{name}", fn


def _local_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _accepted(value) -> bool:
    return (
        isinstance(value, (tl.constexpr, tl.dtype, types.ModuleType, type))
        or _jitted(value) is not None
        or callable(value)  # builtins and triton's own functions (min, range, tl.* re-exported)
    )


KERNELS = dict(_kernels())


def test_the_kernel_modules_define_jitted_functions():
    assert len(KERNELS) > 20


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_globals_read_by_a_kernel_are_compile_time_constants(name):
    fn = KERNELS[name]
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    local = _local_names(tree)
    bad = sorted(
        {
            node.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Name)
            and isinstance(node.ctx, ast.Load)
            and node.id not in local
            and node.id in fn.__globals__
            and not _accepted(fn.__globals__[node.id])
        }
    )
    assert not bad, (
        f"{name} reads module globals that Triton's compiler refuses (wrap them in tl.constexpr): {bad}"
    )


def test_the_check_catches_a_plain_int_global():
    fn = KERNELS["kernels_cuda.topk._topk_kernel"]
    assert isinstance(fn.__globals__["NO_THRESHOLD"], tl.constexpr)
    assert not _accepted(-(2**32)) and _accepted(tl.constexpr(-(2**32)))
