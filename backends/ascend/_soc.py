"""The documented operator limits of each Ascend chip family and of the fused operators
(the CANN / torch_npu operator documentation). A leaf module: the provider, the adapters and the
operator emulations all read it, and it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

_POW2_128 = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class SocLimits:
    """Documented operator limits of one chip family (the CANN operator documentation)."""

    name: str
    indexer_heads: tuple[int, ...]  # npu_lightning_indexer N1
    sfa_heads: tuple[int, ...]  # npu_sparse_flash_attention N1
    weights_fp32: bool = True  # lightning indexer accepts fp32 head weights

    def pad_heads(self, allowed: tuple[int, ...], h: int) -> int | None:
        """Smallest allowed head count >= h (None if h exceeds every allowed value)."""
        return min((a for a in allowed if a >= h), default=None)


SOCS: dict[str, SocLimits] = {
    "A2": SocLimits("Atlas A2 (Ascend910B)", tuple(range(1, 65)), _POW2_128),
    "A3": SocLimits("Atlas A3 (Ascend910_93)", tuple(range(1, 65)), _POW2_128),
    "950": SocLimits("Ascend 950", (8, 16, 24, 32, 64), tuple(range(1, 129)), weights_fp32=False),
}

# sparse_count values npu_lightning_indexer accepts
SPARSE_COUNTS = frozenset(range(1, 2049)) | {3072, 4096, 5120, 6144, 7168, 8192}
MAX_SPARSE_COUNT = 8192
# block size rule shared by the indexer and SFA on PA_BSND caches
BLOCK_MULTIPLE, MAX_BLOCK = 16, 1024
# npu_quant_matmul: last dim of x1 and x2; npu_grouped_matmul: inner dims and groups
QMM_MAX_LAST_DIM = 65535
GMM_MAX_DIM = 65535
GMM_MAX_GROUPS = 1024
