"""`glm5 quantize SRC --recipe ... --format ... --out DIR` end to end, and its refusals."""

from __future__ import annotations

import torch
from click.testing import CliRunner

from glm5.cli import main
from quant.load import load_quantized
from tests.quant.conftest import ids, tiny_model


def test_quantize_command_writes_loadable_checkpoints(tmp_path):
    tiny_model(seed=4, dtype=torch.bfloat16).save_pretrained(tmp_path / "src")
    runner = CliRunner()
    for fmt in ("modelslim", "compressed-tensors"):
        res = runner.invoke(main, ["quantize", str(tmp_path / "src"), "--recipe", "glm5-w4a8", "--format",
                                   fmt, "--out", str(tmp_path / fmt), "--calib-seqs", "2",
                                   "--calib-len", "24"])
        assert res.exit_code == 0, res.output
        assert "W4A8_DYNAMIC" in res.output
        model = load_quantized(tmp_path / fmt)
        assert model.dtype == torch.bfloat16
        with torch.no_grad():
            assert torch.isfinite(model(ids()).logits.float()).all()
    res = runner.invoke(main, ["quantize", str(tmp_path / "src"), "--recipe", "glm5-w4a8-g128", "--format",
                               "modelslim", "--out", str(tmp_path / "bad")])
    assert res.exit_code != 0 and "per-channel int4 only" in res.output
    res = runner.invoke(main, ["quantize", str(tmp_path / "src"), "--recipe", "nope", "--format",
                               "modelslim", "--out", str(tmp_path / "bad")])
    assert res.exit_code != 0 and "recipe" in res.output
