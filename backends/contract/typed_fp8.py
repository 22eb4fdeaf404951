"""The FP8 ops of the backend interface (SPEC 7), a mixin of `backends.interface.Backend`: the same
front door (backends/contract/door.py: validation, capabilities, NotSupported with every reason, custom op).

A backend serves them where an FP8 datapath exists (Hopper-class NVIDIA GPUs: e4m3 tensor-core dots);
the table convention leaves an op out, or declares it with the reason it cannot run (Ascend A2/A3).
"""

from __future__ import annotations

import torch

from backends.layout import SeqLayout


class FP8Ops:
    def fp8_quant_group(
        self, x: torch.Tensor, group_size: int = 128, eps: float = 1e-4, ue8m0: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token-group e4m3 quantization (SPEC 7.1): x [M, K] float -> (x_q e4m3 [M, K],
        scale fp32 [M, ceil(K / group_size)]); scale = max(amax, eps) / 448 (eps 1e-4 DeepSeek, 1e-10
        vLLM), UE8M0: the next power of two up. Semantics: backends/reference/fp8_quant_group.py"""
        return self._doors["fp8_quant_group"]({"x": x, "group_size": group_size, "eps": eps, "ue8m0": ue8m0})

    def fp8_block_matmul(
        self,
        x_q: torch.Tensor,
        x_scale: torch.Tensor,
        w_q: torch.Tensor,
        w_scale_inv: torch.Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """Block-scaled FP8 GEMM (SPEC 7.2): x_q e4m3 [M, K], x_scale fp32 [M, ceil(K/128)], w_q e4m3
        [N, K], w_scale_inv fp32 [ceil(N/128), ceil(K/128)] -> [M, N] out_dtype, fp32 accumulation
        promoted per 128-wide K block. Semantics: backends/reference/fp8_block_matmul.py"""
        return self._doors["fp8_block_matmul"](
            {
                "x_q": x_q,
                "x_scale": x_scale,
                "w_q": w_q,
                "w_scale_inv": w_scale_inv,
                "bias": bias,
                "out_dtype": out_dtype,
            },
        )

    def fp8_grouped_matmul(
        self,
        x_q: torch.Tensor,
        x_scale: torch.Tensor,
        w_q: torch.Tensor,
        w_scale_inv: torch.Tensor,
        group_offsets: torch.Tensor,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """MoE FP8 GEMM over expert-sorted rows (SPEC 7.3): w_q e4m3 [E, N, K], w_scale_inv fp32
        [E, ceil(N/128), ceil(K/128)], group_offsets int [E+1].
        Semantics: backends/reference/fp8_grouped_matmul.py"""
        return self._doors["fp8_grouped_matmul"](
            {
                "x_q": x_q,
                "x_scale": x_scale,
                "w_q": w_q,
                "w_scale_inv": w_scale_inv,
                "group_offsets": group_offsets,
                "out_dtype": out_dtype,
            },
        )

    def fp8_indexer_logits(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        k_scale: torch.Tensor,
        weights: torch.Tensor,
        layout: SeqLayout,
    ) -> torch.Tensor:
        """FP8 indexer scores (SPEC 7.4): q e4m3 [T, H_I, D_I]; k_cache e4m3 ragged [rows, D_I] / paged
        [nb, bs, D_I]; k_scale fp32 [rows] / [nb, bs]; weights fp32 [T, H_I] with the q scale folded in.
        Returns [T, max(seqlens_k)] fp32, -inf where not causal.
        Semantics: backends/reference/fp8_indexer_logits.py"""
        return self._doors["fp8_indexer_logits"](
            {"q": q, "k_cache": k_cache, "k_scale": k_scale, "weights": weights, "layout": layout},
        )

    def fp8_indexer_topk(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        k_scale: torch.Tensor,
        weights: torch.Tensor,
        layout: SeqLayout,
        topk: int,
    ) -> torch.Tensor:
        """The `topk` causal positions with the largest FP8 indexer logits (SPEC 7.5), int32 [T, topk],
        rule order, -1 padded. Semantics: backends/reference/fp8_indexer_topk.py"""
        return self._doors["fp8_indexer_topk"](
            {
                "q": q,
                "k_cache": k_cache,
                "k_scale": k_scale,
                "weights": weights,
                "layout": layout,
                "topk": topk,
            },
        )

    def fp8_mla_cache_quant(self, kv: torch.Tensor) -> torch.Tensor:
        """FlashMLA V3.2 FP8 cache rows (SPEC 7.6): kv [N, 576] float -> uint8 [N, 656].
        Semantics: backends/reference/fp8_mla_cache_quant.py"""
        return self._doors["fp8_mla_cache_quant"]({"kv": kv})

    def fp8_sparse_mla_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        indices: torch.Tensor,
        layout: SeqLayout,
        sm_scale: float,
        d_v: int,
        return_lse: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sparse MLA attention on the 656-byte FP8 cache (SPEC 7.7): q [T, H, 576], kv_cache uint8
        ragged [rows, 656] / paged [nb, bs, 656], d_v 512 -> (out [T, H, 512] dtype of q, lse [T, H] fp32).
        Semantics: backends/reference/fp8_sparse_mla_attention.py"""
        return self._doors["fp8_sparse_mla_attention"](
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
