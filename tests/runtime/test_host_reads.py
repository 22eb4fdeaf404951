"""The hot path reads nothing back to the host: a decode step, after warm-up, with a backend whose ops
do no host reads themselves, makes zero device-to-host reads in the front door and the model."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from tests.runtime._fakes import NoReadBackend

READ_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default}


class _CountReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READ_OPS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_host_reads():
    """Counts .item()/int()/bool() (aten._local_scalar_dense), .tolist() and .numpy()."""
    mode = _CountReads()
    mp = pytest.MonkeyPatch()
    for name in ("tolist", "numpy"):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, _name=name, **k):
            mode.reads.append(f"Tensor.{_name}")
            return _orig(self, *a, **k)

        mp.setattr(torch.Tensor, name, counted)
    try:
        with mode:
            yield mode.reads
    finally:
        mp.undo()


def test_the_counter_sees_host_reads():
    with count_host_reads() as reads:
        torch.ones(3).sum().item()
        torch.ones(2).tolist()
        bool(torch.ones(1) > 0)
    assert len(reads) == 3, reads


@pytest.mark.parametrize("block_size", [None, 16], ids=["ragged", "paged"])
def test_decode_step_makes_no_host_reads(block_size):
    cfg = GLM5Config.from_preset("tiny")
    model = GLM5ForCausalLM(cfg, NoReadBackend()).eval()
    cache = model.new_cache(2, 64, block_size=block_size)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    with torch.no_grad():
        model(ids, cache)  # prefill + warm-up
        model(ids[:, :1], cache)
        with count_host_reads() as reads:
            model(ids[:, 1:2], cache)  # one decode step
    assert reads == []


def test_an_untrusted_layout_is_value_checked_once(monkeypatch):
    """A layout the caller built itself is value-checked on first use only (one host copy), then never."""
    import backends

    be = backends.get("reference")
    lay = backends.SeqLayout.from_lengths([2], [3000])
    q, k, w = torch.randn(2, 2, 8), torch.randn(3000, 8), torch.rand(2, 2)
    with count_host_reads() as first:
        be.indexer_topk(q, k, w, lay, 16)
    with count_host_reads() as second:
        lay.check(2, k, "k_cache")  # cached: the front door's check costs no host read the second time
    assert first and not second
