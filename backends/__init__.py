"""The GLM-5 backend layer: one op contract (docs/spec.md, executable in `backends.reference`),
many backends, selected by name.

    import backends
    be = backends.get("reference")          # or $GLM5_BACKEND
    idx = be.indexer_topk(q, k_cache, weights, layout, topk=2048)
"""

from backends.caps import OpCaps, OpImpl
from backends.contract.ops import OP_NAMES, OPS
from backends.errors import BackendUnavailable, NotSupported
from backends.interface import Backend
from backends.layout import SeqLayout
from backends.registry import ENTRY_POINT_GROUP, available, get, names, refresh

__all__ = [
    "Backend",
    "BackendUnavailable",
    "ENTRY_POINT_GROUP",
    "NotSupported",
    "OP_NAMES",
    "OPS",
    "OpCaps",
    "OpImpl",
    "SeqLayout",
    "available",
    "get",
    "names",
    "refresh",
]
