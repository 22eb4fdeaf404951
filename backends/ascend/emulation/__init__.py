"""CPU EMULATIONS of torch_npu fused operators, written from each operator's documentation
(torch_npu 2.14 schemas and op-plugin docs).

These are not torch_npu and not an NPU. They exist so the Ascend backend's adapters (layout packing,
index conventions, head padding, lse conversion, weight repacking) can be exercised on a CPU machine
against something that takes exactly the operator's documented arguments and returns its documented
outputs. Rules every emulation here follows:

- the signature is the operator's (keyword names, defaults); nothing else is accepted;
- it computes from its arguments alone: no `SeqLayout`, no call into `backends.reference`;
- it rejects (`OperatorRejected`) what the documentation says the real operator rejects: dtypes,
  head counts, head dims, block sizes, limits; what the docs leave undefined (tie order, rows past the
  last group, indices past the valid prefix) is emulated in a way that exposes callers relying on it;
- features the backend does not use raise `NotEmulated` rather than guessing.

`module_for(soc)` returns a namespace whose `npu_*` attributes are bound to one SoC's limits.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from backends.ascend.emulation._checks import NotEmulated, OperatorRejected
from backends.ascend.emulation.npu_dynamic_quant import npu_dynamic_quant
from backends.ascend.emulation.npu_grouped_matmul import npu_grouped_matmul
from backends.ascend.emulation.npu_lightning_indexer import npu_lightning_indexer
from backends.ascend.emulation.npu_quant_matmul import npu_quant_matmul
from backends.ascend.emulation.npu_sparse_flash_attention import npu_sparse_flash_attention
from backends.ascend.emulation.npu_swiglu import npu_swiglu

OPERATORS = (
    "npu_lightning_indexer",
    "npu_sparse_flash_attention",
    "npu_dynamic_quant",
    "npu_quant_matmul",
    "npu_grouped_matmul",
    "npu_swiglu",
)

__all__ = ["OPERATORS", "NotEmulated", "OperatorRejected", "module_for"]


def module_for(soc: str) -> SimpleNamespace:
    """A torch_npu stand-in whose SoC-dependent operators enforce `soc`'s limits ("A2", "A3", "950")."""
    return SimpleNamespace(
        __name__=f"backends.ascend.emulation[{soc}]",
        __version__="emulation",
        soc=soc,
        npu_lightning_indexer=functools.partial(npu_lightning_indexer, _soc=soc),
        npu_sparse_flash_attention=functools.partial(npu_sparse_flash_attention, _soc=soc),
        npu_dynamic_quant=npu_dynamic_quant,
        npu_quant_matmul=npu_quant_matmul,
        npu_grouped_matmul=npu_grouped_matmul,
        npu_swiglu=npu_swiglu,
    )
