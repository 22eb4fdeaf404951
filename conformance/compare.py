"""Comparators, one per kind of output (SPEC 4).

Each returns a `Check`: pass/fail, metrics (max abs/rel error with its index, mismatch count, the
global metric) and the worst elements (index, actual, expected, allowed tolerance). Tolerances start
from the dtype tables below; a case may tighten or loosen them, and a backend loosens them only in its
expectations manifest, with a reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

WORST = 5

#: PyTorch's assert_close defaults (SPEC 4).
DEFAULT_TOL = {"float32": (1.3e-6, 1e-5), "bfloat16": (1.6e-2, 1e-5), "float16": (1e-3, 1e-5)}  # (rtol, atol)
#: FlashMLA's output numbers (bf16 as SPEC 4). fp16: rtol scaled by the mantissa (3 ulp), atol half of
#: bf16's, since a kernel that rounds P to fp16 for the PV product errs by ~sqrt(topk) * 2^-12 * |V|.
ATTENTION_TOL = {"bfloat16": (3 / 128, 8e-4), "float16": (3 / 1024, 4e-4), "float32": (3e-5, 1e-5)}
#: Gradients pass through two GEMMs and a softmax backward in the input dtype (xformers allows far more).
GRAD_TOL = {"float32": (1e-4, 1e-5), "bfloat16": (5e-2, 5e-3), "float16": (1e-2, 1e-3)}
#: fp32 results of fp32-accumulated reductions whose order a backend may choose.
REDUCTION_TOL = (2e-5, 1e-5)
_PRECISION = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11, torch.float64: 53}


@dataclass
class Check:
    output: str
    ok: bool
    message: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    worst: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Context:
    """What a comparator may need besides the two tensors: the case's CPU inputs, the op's dtype-axis
    value, the backend's declared tie rule, and a way to evaluate reference ops (weak top-k contract)."""

    op: str
    dtype: str
    args: Mapping[str, Any]
    tie_rule: str | None = None
    reference: Any = None


def _index(flat: int, shape: torch.Size) -> list[int]:
    out = []
    for s in reversed(shape):
        out.append(flat % s if s else 0)
        flat = flat // s if s else 0
    return list(reversed(out))


def _scalar(t: torch.Tensor) -> Any:
    v = t.item()
    return v if not isinstance(v, float) else float(v)


def _worst(
    a: torch.Tensor, r: torch.Tensor, excess: torch.Tensor, allowed: torch.Tensor | None
) -> list[dict]:
    """Elements with the largest excess over the allowed error (excess > 0 are failures)."""
    flat = excess.reshape(-1)
    if flat.numel() == 0:
        return []
    k = min(WORST, flat.numel())
    vals, idx = torch.topk(flat.nan_to_num(float("inf")), k)
    out = []
    for v, i in zip(vals.tolist(), idx.tolist(), strict=True):
        if v <= 0:
            break
        out.append(
            {
                "index": _index(i, a.shape),
                "actual": _scalar(a.reshape(-1)[i]),
                "expected": _scalar(r.reshape(-1)[i]),
                "allowed": None if allowed is None else _scalar(allowed.reshape(-1)[i]),
            }
        )
    return out


def _header(name: str, a: Any, r: torch.Tensor, dtype_must_match: bool = True) -> Check | None:
    if not isinstance(a, torch.Tensor):
        return Check(name, False, f"{name}: expected a tensor, got {type(a).__name__}")
    if tuple(a.shape) != tuple(r.shape):
        return Check(name, False, f"{name}: shape {tuple(a.shape)} != expected {tuple(r.shape)}")
    if dtype_must_match and a.dtype != r.dtype:
        return Check(name, False, f"{name}: dtype {a.dtype} != expected {r.dtype}")
    return None


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of a tensor (NaN == NaN, -0.0 != +0.0): what "bitwise" means here."""
    t = t.detach().cpu().contiguous()
    if t.dtype.is_floating_point:
        return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])
    return t


def bitwise(name: str, a: tuple, b: tuple) -> Check:
    """Two runs' outputs bit for bit (run-to-run, batch invariance, inputs left unchanged)."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x is None and y is None:  # an output neither run was asked for (return_lse=False)
            continue
        tensors = isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        if not tensors or x.shape != y.shape or x.dtype != y.dtype:
            return Check(name, False, f"{name}: output {i} differs in type/shape/dtype")
        n = int((bits(x) != bits(y)).sum())
        if n:
            return Check(
                name,
                False,
                f"{name}: output {i} differs bitwise at {n} / {x.numel()} elements",
                {"mismatches": n},
            )
    return Check(name, True)


def exact(name: str, a: Any, r: torch.Tensor, ctx: Context, **_: float) -> Check:
    """Bitwise equality (indices, int8, int32 parts, anything with a bitwise contract)."""
    bad = _header(name, a, r)
    if bad:
        return bad
    diff = bits(a) != bits(r)
    n = int(diff.sum())
    worst = []
    for i in torch.nonzero(diff.reshape(-1))[:WORST, 0].tolist():
        worst.append(
            {
                "index": _index(i, r.shape),
                "actual": _scalar(a.detach().cpu().reshape(-1)[i]),
                "expected": _scalar(r.reshape(-1)[i]),
                "allowed": "exact",
            }
        )
    msg = "" if n == 0 else f"{name}: {n} / {r.numel()} elements differ (exact comparison)"
    return Check(name, n == 0, msg, {"mismatches": n, "numel": r.numel()}, worst)


def calc_diff(a: torch.Tensor, r: torch.Tensor) -> float:
    """DeepGEMM/FlashMLA global metric 1 - 2*sum(a*r)/sum(a*a + r*r), float64; 0 when identical."""
    a, r = a.double(), r.double()
    den = (a * a + r * r).sum()
    return 0.0 if float(den) == 0 else float(1 - 2 * (a * r).sum() / den)


def close(
    name: str,
    a: Any,
    r: torch.Tensor,
    ctx: Context,
    *,
    rtol: float,
    atol: float,
    mode: str = "sum",
    global_max: float | None = None,
    **_: float,
) -> Check:
    """Non-finite positions identical (NaN, +inf, -inf); then per element |a - r| <= atol + rtol*|r|
    (mode "sum", PyTorch) or <= atol OR <= rtol*(|r| + 1e-6) (mode "or", FlashMLA); then the global
    calc_diff <= global_max when given."""
    bad = _header(name, a, r)
    if bad:
        return bad
    a64, r64 = a.detach().cpu().double(), r.detach().cpu().double()
    metrics: dict[str, Any] = {"numel": r.numel()}
    for what, fn in (
        ("NaN", torch.isnan),
        ("+inf", lambda t: t == float("inf")),
        ("-inf", lambda t: t == float("-inf")),
    ):
        ma, mr = fn(a64), fn(r64)
        if not torch.equal(ma, mr):
            where = torch.nonzero((ma != mr).reshape(-1))[:WORST, 0].tolist()
            worst = [
                {
                    "index": _index(i, r.shape),
                    "actual": _scalar(a64.reshape(-1)[i]),
                    "expected": _scalar(r64.reshape(-1)[i]),
                    "allowed": f"same {what} positions",
                }
                for i in where
            ]
            n = int((ma != mr).sum())
            return Check(
                name,
                False,
                f"{name}: {what} positions differ at {n} elements",
                metrics | {"mismatches": n},
                worst,
            )
    fin = torch.isfinite(r64)
    a0, r0 = torch.where(fin, a64, 0.0), torch.where(fin, r64, 0.0)
    err = (a0 - r0).abs()
    rel = err / (r0.abs() + 1e-6)
    if mode == "or":
        allowed = torch.maximum(torch.full_like(r0, atol), rtol * (r0.abs() + 1e-6))
    else:
        allowed = atol + rtol * r0.abs()
    excess = err - allowed
    n_bad = int((excess > 0).sum())
    g = calc_diff(a0, r0)
    if r.numel():
        metrics |= {
            "max_abs_err": float(err.max()),
            "max_abs_index": _index(int(err.argmax()), r.shape),
            "max_rel_err": float(rel.max()),
            "max_rel_index": _index(int(rel.argmax()), r.shape),
        }
    metrics |= {"mismatches": n_bad, "global": g, "rtol": rtol, "atol": atol}
    msgs = []
    if n_bad:
        msgs.append(
            f"{name}: {n_bad} / {r.numel()} elements outside atol={atol:g} "
            f"{'or' if mode == 'or' else '+'} rtol={rtol:g}"
        )
    if global_max is not None:
        metrics["global_max"] = global_max
        if g > global_max:
            msgs.append(f"{name}: global 1-2*sum(a*r)/sum(a*a+r*r) = {g:.3g} > {global_max:g}")
    return Check(name, not msgs, "; ".join(msgs), metrics, _worst(a64, r64, excess, allowed))


def ulp_of(r: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` at each |r| (float64; subnormal spacing near zero)."""
    p = _PRECISION[dtype]
    _, e = torch.frexp(r.double().abs())
    tiny_exp = {torch.float32: -126, torch.bfloat16: -126, torch.float16: -14, torch.float64: -1022}[dtype]
    return torch.ldexp(torch.ones_like(r, dtype=torch.float64), (e - p).clamp_min(tiny_exp - p + 1))


def ulp(name: str, a: Any, r: torch.Tensor, ctx: Context, *, ulps: float = 1.0, **_: float) -> Check:
    """Within `ulps` units in the last place of the output dtype (W8A8/W4A8 epilogues, SPEC 4)."""
    bad = _header(name, a, r)
    if bad:
        return bad
    allowed_t = ulps * ulp_of(r.detach().cpu(), r.dtype)
    res = close(name, a, r, ctx, rtol=0.0, atol=0.0)
    if not res.ok and "positions differ" in res.message:
        return res
    a64, r64 = a.detach().cpu().double(), r.detach().cpu().double()
    fin = torch.isfinite(r64)
    err = torch.where(fin, (a64 - r64).abs(), 0.0)
    excess = torch.where(fin, err - allowed_t, 0.0)
    n_bad = int((excess > 0).sum())
    metrics = res.metrics | {"mismatches": n_bad, "ulps": ulps}
    if r.numel():
        metrics["max_ulp_err"] = float((err / allowed_t * ulps).max())
    msg = f"{name}: {n_bad} / {r.numel()} elements more than {ulps:g} ulp of {r.dtype} away" if n_bad else ""
    return Check(name, n_bad == 0, msg, metrics, _worst(a64, r64, excess, allowed_t))


def by_dtype(table: Mapping[str, tuple[float, float]], mode: str = "sum", global_max: float | None = None):
    """A `close` comparator whose (rtol, atol) come from `table[ctx.dtype]`."""

    def cmp(name, a, r, ctx, **params):
        rtol, atol = table.get(ctx.dtype, table.get("float32"))
        kw = {"rtol": rtol, "atol": atol, "mode": mode, "global_max": global_max} | params
        return close(name, a, r, ctx, **kw)

    return cmp


def reduction(name, a, r, ctx, **params) -> Check:
    """fp32 outputs of reductions in a backend-chosen order (indexer logits, losses)."""
    rtol, atol = REDUCTION_TOL
    return close(name, a, r, ctx, **({"rtol": rtol, "atol": atol, "global_max": 1e-9} | params))


def lse(name, a, r, ctx, **params) -> Check:
    """Attention log-sum-exp: abs 1e-6 or rel 8/65536 (SPEC 4), positions of -inf identical."""
    return close(name, a, r, ctx, **({"rtol": 8 / 65536, "atol": 1e-6, "mode": "or"} | params))


def grouped(name, a, r, ctx, **params) -> Check:
    """grouped_matmul: quantized variants within 1 ulp of out_dtype, float variants PyTorch defaults."""
    if ctx.dtype in ("w8a8", "w4a8"):
        return ulp(name, a, r, ctx, **params)
    return by_dtype(DEFAULT_TOL)(name, a, r, ctx, **params)


COMPARATORS: dict[str, Callable[..., Check]] = {
    "grouped": grouped,
    "exact": exact,
    "ulp": ulp,
    "default": by_dtype(DEFAULT_TOL),
    "attention": by_dtype(ATTENTION_TOL, mode="or", global_max=7e-6),
    "lse": lse,
    "indexer_logits": reduction,
    "reduction": reduction,
    "grad": by_dtype(GRAD_TOL, global_max=5e-5),
}
