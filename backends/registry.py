"""Backend registry: built-in backends by module path, out-of-tree ones by entry point.

Nothing is silently absent: `available()` lists every known backend with ok and a reason, including
the exception a broken import or a broken plugin raised. Selection is by name, or by `GLM5_BACKEND`,
never by which module happened to be imported.
"""

from __future__ import annotations

import importlib
import os
import threading
import traceback
from dataclasses import dataclass
from importlib import metadata

from backends.errors import BackendUnavailable
from backends.interface import Backend

ENTRY_POINT_GROUP = "glm5.backends"
DEFAULT_BACKEND = "reference"

#: name -> "module:attribute" of the Backend subclass; imported lazily.
BUILTIN: dict[str, str] = {
    "reference": "backends.reference:ReferenceBackend",
    "cpu": "backends.cpu:CpuBackend",
    "cuda": "backends.cuda:CudaBackend",
    "ascend": "backends.ascend:AscendBackend",
    "onnxruntime": "backends.onnxruntime:OnnxRuntimeBackend",
}


@dataclass
class _Entry:
    name: str
    source: str  # "builtin" or "plugin <dist>"
    backend: Backend | None
    error: str | None


_cache: dict[str, _Entry] = {}
#: guards the first construction of each backend: threads asking at once share one instance. Reentrant,
#: because a backend's constructor may itself look up another backend.
_lock = threading.RLock()


def _describe(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _instantiate(obj: object, name: str) -> Backend:
    if isinstance(obj, type) and issubclass(obj, Backend):
        inst = obj()
    elif isinstance(obj, Backend):
        inst = obj
    elif callable(obj):
        inst = obj()
    else:
        raise TypeError(
            f"entry point {name!r} gave {type(obj).__name__}, expected a Backend subclass, "
            "a Backend instance or a zero-argument factory"
        )
    if not isinstance(inst, Backend):
        raise TypeError(f"entry point {name!r} produced {type(inst).__name__}, expected a backends.Backend")
    if inst.name != name:
        raise TypeError(f"backend registered as {name!r} calls itself {inst.name!r}")
    return inst


def _load_builtin(name: str) -> _Entry:
    mod_name, attr = BUILTIN[name].split(":")
    try:
        cls = getattr(importlib.import_module(mod_name), attr)
        return _Entry(name, "builtin", _instantiate(cls, name), None)
    except Exception as exc:  # a broken import is reported, never hidden
        return _Entry(name, "builtin", None, _describe(exc))


def _plugin_entry_points() -> list[metadata.EntryPoint]:
    return list(metadata.entry_points(group=ENTRY_POINT_GROUP))


def _plugin_source(ep: metadata.EntryPoint) -> str:
    return f"plugin {ep.dist.name if ep.dist is not None else '?'} ({ep.value})"


def _plugins_named(name: str) -> list[metadata.EntryPoint]:
    """The plugin entry points called `name`, each installed distribution once (a package on sys.path
    twice is one plugin, not a collision)."""
    seen: dict[str, metadata.EntryPoint] = {}
    for ep in _plugin_entry_points():
        if ep.name == name:
            seen.setdefault(_plugin_source(ep), ep)
    return list(seen.values())


def _load_plugin(eps: list[metadata.EntryPoint]) -> _Entry:
    """The plugin backend `eps[0].name`; an error entry naming every source if more than one claims it."""
    name, source = eps[0].name, " and ".join(_plugin_source(ep) for ep in eps)
    if len(eps) > 1:
        return _Entry(name, source, None, "more than one plugin claims this name: uninstall one of them")
    try:
        return _Entry(name, source, _instantiate(eps[0].load(), name), None)
    except Exception as exc:
        return _Entry(name, source, None, _describe(exc))


def _refused() -> list[tuple[str, bool, str]]:
    """A row per plugin that takes a built-in's name: refused (the built-in keeps the name), and said so."""
    return [
        (
            f"{ep.name} [{_plugin_source(ep)}]",
            False,
            f"refused: {_plugin_source(ep)} takes the name of the built-in backend {ep.name!r} "
            f"({BUILTIN[ep.name]}); rename its entry point",
        )
        for ep in _plugin_entry_points()
        if ep.name in BUILTIN
    ]


def _entries() -> dict[str, _Entry]:
    """Every backend, built-in and plugin, built (once: `_entry`)."""
    for name in BUILTIN:
        _entry(name)
    for ep in _plugin_entry_points():
        if ep.name not in BUILTIN:  # a plugin cannot replace a built-in backend (`_refused` reports it)
            _entry(ep.name)
    return _cache


def _entry(name: str) -> _Entry | None:
    """The entry called `name`, building only that backend (never the others: on an Atlas host building
    `ascend` imports torch_npu, which `get("cpu")` must not pay for); None if no backend has that name."""
    e = _cache.get(name)
    if e is not None:
        return e  # built: no lock on the hot path
    with _lock:  # checked again under the lock: one thread builds, the others get its instance
        e = _cache.get(name)
        if e is None:
            if name in BUILTIN:
                e = _load_builtin(name)
            else:
                eps = _plugins_named(name)
                if not eps:
                    return None
                e = _load_plugin(eps)
            _cache[name] = e
    return e


def refresh() -> None:
    """Forget loaded backends (after installing a plugin in-process, or for tests)."""
    with _lock:
        _cache.clear()


def available() -> list[tuple[str, bool, str]]:
    """Every known backend as (name, ok, reason): built-ins first, then plugins, then a row per plugin
    refused for taking a built-in's name."""
    out = []
    for name, e in _entries().items():
        if e.backend is None:
            out.append((name, False, f"failed to load [{e.source}]: {e.error}"))
        else:
            ok, reason = e.backend.available()
            out.append((name, ok, reason if e.source == "builtin" else f"{reason} [{e.source}]"))
    return out + _refused()


def loaded(name: str) -> Backend | None:
    """The backend instance called `name` if it loaded (even if it cannot run here), else None."""
    e = _entries().get(name)
    return e.backend if e else None


def names() -> list[str]:
    return list(_entries())


def get(name: str | None = None) -> Backend:
    """The backend called `name`, else `$GLM5_BACKEND`, else "reference". Raises `BackendUnavailable`
    (with the reason) if it is unknown or cannot run here."""
    name = name or os.environ.get("GLM5_BACKEND") or DEFAULT_BACKEND
    e = _entry(name)
    if e is None:
        known = list(dict.fromkeys([*BUILTIN, *(ep.name for ep in _plugin_entry_points())]))
        raise BackendUnavailable(f"unknown backend {name!r}; known: {', '.join(known)}")
    if e.backend is None:
        raise BackendUnavailable(f"backend {name!r} failed to load [{e.source}]: {e.error}")
    ok, reason = e.backend.available()
    if not ok:
        raise BackendUnavailable(f"backend {name!r} is not available: {reason}")
    return e.backend
