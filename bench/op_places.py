"""Places and lines that declare each op by hand (issue 22 item 1): run before and after a change.

A "place" is a file of the contract machinery, the ONNX translation or the shared test/sample tables
that mentions the op; its "lines" are those of the smallest statements or table entries (found with
`ast`) that mention this op and no other. The contract machinery's total lines are printed too.

    python bench/op_places.py            # per op, then the totals
    python bench/op_places.py --op topk  # one op, with the places listed
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the files that make up the op contract's machinery (issue 22's ~2,000 lines)
MACHINERY = ["backends/interface.py", "backends/argcheck.py"] + [
    f"backends/contract/{m}.py"
    for m in ("typed_fp8", "typed_ops", "ops", "library", "custom_op", "limits", "table", "decl", "torch_op")
]
#: where else an op is declared by hand: the ONNX translation and the shared sample / limit tables
ELSEWHERE = [
    "glm5/onnx_export/translation.py",
    "tests/runtime/test_opcheck.py",
    "tests/backends/reference/_fp8_samples.py",
    "conformance/cases/limits.py",
]


def _files() -> list[Path]:
    return [ROOT / f for f in MACHINERY + ELSEWHERE if (ROOT / f).exists()]


def _ops() -> list[str]:
    import sys

    sys.path.insert(0, str(ROOT))
    from backends.contract.ops import OP_NAMES

    return list(OP_NAMES)


def _mentions(text: str, ops: list[str]) -> set[str]:
    """The ops `text` names: as a string, or as a function defined, called or decorated for it (a
    validator `check_<op>`, a backward `<op>_backward`); an argument that happens to share a name with
    an op (`topk`) is not a mention."""
    out = set()
    for op in ops:
        quoted = rf"[\"'/]{op}[\"'.]"
        prefix = r"(?<![A-Za-z0-9_])(?:(?:check|values|unchecked|call)_)?"
        fn = rf"{prefix}{op}(?:_backward)?(?:\(|\.register)"
        defined = rf"def (?:(?:check|values|unchecked)_)?{op}(?:_backward)?\b"
        if re.search(quoted, text) or re.search(fn, text) or re.search(defined, text):
            out.add(op)
    return out


def _lines(node: ast.AST, src: str, op: str, ops: list[str]) -> set[int]:
    children = list(ast.iter_child_nodes(node))
    if not hasattr(node, "lineno"):  # a comprehension's `for` clause: no position of its own
        return set().union(*(_lines(c, src, op, ops) for c in children))
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())])
    last = node.end_lineno or node.lineno
    named = _mentions("\n".join(src.splitlines()[first - 1 : last]), ops)
    if op not in named:
        return set()
    if named == {op} or not children:
        return set(range(first, last + 1))
    return set().union(*(_lines(c, src, op, ops) for c in children))


def places(op: str, ops: list[str]) -> dict[str, int]:
    """file -> lines of it that declare `op` (files that do not mention it are left out)."""
    out = {}
    for path in _files():
        src = path.read_text()
        tree = ast.parse(src)
        lines: set[int] = set()
        for node in tree.body:
            if isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant):
                continue  # the module docstring
            lines |= _lines(node, src, op, ops)
        if path.name == f"{op}.py":
            lines = set(range(1, len(src.splitlines()) + 1))
        if lines:
            out[str(path.relative_to(ROOT))] = len(lines)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op")
    a = ap.parse_args()
    ops = _ops()
    total_places = total_lines = 0
    for op in [a.op] if a.op else ops:
        p = places(op, ops)
        total_places += len(p)
        total_lines += sum(p.values())
        print(f"{op:28s} places {len(p):2d}  lines {sum(p.values()):4d}")
        if a.op:
            for f, n in p.items():
                print(f"    {f}: {n}")
    n = 1 if a.op else len(ops)
    print(f"mean per op: places {total_places / n:.1f}, lines {total_lines / n:.0f}")
    machinery = sum(len((ROOT / f).read_text().splitlines()) for f in MACHINERY if (ROOT / f).exists())
    print(f"contract machinery: {machinery} lines")


if __name__ == "__main__":
    main()
