"""The typed methods of the ops of SPEC 2, a mixin of `backends.interface.Backend` (users call
`backend.sparse_mla_attention(...)` with IDE help): each passes its named arguments to the front door
(its door, `Backend._doors[op]`, backends/contract/door.py). Their signatures are checked against the ops'
declarations (backends/reference/<op>.py) when `backends.interface` is imported.
"""

from __future__ import annotations

import torch

from backends.layout import SeqLayout


class ContractOps:
    def indexer_logits(
        self, q: torch.Tensor, k_cache: torch.Tensor, weights: torch.Tensor, layout: SeqLayout
    ) -> torch.Tensor:
        """Lightning-indexer scores of every causal key (SPEC 2.1).

        q: [T, H_I, D_I] float; k_cache: ragged [rows, D_I] or paged [nb, bs, D_I], dtype of q;
        weights: [T, H_I] float32 (head-weight scaling folded in).
        Returns [T, max(seqlens_k)] float32; -inf where the key is not causal for the query.
        Semantics: backends/reference/indexer_logits.py (SPEC 2.1)
        """
        return self._doors["indexer_logits"](
            {"q": q, "k_cache": k_cache, "weights": weights, "layout": layout}
        )

    def indexer_topk(
        self, q: torch.Tensor, k_cache: torch.Tensor, weights: torch.Tensor, layout: SeqLayout, topk: int
    ) -> torch.Tensor:
        """The `topk` causal key positions with the largest indexer logits (SPEC 2.2).

        Inputs as `indexer_logits`. Returns int32 [T, topk]: logical positions in the order of the
        deterministic rule (value desc, lower index first), -1 past the number of causal keys.
        Semantics: backends/reference/indexer_topk.py (SPEC 2.2)
        """
        return self._doors["indexer_topk"](
            {"q": q, "k_cache": k_cache, "weights": weights, "layout": layout, "topk": topk}
        )

    def topk(
        self, x: torch.Tensor, k: int, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Deterministic row-wise top-k (SPEC 2.3).

        x: [R, C] float; lengths: int32/int64 [R] or None (only columns < lengths[r] are candidates).
        Returns (values [R, k] dtype of x, indices int32 [R, k]); -inf / -1 past the candidates.
        Semantics: backends/reference/topk.py (SPEC 2.3)
        """
        return self._doors["topk"]({"x": x, "k": k, "lengths": lengths})

    def sparse_mla_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        indices: torch.Tensor,
        layout: SeqLayout,
        sm_scale: float,
        d_v: int,
        return_lse: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Absorbed-MLA attention over the keys each query's indices name (SPEC 2.4).

        q: [T, H, d_qk] float; kv_cache: ragged [rows, d_qk] or paged [nb, bs, d_qk], dtype of q;
        indices: int32 [T, topk] logical positions (-1 / out of range skipped).
        Returns (out [T, H, d_v] dtype of q, lse [T, H] float32, natural log; empty row: 0 and -inf).
        return_lse=False (inference): lse is None, and a backend may take a path that cannot produce it.
        Semantics: backends/reference/sparse_mla_attention.py (SPEC 2.4)
        """
        return self._doors["sparse_mla_attention"](
            {
                "q": q,
                "kv_cache": kv_cache,
                "indices": indices,
                "layout": layout,
                "sm_scale": sm_scale,
                "d_v": d_v,
                "return_lse": return_lse,
            },
        )

    def dynamic_quant_int8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row symmetric int8 quantization (SPEC 2.5).

        x: [M, K] float. Returns (x_q int8 [M, K], scale float32 [M]).
        Semantics: backends/reference/dynamic_quant_int8.py (SPEC 2.5)
        """
        return self._doors["dynamic_quant_int8"]({"x": x})

    def w8a8_matmul(
        self,
        x_q: torch.Tensor,
        x_scale: torch.Tensor,
        w_q: torch.Tensor,
        w_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """int8 x int8 GEMM, exact int32 accumulation, per-token x per-channel scale epilogue (SPEC 2.6).

        x_q: int8 [M, K]; x_scale: float32 [M]; w_q: int8 [N, K]; w_scale: float32 [N]; bias: [N] or None.
        Returns [M, N] out_dtype.
        Semantics: backends/reference/w8a8_matmul.py (SPEC 2.6)
        """
        return self._doors["w8a8_matmul"](
            {
                "x_q": x_q,
                "x_scale": x_scale,
                "w_q": w_q,
                "w_scale": w_scale,
                "bias": bias,
                "out_dtype": out_dtype,
            },
        )

    def w4a8_matmul(
        self,
        x_q: torch.Tensor,
        x_scale: torch.Tensor,
        w_packed: torch.Tensor,
        w_scale: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """int8 activations x packed signed int4 weights, per-group scales (SPEC 2.7).

        x_q: int8 [M, K]; x_scale: float32 [M]; w_packed: uint8 [N, K//2] (w[n, 2i] in the low nibble);
        w_scale: float32 [N, K // group_size]; bias: [N] or None. Returns [M, N] out_dtype.
        Semantics: backends/reference/w4a8_matmul.py (SPEC 2.7)
        """
        return self._doors["w4a8_matmul"](
            {
                "x_q": x_q,
                "x_scale": x_scale,
                "w_packed": w_packed,
                "w_scale": w_scale,
                "group_size": group_size,
                "bias": bias,
                "out_dtype": out_dtype,
            },
        )

    def grouped_matmul(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        group_offsets: torch.Tensor,
        x_scale: torch.Tensor | None = None,
        w_scale: torch.Tensor | None = None,
        group_size: int | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """MoE expert GEMM over expert-sorted rows (SPEC 2.8): rows group_offsets[e]:group_offsets[e+1] of x
        times w[e]^T.

        group_offsets: int32/int64 [E+1], 0 to M, non-decreasing (empty experts legal). Variants by dtype:
          float: x [M, K] float, w [E, N, K] same dtype; returns dtype of x (or out_dtype).
          W8A8:  x int8 [M, K], x_scale f32 [M], w int8 [E, N, K], w_scale f32 [E, N]; returns out_dtype.
          W4A8:  x int8 [M, K], x_scale f32 [M], w uint8 [E, N, K//2] (SPEC 2.7 packing),
                 w_scale f32 [E, N, K // group_size]; returns out_dtype.
        Semantics: backends/reference/grouped_matmul.py (SPEC 2.8)
        """
        return self._doors["grouped_matmul"](
            {
                "x": x,
                "w": w,
                "group_offsets": group_offsets,
                "x_scale": x_scale,
                "w_scale": w_scale,
                "group_size": group_size,
                "out_dtype": out_dtype,
            },
        )

    def linear_cross_entropy(
        self, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
    ) -> torch.Tensor:
        """Mean cross-entropy of h @ weight^T against targets, in sequence chunks (SPEC 2.9).

        h: [N, D] float; weight: [V, D] float; targets: int64/int32 [N]. Returns a float32 scalar,
        differentiable in h and weight. No counted target (all ignore_index, or N == 0): NaN, as torch.
        Semantics: backends/reference/linear_cross_entropy.py (SPEC 2.9)
        """
        return self._doors["linear_cross_entropy"](
            {"h": h, "weight": weight, "targets": targets, "ignore_index": ignore_index},
        )

    def linear_cross_entropy_shard(
        self,
        h: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int = 0,
        ignore_index: int = -100,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One vocabulary shard's per-row statistics of h @ weight^T (SPEC 2.9.1), in sequence chunks.

        h: [N, D] float; weight: [V, D] float, the vocabulary rows from vocab_start; targets: int64/int32
        [N] global ids. Returns (max, sumexp, target logit), fp32 [N] each: the row max of the shard's
        logits, sum(exp(logits - max)), and the target's logit (0 where it is ignore_index or outside the
        shard). Differentiable in h and weight through sumexp and the target logit (max is a shift).
        Semantics: backends/reference/linear_cross_entropy_shard.py (SPEC 2.9.1)
        """
        return self._doors["linear_cross_entropy_shard"](
            {
                "h": h,
                "weight": weight,
                "targets": targets,
                "vocab_start": vocab_start,
                "ignore_index": ignore_index,
            },
        )

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU's activation on a fused gate-up projection (SPEC 2.10): x [M, 2N] float = [gate | up]
        -> silu(gate) * up [M, N], dtype of x; differentiable in x.
        Semantics: backends/reference/silu_and_mul.py (SPEC 2.10)
        """
        return self._doors["silu_and_mul"]({"x": x})
