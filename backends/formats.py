"""The contract's data formats, for code outside the backends (quantization, checkpoints, the model):
the signed int4 packing of W4A8 weights (SPEC 2.7) and the FP8 formats (SPEC 7: e4m3 casts, 1 x 128
activation groups, 128 x 128 weight blocks, the 656-byte MLA cache row, the FP8 indexer
cache, the FP8 indexer's inputs).

They are defined where the contract is, in the reference (backends/reference/w4a8_matmul.py,
fp8_format.py, fp8_indexer_logits.py); this module is their public name, so nothing outside backends/
reaches into a backend package.
"""

from backends.reference.fp8_format import (
    BLOCK,
    E4M3,
    E4M3_MAX,
    EPS_DEEPSEEK,
    EPS_VLLM,
    INDEX_SCALE_BYTES,
    MLA_ROW_BYTES,
    MLA_SCALE_FLOOR,
    cast_e4m3,
    cdiv,
    dequantize_weight_blocks,
    expand_groups,
    index_cache_of,
    index_cache_views,
    mla_simulated_rows,
    pow2_ceil,
    quantize_index_keys,
    quantize_weight_blocks,
    write_index_cache,
)
from backends.reference.fp8_indexer_logits import quantize_indexer_inputs
from backends.reference.w4a8_matmul import pack_int4, unpack_int4

__all__ = [
    "BLOCK",
    "E4M3",
    "E4M3_MAX",
    "EPS_DEEPSEEK",
    "EPS_VLLM",
    "INDEX_SCALE_BYTES",
    "MLA_ROW_BYTES",
    "MLA_SCALE_FLOOR",
    "cast_e4m3",
    "cdiv",
    "dequantize_weight_blocks",
    "expand_groups",
    "index_cache_of",
    "index_cache_views",
    "mla_simulated_rows",
    "pack_int4",
    "pow2_ceil",
    "quantize_index_keys",
    "quantize_indexer_inputs",
    "quantize_weight_blocks",
    "unpack_int4",
    "write_index_cache",
]
