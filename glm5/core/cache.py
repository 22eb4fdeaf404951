"""The inference caches: per attention layer a latent KV cache (`[c_kv ; k_pe]`, 576 wide for GLM-5)
and, for layers that run the indexer, an indexer key cache (`D_I` wide), both ragged or paged.

A forward step asks `begin(q_lens)` for the `SeqLayout` every layer of the step shares, the RoPE
positions of the new tokens and the physical rows they are written to; `commit` makes the new
tokens part of the context. `truncate` rolls a request back (rejected speculative tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends import SeqLayout
from backends.cache_layout import ONE_TENSOR, MLACache, MLACacheLayout, write_rows


@dataclass
class StepSlots:
    layout: SeqLayout  # queries = the new tokens, keys = context + new tokens
    positions: torch.Tensor  # int64 [T] RoPE position of each new token
    rows: torch.Tensor  # int64 [T] row of cache.view(-1, D) each new token is written to


class KVCache:
    """Caches for `len(has_indexer)` attention layers of `batch_size` requests of up to `max_len` tokens.

    Ragged (block_size None): request b owns rows b*max_len .. (b+1)*max_len-1 of a [B*max_len, D] cache.
    Paged: [num_blocks, block_size, D] with a block table; `block_order` places the blocks (default
    consecutive), so tests can scatter them. The latent caches are stored as `mla_cache` says (the
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
        self.kv: list[MLACache] = [
            mla_cache.view(torch.zeros(*shape, d_latent, dtype=dtype, device=device), block_size)
            for _ in has_indexer
        ]
        self.index_k = [
            torch.zeros(*shape, d_index, dtype=dtype, device=device) if h else None for h in has_indexer
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
        write_rows(cache, rows, values)
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
