"""The inference caches: per attention layer a latent KV cache (`[c_kv ; k_pe]`, 576 wide for GLM-5)
and, for layers that run the indexer, an indexer key cache (`D_I` wide), both ragged or paged.

A forward step asks `begin(q_lens)` for the `SeqLayout` every layer of the step shares, the RoPE
positions of the new tokens and the physical rows they are written to; `commit` makes the new
tokens part of the context. `truncate` rolls a request back (rejected speculative tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from backends import SeqLayout
from backends.cache_layout import ONE_TENSOR, MLACache, MLACacheLayout, write_rows
from backends.formats import (
    INDEX_SCALE_BYTES,
    MLA_ROW_BYTES,
    index_cache_of,
    mla_simulated_rows,
    write_index_cache,
)

#: vLLM's name of the FP8 cache (`--kv-cache-dtype fp8_ds_mla`); "auto": the model dtype
FP8_DS_MLA = "fp8_ds_mla"
KV_CACHE_DTYPES = ("auto", FP8_DS_MLA)
MLA_WIDTHS = (512, 64)  # (kv_lora_rank, qk_rope_head_dim) the 656-byte row holds


@dataclass(frozen=True)
class CacheFormat:
    """What the caches hold per token, by vLLM's `kv_cache_dtype` name (SPEC 7.8). "auto": the model's rows.
    "fp8_ds_mla": the latent as FlashMLA's 656-byte rows where the widths are GLM-5's (`MLA_WIDTHS`;
    quantized once, when written, by the backend's fp8_mla_cache_quant), else the same numerics simulated
    in the model dtype (`mla_simulated_rows`); indexer keys as the FP8 indexer cache (D_I e4m3 bytes and a
    fp32 scale each). The attention and the indexer then read the cache they are given: its kind picks
    the kernel (`backends.cache_layout.cache_kind`)."""

    kv_cache_dtype: str = "auto"
    latent_width: int = 0  # kv_lora_rank (c): the d_v of the absorbed attention

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype == FP8_DS_MLA

    def fp8_rows(self, width: int) -> bool:
        """Whether latent rows `width` wide are stored as 656-byte FP8 rows."""
        return self.fp8 and (self.latent_width, width - self.latent_width) == MLA_WIDTHS

    def stored(self, which: str, width: int, dtype: torch.dtype) -> tuple[int, torch.dtype]:
        """(width, dtype) a cache `which` ('kv' or 'index_k') of `width`-wide rows is allocated with."""
        if which == "index_k" and self.fp8:
            return width + INDEX_SCALE_BYTES, torch.uint8
        if which == "kv" and self.fp8_rows(width):
            return MLA_ROW_BYTES, torch.uint8
        return width, dtype

    def rows(self, which: str, values: torch.Tensor, backend: Any) -> torch.Tensor:
        """values [T, D] as a ragged cache of this format holds them (the latent: encoded per row)."""
        if not self.fp8:
            return values
        if which == "index_k":
            return index_cache_of(values)
        if self.fp8_rows(values.shape[-1]):
            return backend.fp8_mla_cache_quant(values)
        return mla_simulated_rows(values, self.latent_width)

    def write(
        self, which: str, cache: MLACache, rows: torch.Tensor, values: torch.Tensor, backend: Any
    ) -> None:
        """Write values [T, D] at physical `rows` of `cache`, encoded as this format stores them."""
        if which == "index_k" and self.fp8:
            write_index_cache(cache, rows, values)  # keys, then scales, per block: not row-interleaved
        else:
            write_rows(cache, rows, self.rows(which, values, backend))


AUTO = CacheFormat()


@dataclass
class StepSlots:
    layout: SeqLayout  # queries = the new tokens, keys = context + new tokens
    positions: torch.Tensor  # int64 [T] RoPE position of each new token
    rows: torch.Tensor  # int64 [T] row of cache.view(-1, D) each new token is written to


class KVCache:
    """Caches for `len(has_indexer)` attention layers of `batch_size` requests of up to `max_len` tokens.

    Ragged (block_size None): request b owns rows b*max_len .. (b+1)*max_len-1 of a [B*max_len, D] cache.
    Paged: [num_blocks, block_size, D] with a block table; `block_order` places the blocks (default
    consecutive), so tests can scatter them. `cache_format` says what a row holds (the model's values,
    or FP8 rows: `CacheFormat`). The latent caches are stored as `mla_cache` says (the
    backend's `Backend.mla_cache`): one tensor, or two pools (`MLAPools`) over the same buffer.
    """

    def __init__(
        self,
        has_indexer: list[bool],
        batch_size: int,
        max_len: int,
        d_latent: int,
        d_index: int,
        *,
        block_size: int | None = None,
        block_order: list[int] | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        mla_cache: MLACacheLayout = ONE_TENSOR,
        cache_format: CacheFormat = AUTO,
        backend: Any = None,
    ) -> None:
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"batch_size/max_len: expected >= 1, got {(batch_size, max_len)}")
        self.batch_size, self.max_len, self.block_size = batch_size, max_len, block_size
        self.lengths = [0] * batch_size
        if block_size is None:
            self._layout_k = {
                "cu_seqlens_k": torch.arange(batch_size + 1, dtype=torch.int32, device=device) * max_len
            }
            shape: tuple[int, ...] = (batch_size * max_len,)
        else:
            per = -(-max_len // block_size)
            ref = SeqLayout.from_lengths(
                [0] * batch_size,
                [per * block_size] * batch_size,
                block_size=block_size,
                block_order=block_order,
                device=device,
            )
            self._layout_k = {"block_table": ref.block_table}
            used = ref.block_table[ref.block_table >= 0]
            shape = (int(used.max()) + 1 if used.numel() else 1, block_size)
        self.format, self.backend = cache_format, backend  # backend: fp8_mla_cache_quant for FP8 rows
        kv_w, kv_dt = cache_format.stored("kv", d_latent, dtype)
        index_w, index_dt = cache_format.stored("index_k", d_index, dtype)
        self.kv: list[MLACache] = [
            mla_cache.view(torch.zeros(*shape, kv_w, dtype=kv_dt, device=device), block_size)
            for _ in has_indexer
        ]
        self.index_k = [
            torch.zeros(*shape, index_w, dtype=index_dt, device=device) if h else None for h in has_indexer
        ]
        self.device = torch.device(device)

    def begin(self, q_lens: list[int]) -> StepSlots:
        """Layout, positions and write rows for q_lens[b] new tokens of each request (not yet committed)."""
        if len(q_lens) != self.batch_size:
            raise ValueError(
                f"q_lens: expected {self.batch_size} entries (one per request), got {len(q_lens)}"
            )
        k_lens = [n + q for n, q in zip(self.lengths, q_lens, strict=True)]
        if max(k_lens) > self.max_len:
            raise ValueError(
                f"input_ids: {max(k_lens)} tokens exceed the cache capacity max_len={self.max_len}"
            )
        dev = self.device
        cu_q = torch.tensor([0] + _cumsum(q_lens), dtype=torch.int32, device=dev)
        # valid by construction (lengths checked above, blocks assigned at init): no per-step value checks
        layout = SeqLayout(
            cu_q,
            torch.tensor(k_lens, dtype=torch.int32, device=dev),
            **self._layout_k,
            max_seqlen_k=max(k_lens) if k_lens else 0,
            trusted=True,
        )
        positions = torch.cat(
            [torch.arange(n, n + q, device=dev) for n, q in zip(self.lengths, q_lens, strict=True)]
        )
        owner = torch.repeat_interleave(
            torch.arange(self.batch_size, device=dev),
            torch.tensor(q_lens, device=dev),
            output_size=sum(q_lens),  # known on the host: no device-to-host read for the output size
        )
        if self.block_size is None:
            rows = owner * self.max_len + positions
        else:
            bt = self._layout_k["block_table"].to(torch.int64)
            rows = bt[owner, positions // self.block_size] * self.block_size + positions % self.block_size
        return StepSlots(layout, positions, rows)

    def write(self, which: str, layer: int, rows: torch.Tensor, values: torch.Tensor) -> MLACache:
        """Write values [T, D] at `rows` of cache `which` ('kv' or 'index_k') of `layer`; returns it."""
        cache = getattr(self, which)[layer]
        self.format.write(which, cache, rows, values, self.backend)
        return cache

    def commit(self, q_lens: list[int]) -> None:
        self.lengths = [n + q for n, q in zip(self.lengths, q_lens, strict=True)]

    def truncate(self, b: int, n: int) -> None:
        """Forget request b's tokens from position n on (their rows are overwritten later)."""
        if not 0 <= n <= self.lengths[b]:
            raise ValueError(f"n: expected 0 <= n <= {self.lengths[b]}, got {n}")
        self.lengths[b] = n


def _cumsum(xs: list[int]) -> list[int]:
    out, s = [], 0
    for x in xs:
        s += x
        out.append(s)
    return out
