"""The cpu backend's FP8 ops (SPEC 7) against the reference: bit for bit where the reference's result is
exact or its order reproducible (quantizers, block / grouped GEMMs, indexer top-k), within the contract
tolerance elsewhere; partial last K / N blocks, ties across the top-k cut with more keys than topk, NaN
in every unused cache row; the reference never runs inside a cpu op; the FP8 rollout uses the cpu ops."""

from __future__ import annotations

import pytest
import torch

from backends.counters import REFERENCE_CALLS
from backends.cpu._fp8 import decode
from conformance.cases._fp8 import activations, indexer_inputs, mla_cache, weights
from conformance.cases.sparse_mla_attention import GLM5_SM_SCALE, causal_indices


def _run(cpu, op, *args):
    before = sum(REFERENCE_CALLS.values())
    out = getattr(cpu, op)(*args)
    assert sum(REFERENCE_CALLS.values()) == before, f"{op} called the reference"
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decode_is_the_cast_for_every_code(dtype):
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).to(dtype)
    got = decode(codes, dtype)
    nan = torch.isnan(want)
    assert int(nan.sum()) == 2 and torch.equal(torch.isnan(got), nan)
    assert torch.equal(_bits(got[~nan]), _bits(want[~nan]))  # -0.0 and subnormals included


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quant_group_bitwise(cpu, ref, dtype, ue8m0):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(40, 2000, generator=g) * torch.logspace(-4, 3, 40)[:, None]).to(dtype)
    x[3] = 0  # amax at the floor
    for group_size, eps in ((128, 1e-4), (64, 1e-10), (2000, 1e-4)):
        got = _run(cpu, "fp8_quant_group", x, group_size, eps, ue8m0)
        want = ref.fp8_quant_group(x, group_size, eps, ue8m0)
        assert torch.equal(_bits(got[0]), _bits(want[0])) and torch.equal(_bits(got[1]), _bits(want[1]))


@pytest.mark.parametrize("m,k,n", [(300, 1000, 260), (8, 6144, 256), (1, 129, 7)])
def test_block_matmul_bitwise(cpu, ref, m, k, n):
    """Row chunks (M 300 > 256), partial last K and N blocks, GLM-5's K 6144; fp32 out shows every bit."""
    g = torch.Generator().manual_seed(m)
    x_q, x_s = activations(g, m, k, ue8m0=m == 8)
    w_q, w_s = weights(g, n, k)
    w_s[:, 1::2] *= 2.0**12  # block scales far apart: promotion order and placement both visible
    bias = torch.randn(n, generator=g)
    for b, dt in ((None, torch.float32), (bias, torch.float32), (bias, torch.bfloat16)):
        got = _run(cpu, "fp8_block_matmul", x_q, x_s, w_q, w_s, b, dt)
        assert torch.equal(_bits(got), _bits(ref.fp8_block_matmul(x_q, x_s, w_q, w_s, b, dt)))
    w_t = w_q.T.contiguous().T  # a transposed weight and a strided activation: the same bits
    x_st = torch.cat([x_q.view(torch.uint8), x_q.view(torch.uint8)], 1).view(x_q.dtype)[:, ::2]
    x_st.view(torch.uint8).copy_(x_q.view(torch.uint8))
    got = _run(cpu, "fp8_block_matmul", x_st, x_s, w_t, w_s, None, torch.float32)
    assert torch.equal(_bits(got), _bits(ref.fp8_block_matmul(x_q, x_s, w_q, w_s, None, torch.float32)))


def test_nan_codes_reach_the_gemm_outputs_as_in_the_reference(cpu, ref):
    """NaN codes are outside the quantizers' contract, but a NaN operand must not read as a number (the
    fast decode's re-biased bits would say 480); also found at odd storage offsets (`has_nan_code`)."""
    g = torch.Generator().manual_seed(9)
    x_q, x_s = activations(g, 5, 300)
    w_q, w_s = weights(g, 3, 140, 300)
    x_q[2, 131] = float("nan")
    w_q[1, 7, 5] = float("nan")
    offs = torch.tensor([0, 1, 4, 5], dtype=torch.int32)  # expert 1's rows start at an odd offset
    got = _run(cpu, "fp8_grouped_matmul", x_q, x_s, w_q, w_s, offs, torch.float32)
    want = ref.fp8_grouped_matmul(x_q, x_s, w_q, w_s, offs, torch.float32)
    assert torch.isnan(want).any() and torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(_bits(got.nan_to_num()), _bits(want.nan_to_num()))


def test_grouped_matmul_bitwise(cpu, ref):
    g = torch.Generator().manual_seed(1)
    counts = [0, 5, 1, 0, 9, 3]
    x_q, x_s = activations(g, sum(counts), 640, ue8m0=True)
    w_q, w_s = weights(g, len(counts), 130, 640)
    offs = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    got = _run(cpu, "fp8_grouped_matmul", x_q, x_s, w_q, w_s, offs, torch.float32)
    assert torch.equal(_bits(got), _bits(ref.fp8_grouped_matmul(x_q, x_s, w_q, w_s, offs, torch.float32)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_cache_quant_bitwise(cpu, ref, dtype):
    g = torch.Generator().manual_seed(2)
    kv = (torch.randn(700, 576, generator=g) * 0.1).clamp(-1, 1)  # two row slices
    kv[0, :128] = 0
    kv[1, 256] = 448.0 * 2.0**-3
    kv[2, 384:512] *= 300.0
    kv = kv.to(dtype)
    assert torch.equal(_run(cpu, "fp8_mla_cache_quant", kv), ref.fp8_mla_cache_quant(kv))


def _indexer_cases(g):
    return [
        # decode + MTP, ragged, more keys than topk; unused rows NaN codes and NaN scales
        (indexer_inputs(g, [1, 3], [4500, 2600], h_i=32), 2048),
        # paged, shuffled blocks, a ReLU plateau: thousands of zero logits tied across the cut
        (indexer_inputs(g, [2, 1], [3000, 2400], block_size=64, plateau=0.05, weights_sign="positive"), 2048),
        # prefill rows in two 64-query blocks, fewer keys than topk for the first rows
        (indexer_inputs(g, [70], [70], block_size=13), 16),
    ]


def test_indexer_topk_bitwise_with_ties_and_nan_rows(cpu, ref):
    g = torch.Generator().manual_seed(3)
    for a, topk in _indexer_cases(g):
        assert torch.isnan(a["k_scale"]).any()  # the caches hold unused NaN rows
        args = (a["q"], a["k_cache"], a["k_scale"], a["weights"], a["layout"], topk)
        got = _run(cpu, "fp8_indexer_topk", *args)
        assert torch.equal(got, ref.fp8_indexer_topk(*args))


def test_indexer_logits_within_tolerance(cpu, ref):
    g = torch.Generator().manual_seed(4)
    for a, _ in _indexer_cases(g):
        args = (a["q"], a["k_cache"], a["k_scale"], a["weights"], a["layout"])
        got, want = _run(cpu, "fp8_indexer_logits", *args), ref.fp8_indexer_logits(*args)
        assert torch.equal(torch.isneginf(got), torch.isneginf(want)) and not torch.isnan(got).any()
        fin = torch.isfinite(want)
        torch.testing.assert_close(got[fin], want[fin], rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [None, 61])
def test_sparse_attention_within_tolerance_on_nan_caches(cpu, ref, block_size):
    g = torch.Generator().manual_seed(5)
    q_lens, k_lens = [1, 2], [4500, 2300]
    layout, cache = mla_cache(g, q_lens, k_lens, block_size=block_size)
    assert (cache.reshape(-1, 656) == 0xFF).all(dim=1).any()  # NaN rows nobody may read
    q = torch.randn(3, 16, 576, generator=g).clamp(-1, 1).bfloat16()
    idx = causal_indices(g, q_lens, k_lens, 2048)
    idx[1, ::3] = -1
    idx[1, 1::7] = 5000  # out of range: skipped
    idx[2] = -1  # no valid key: out 0, lse -inf
    args = (q, cache, idx, layout, GLM5_SM_SCALE, 512)
    out, lse = _run(cpu, "fp8_sparse_mla_attention", *args)
    r_out, r_lse = ref.fp8_sparse_mla_attention(*args)
    assert not torch.isnan(out).any() and torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.isneginf(lse[2]).all() and torch.isfinite(lse[:2]).all()
    torch.testing.assert_close(out.float(), r_out.float(), rtol=3 / 128, atol=8e-4)
    torch.testing.assert_close(lse, r_lse, rtol=8 / 65536, atol=1e-6)
    no_lse = _run(cpu, "fp8_sparse_mla_attention", *args, False)
    assert no_lse[1] is None and torch.equal(no_lse[0], out)


def test_fp8_rollout_backend_is_the_cpu_itself(cpu):
    """quant.fp8.fp8_backend keeps a backend that serves the FP8 ops, and routes one that lacks them to
    the reference (reported by the rollout check)."""
    from quant.fp8 import FP8_OPS, fp8_backend

    assert fp8_backend(cpu) is cpu

    class NoFP8(type(cpu)):
        name = "cpu-no-fp8"
        ops = {k: v for k, v in type(cpu).ops.items() if k not in FP8_OPS}

    assert fp8_backend(NoFP8()).name == "reference"


def test_fp8_rollout_on_the_cpu_backend_never_calls_the_reference():
    from glm5.core.config import GLM5Config
    from glm5.core.model import GLM5ForCausalLM
    from glm5.train.rl.rollout import rollout_check

    m = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="cpu")
    m.init_weights(0)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    before = sum(REFERENCE_CALLS.values())
    r = rollout_check(m.eval(), ids, 2, invariant=False, rollout_precision="fp8")
    assert r["fp8_backend"] == "cpu" and r["fp8_cache"]["kv_cache_dtype"] == "fp8_ds_mla"
    assert sum(REFERENCE_CALLS.values()) == before
