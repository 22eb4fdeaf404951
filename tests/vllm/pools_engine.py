"""tests/vllm/engine.py with the backend declaring split latent pools (backends/cache_layout.py) and every
step's cache copies counted; tests/vllm/test_pools_engine.py runs it in a fresh process.

    GLM5_BACKEND=reference python tests/vllm/pools_engine.py '{"model": DIR, "prompts": [...],
        "split": [c, r], "split_block_size": 128, "block_size": null}'

"split" makes the backend declare Ascend's layout at the model's widths (`MLACacheLayout(split,
block_size)`: latent `[blocks, bs, 1, c]` + rope `[blocks, bs, 1, r]`, what npu_sparse_flash_attention
reads in PA_BSND), so the plugin's config hook sets vLLM's block size and the cache layers bind vLLM's
buffers as the pools. Copies are counted as bench/ascend/copies_sparse_mla.py counts them
(tests/backends/ascend/_copies.CacheCopies): during every forward of the model, bytes materialised out of
a cache buffer vLLM allocated, with the backend ops that read the caches (the operator) outside the count.
Adds "probe": {"kinds": cache types sparse_mla_attention was given, "in_vllm_buffers": whether each was a
view of a buffer vLLM bound, "copied_bytes", "forwards", "calls"}.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model runs in this process

import torch  # noqa: E402
from torch.utils._python_dispatch import _disable_current_modes  # noqa: E402

from tests.backends.ascend._copies import CacheCopies  # noqa: E402
from tests.vllm import engine  # noqa: E402

CACHE_OPS = ("sparse_mla_attention", "indexer_topk")


class Probe:
    def __init__(self, backend) -> None:
        self.buffers: dict[int, torch.Tensor] = {}  # storage -> a cache tensor vLLM bound
        self.kinds: Counter[str] = Counter()
        self.in_vllm: Counter[bool] = Counter()
        self.copied = 0
        self.forwards = 0
        self.calls = 0
        for op in CACHE_OPS:
            setattr(backend, op, self._operator(getattr(backend, op)))

    def _operator(self, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            cache = args[1]
            if fn.__name__ == "sparse_mla_attention":
                self.calls += 1
                self.kinds[type(cache).__name__] += 1
                pools = getattr(cache, "tensors", lambda: (cache,))()
                self.in_vllm[all(_storage(t) in self.buffers for t in pools)] += 1
            with _disable_current_modes():  # what the operator reads is not a copy
                return fn(*args, **kwargs)

        return run

    def bind(self, bind):
        @functools.wraps(bind)
        def wrapped(layer, kv_cache):
            self.buffers[_storage(kv_cache)] = kv_cache
            return bind(layer, kv_cache)

        return wrapped

    def forward(self, forward):
        @functools.wraps(forward)
        def wrapped(model, *args, **kwargs):
            if not self.buffers:  # vLLM's profiling run: no cache yet
                return forward(model, *args, **kwargs)
            copies = CacheCopies(next(iter(self.buffers.values())))
            copies.followed = set(self.buffers)  # every cache vLLM bound
            with copies:
                out = forward(model, *args, **kwargs)
            self.copied += copies.bytes
            self.forwards += 1
            return out

        return wrapped

    def report(self) -> dict:
        return {
            "kinds": dict(self.kinds),
            "in_vllm_buffers": {str(k): v for k, v in self.in_vllm.items()},
            "copied_bytes": self.copied,
            "forwards": self.forwards,
            "calls": self.calls,
        }


def _storage(t) -> int:
    return t.untyped_storage().data_ptr()


def install(spec: dict) -> Probe:
    """The probe on $GLM5_BACKEND and the plugin's classes, in this process, before the engine starts
    (tests/vllm/parallel_engine.py installs it too, with "probe": true, at tensor_parallel_size 1)."""
    import backends
    from backends.cache_layout import MLACacheLayout
    from glm5.vllm.cache import Glm5CacheLayer
    from glm5.vllm.model import Glm5BackendsForCausalLM

    backend = backends.get(os.environ["GLM5_BACKEND"])
    if spec.get("split"):
        backend.mla_cache = MLACacheLayout(split=tuple(spec["split"]), block_size=spec["split_block_size"])
    probe = Probe(backend)
    Glm5CacheLayer.bind_kv_cache = probe.bind(Glm5CacheLayer.bind_kv_cache)
    Glm5BackendsForCausalLM.forward = probe.forward(Glm5BackendsForCausalLM.forward)
    return probe


def main(spec: dict) -> dict:
    probe = install(spec)
    return {**engine.main(spec), "probe": probe.report()}


if __name__ == "__main__":
    print("GLM5-RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
