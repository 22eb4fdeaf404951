"""`glm5 port init NAME`: write an installable out-of-tree backend package that declines every op with
NotSupported("not ported yet"), so `pip install -e DIR` and `glm5 conformance --backend NAME` work at once.

Layout of DIR (docs/porting.md describes each file):

    pyproject.toml                 entry point NAME = "glm5_NAME:NameBackend" in group glm5.backends
    README.md                      the porting steps
    glm5_NAME/__init__.py          the Backend class: ops = load_ops("glm5_NAME")
    glm5_NAME/_not_ported.py       the reason every op gives until it is ported
    glm5_NAME/<op>.py              one module per op of backends.contract.ops.OPS, each defining IMPL
    glm5_NAME/expectations.yaml    the conformance manifest (strict xfails, tolerances; each with a reason)
    tests/test_conformance.py      the conformance suite under pytest
"""

from __future__ import annotations

import importlib.util
import inspect
import keyword
import os
import re
import shutil
from pathlib import Path
from string import Template

from glm5.infra import fsio
from glm5.port.example import EXAMPLE_OP, EXAMPLE_OP_NAME

TEMPLATES = Path(__file__).parent / "templates"
REASON = "not ported yet"
NAME_RE = re.compile(r"[a-z][a-z0-9_]*\Z")


class PortError(ValueError):
    """Bad input to `glm5 port`: one line naming the argument and what was expected."""


def names(name: str) -> dict[str, str]:
    """The names derived from a backend name: package, distribution and class."""
    return {
        "name": name,
        "pkg": f"glm5_{name}",
        "dist": f"glm5-{name.replace('_', '-')}",
        "cls": "".join(p.capitalize() for p in name.split("_")) + "Backend",
        "reason": REASON,
    }


def check_name(name: str, force: bool = False) -> None:
    from backends.registry import BUILTIN

    if not NAME_RE.match(name) or keyword.iskeyword(name):
        raise PortError(f"NAME: expected a lowercase Python identifier ([a-z][a-z0-9_]*), got {name!r}")
    if name in BUILTIN:
        raise PortError(f"NAME: {name!r} is a built-in backend; choose another name")
    pkg = names(name)["pkg"]
    if not force and importlib.util.find_spec(pkg) is not None:  # --force: regenerating an installed one
        raise PortError(f"NAME: a Python package {pkg!r} is already importable here; choose another name")


def _signature(op: str) -> str:
    """`(x: torch.Tensor, k: int, ...) -> ...` of `Backend.<op>`, without self: the names the table checks."""
    from backends.interface import Backend

    sig = inspect.signature(getattr(Backend, op))
    parts = []
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        text = p.name if p.annotation is inspect.Parameter.empty else f"{p.name}: {p.annotation}"
        if p.default is not inspect.Parameter.empty:
            text += f" = {p.default!r}"
        parts.append(text)
    ret = "" if sig.return_annotation is inspect.Signature.empty else f" -> {sig.return_annotation}"
    one_line = "(" + ", ".join(parts) + ")" + ret
    if len(op) + len(one_line) <= 100:
        return one_line
    return "(\n" + "".join(f"    {p},\n" for p in parts) + ")" + ret


def op_module(op: str, n: dict[str, str]) -> str:
    """The stub module of one op: the interface's signature, the reference's dtype axis, layouts and tie rule
    claimed (so the decline reason is "not ported yet", not "dtype not claimed"), and check= declining."""
    from backends.contract.ops import OPS
    from backends.reference import ReferenceBackend

    spec, ref = OPS[op], ReferenceBackend.ops.get(op)
    # what the reference claims; for an op it does not serve yet, what the op table implies
    lays = ref.caps.layouts if ref else (("ragged", "paged") if spec.cache_arg else ())
    tie_rule = ref.caps.tie_rule if ref else ("lower_index" if op.endswith("topk") else None)
    layouts = f"\n        layouts={_strs(lays)}," if lays else ""
    tie = f'\n        tie_rule="{tie_rule}",' if tie_rule else ""
    return _render(
        "op.py.tmpl",
        n,
        op=op,
        section=spec.spec_section,
        signature=_signature(op),
        dtypes=_strs(spec.dtype_axis),
        layouts=layouts,
        tie_rule=tie,
    )


def _strs(values) -> str:
    """A tuple of strings as source, in double quotes (the house style)."""
    return "(" + ", ".join(f'"{v}"' for v in values) + ("," if len(values) == 1 else "") + ")"


def _render(template: str, n: dict[str, str], **extra: str) -> str:
    return Template((TEMPLATES / template).read_text(encoding="utf-8")).substitute(n, **extra)


def ported_ops() -> list[str]:
    """The ops a stub is generated for: every op of the table that the interface exposes as a method."""
    from backends.contract.ops import OP_NAMES
    from backends.interface import Backend

    return [op for op in OP_NAMES if callable(getattr(Backend, op, None))]


def files(name: str) -> dict[str, str]:
    """Relative path -> text of every file of the generated package."""
    ops = ported_ops()

    n = names(name)
    pkg = n["pkg"]
    out = {
        "pyproject.toml": _render("pyproject.toml.tmpl", n),
        "README.md": _render(
            "README.md.tmpl", n, example_op=EXAMPLE_OP_NAME, example=EXAMPLE_OP, n_ops=str(len(ops))
        ),
        f"{pkg}/__init__.py": _render("__init__.py.tmpl", n, example_op=EXAMPLE_OP_NAME),
        f"{pkg}/_not_ported.py": _render("_not_ported.py.tmpl", n),
        f"{pkg}/expectations.yaml": _render("expectations.yaml.tmpl", n),
        "tests/test_conformance.py": _render("test_conformance.py.tmpl", n),
    }
    for op in ops:
        out[f"{pkg}/{op}.py"] = op_module(op, n)
    return out


def _escape(root: Path, rel: str) -> str | None:
    """Why writing `root/rel` could land outside `root` (None: it cannot): a symlink at `rel` or at any
    directory between `root` and it (e.g. DIR/glm5_NAME -> elsewhere), or a path resolving outside."""
    path = root
    for part in Path(rel).parts:
        path = path / part
        if path.is_symlink():
            return (
                f"--dir: {str(path)!r} is a symlink (to {os.readlink(path)!r}); refusing to write through it "
                "(remove it, or choose another --dir)"
            )
    try:
        inside = (root / rel).resolve().is_relative_to(root.resolve())
    except (RuntimeError, OSError) as exc:  # Python 3.11's resolve raises RuntimeError on a symlink loop
        return f"--dir: {str(root)!r} cannot be resolved ({exc})"
    if not inside:
        return f"--dir: {str(root / rel)!r} resolves outside {str(root)!r}"
    return None


def init(name: str, directory: str | Path | None = None, force: bool = False) -> tuple[Path, list[str]]:
    """Write the package for backend `name` into `directory` (default ./glm5-NAME); returns (dir, files).

    An existing non-empty directory is refused unless `force` (then only the generated files are replaced,
    anything else there is kept). Every file is written atomically inside the directory, never outside it: a
    symlink among the generated paths (or their directories) is refused before anything is written."""
    check_name(name, force)
    root = Path(directory if directory is not None else f"glm5-{name.replace('_', '-')}")
    if root.exists() and not root.is_dir():
        raise PortError(f"--dir: {str(root)!r} exists and is not a directory")
    if root.is_dir() and any(root.iterdir()) and not force:
        raise PortError(
            f"--dir: {str(root)!r} exists and is not empty; pass --force to write the package into it"
        )
    created = not root.exists()
    content = files(name)
    for rel in content:  # before anything is written
        if why := _escape(root, rel):
            raise PortError(why)
    try:
        root.mkdir(parents=True, exist_ok=True)
        for rel, text in content.items():
            if why := _escape(root, rel):  # again, just before writing: a symlink made meanwhile
                raise PortError(why)
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            fsio.write_text_atomic(root / rel, text)
    except BaseException:
        if created:  # leave nothing half-written behind; a directory that was there is left alone
            shutil.rmtree(root, ignore_errors=True)
        raise
    return root, sorted(content)
