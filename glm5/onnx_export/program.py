"""The model's prefill as a `torch.export` program (no ONNX needed): what the ONNX export translates,
and what `tests/glm5/test_export.py` checks is traceable with each backend op as one custom-op node."""

from __future__ import annotations

import torch
from torch import nn


class _Prefill(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids).logits


def trace_prefill(model, batch: int, seq_len: int) -> torch.export.ExportedProgram:
    """`model`'s prefill as an ExportedProgram, traced on the model's own backend (non-strict
    torch.export); each backend op is one `torch.ops.glm5.<op>` node."""
    ids = torch.zeros(batch, seq_len, dtype=torch.int64)
    with torch.no_grad():
        return torch.export.export(_Prefill(model).eval(), (ids,), strict=False)
