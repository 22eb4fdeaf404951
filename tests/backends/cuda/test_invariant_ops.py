"""The layout-invariant mode (SPEC 12) on the cuda backend: every op the mode calls gives, in the mode, the
reference backend's bits in the mode. The exact products run on the Triton digit kernel (an exact engine:
all give the same integers; under TRITON_INTERPRET=1 its int8 `tl.dot` is NumPy's integer matmul, exact
as a GPU's), so bitwise equality is what the SPEC promises, not a tolerance. Each comparison can fail: the
normal mode's result differs on the same inputs, or the launches show the mode's path ran.

Inputs as the ops' own tests make them (tests/backends/cuda/test_<op>.py): more keys than topk, -1,
out-of-range and duplicated indices, an empty row, NaN filler rows that must never be read, paged caches
with odd block sizes and shuffled blocks.
Semantics: backends/reference/<op>.py in the mode (SPEC 12 "Backend ops")
"""

from __future__ import annotations

import pytest
import torch

from backends import registry
from glm5.parallel.invariant import OPS, NotLayoutInvariant, layout_invariant, require
from tests.backends.cuda import test_indexer_topk as indexer_cases
from tests.backends.cuda import test_no_host_reads as host_reads
from tests.backends.cuda import test_sparse_mla_attention as attention_cases
from tests.backends.cuda.test_grouped_matmul import _offsets, _quant


@pytest.fixture(scope="module")
def ref():
    return registry.get("reference")


def _on(device, xs):
    return [x.to(device) if isinstance(x, torch.Tensor) else x for x in xs]


def _cpu(out):
    return tuple(x.cpu() for x in out) if isinstance(out, tuple) else out.cpu()


def _runs(be, ref, device, op: str, *args, normal: bool = True, **kw):
    """(the cuda backend in the mode, the reference in the mode, the cuda backend in the normal mode or
    None)."""
    dev_kw = dict(zip(kw, _on(device, kw.values()), strict=True))
    with layout_invariant(be):
        got = _cpu(getattr(be, op)(*_on(device, args), **dev_kw))
    with layout_invariant(ref):
        want = getattr(ref, op)(*args, **kw)
    return got, want, _cpu(getattr(be, op)(*_on(device, args), **dev_kw)) if normal else None


def _equal(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_cuda_declares_the_mode_for_every_op_it_calls(cuda):
    require(cuda)
    assert all(cuda.capabilities(op).layout_invariant for op in (*OPS, "indexer_logits"))


@pytest.mark.parametrize("name", ["onnxruntime"])
def test_a_backend_without_it_is_refused_in_one_line(name):
    backend = registry.loaded(name)
    if backend is None:
        pytest.skip(f"{name} does not load here")
    with pytest.raises(NotLayoutInvariant) as exc:
        with layout_invariant(backend):
            pass
    msg = str(exc.value)
    assert msg.startswith(f"backend: {name}'s sparse_mla_attention does not declare layout_invariant")
    assert "\n" not in msg


CACHES = [(None, torch.float32), (7, torch.float32), (16, torch.float16), (None, torch.bfloat16)]


@pytest.mark.parametrize("block_size,dtype", CACHES)
def test_sparse_mla_attention(cuda, ref, device, launches, block_size, dtype):
    """topk 64 of up to 250 keys; bf16 too, whose normal kernel is device-only: the mode's path does no
    bf16 arithmetic in Triton (the digits are int8)."""
    q, cache, idx, layout = attention_cases.make(
        [3, 1, 2], [250, 90, 33], heads=2, d_qk=24, topk=64, dtype=dtype, block_size=block_size
    )
    args = (q, cache, idx, layout, 0.0625, 16)
    bf16 = dtype == torch.bfloat16
    got, want, normal = _runs(cuda, ref, device, "sparse_mla_attention", *args, normal=not bf16)
    assert _equal(got, want)
    assert not torch.isnan(got[0]).any() and torch.isneginf(got[1][0]).all()  # row 0: no valid index
    assert launches()["invariant_gemm"] == 2  # one block of queries: scores, then values
    if normal is not None:
        assert not torch.equal(normal[0], want[0])


def test_sparse_mla_attention_at_glm5_widths(cuda, ref, device):
    """d_qk 576 (512 latent + 64 RoPE), d_v 512: the scores' K and the values' N of GLM-5."""
    q, cache, _, layout = attention_cases.make([1], [200], heads=2, d_qk=576, block_size=64)
    idx = torch.randint(-1, 203, (1, 64), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    args = (q, cache, idx, layout, 576**-0.5, 512)
    got, want, normal = _runs(cuda, ref, device, "sparse_mla_attention", *args)
    assert _equal(got, want) and torch.isfinite(got[1]).all()
    assert not torch.equal(normal[0], want[0])


@pytest.mark.parametrize("block_size", [None, 7])
@pytest.mark.parametrize("ints", [False, True], ids=["randn", "ties"])
def test_indexer_topk_and_logits(cuda, ref, device, launches, block_size, ints):
    """topk 64 of up to 260 causal keys; `ties`: small-integer inputs, exact in both modes, so equal
    logits meet at the cut and the lower position must come first."""
    q, cache, w, layout = indexer_cases.make(
        [4, 1, 3, 0], [260, 180, 40, 7], h_i=2, d_i=16, block_size=block_size, ints=ints
    )
    got, want, normal = _runs(cuda, ref, device, "indexer_topk", q, cache, w, layout, 64)
    assert torch.equal(got, want)
    calls = launches()
    assert calls["topk"] == 1 and calls["invariant_gemm"] == 1 and calls["indexer_topk"] == 1  # normal run's
    got, want, normal = _runs(cuda, ref, device, "indexer_logits", q, cache, w, layout)
    assert torch.equal(got, want)
    assert torch.equal(normal, want) == ints  # random logits: the normal mode's sum order shows


@pytest.mark.parametrize("block_size", [None, 4])
def test_requests_without_keys(cuda, ref, device, block_size):
    """A request with no key at all (its block-table row unused): out 0 and lse -inf, indices -1."""
    q, cache, idx, layout = attention_cases.make(
        [2, 2], [20, 0], heads=2, d_qk=16, topk=8, block_size=block_size
    )
    got, want, _ = _runs(
        cuda, ref, device, "sparse_mla_attention", q, cache, idx, layout, 0.0625, 8, normal=False
    )
    assert _equal(got, want) and torch.isneginf(got[1][2:]).all()
    q, cache, w, layout = indexer_cases.make([2, 3], [0, 5], h_i=2, d_i=8, block_size=block_size)
    got, want, _ = _runs(cuda, ref, device, "indexer_topk", q, cache, w, layout, 8, normal=False)
    assert torch.equal(got, want) and (got[:2] == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_float(cuda, ref, device, dtype):
    """An empty expert, and rows past the last offset (no expert: zeros)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(11, 40, generator=g).to(dtype), torch.randn(3, 24, 40, generator=g).to(dtype)
    bf16 = dtype == torch.bfloat16  # its normal kernel is device-only (the mode's digits are int8)
    got, want, normal = _runs(cuda, ref, device, "grouped_matmul", x, w, _offsets([4, 0, 5]), normal=not bf16)
    assert torch.equal(got, want) and not got[9:].any()
    if normal is not None:
        assert not torch.equal(normal, want)


@pytest.mark.parametrize("variant,group_size", [("w8a8", None), ("w4a8", 32)])
def test_grouped_matmul_quantized_is_unchanged_by_the_mode(cuda, ref, device, variant, group_size):
    a = _quant([5, 0, 3], 24, 64, variant, group_size, seed=3)
    got, want, normal = _runs(cuda, ref, device, "grouped_matmul", **a, out_dtype=torch.float32)
    assert torch.equal(got, want) and torch.equal(normal, want)


def test_silu_and_mul(cuda, ref, device):
    x = torch.randn(5, 2 * 96, generator=torch.Generator().manual_seed(0)) * 4
    got, want, normal = _runs(cuda, ref, device, "silu_and_mul", x)
    assert torch.equal(got, want) and not torch.equal(normal, want)


def test_attention_and_indexer_read_nothing_back_to_the_host(cuda, ref, device, monkeypatch):
    """The mode finds each query's rows from the layout's tensors on the device, as the kernels do."""
    q, cache, idx, layout = attention_cases.make([3, 1, 2], [250, 90, 33], heads=2, d_qk=24, block_size=7)
    qi, kc, w, lay_i = indexer_cases.make([4, 1, 3, 0], [260, 180, 40, 7], h_i=2, d_i=16, block_size=13)
    with layout_invariant(ref):
        want_attn = ref.sparse_mla_attention(q, cache, idx, layout, 0.0625, 16)
        want_top = ref.indexer_topk(qi, kc, w, lay_i, 32)
    trusted, trusted_i = host_reads._trusted(layout, device), host_reads._trusted(lay_i, device)
    host_reads._no_host(monkeypatch)
    with layout_invariant(cuda):
        out = cuda.sparse_mla_attention(*_on(device, (q, cache, idx)), trusted, 0.0625, 16)
        top = cuda.indexer_topk(*_on(device, (qi, kc, w)), trusted_i, 32)
    assert _equal(_cpu(out), want_attn) and torch.equal(top.cpu(), want_top)


def test_the_tiny_model_gives_the_references_bits():
    """The tie-heavy tiny model of tests/glm5/test_invariant_layouts.py (one row of 40 tokens, DSA top-k 16
    of them): logits and every layer's top-k set on cuda in the mode, prefill and prefill + decode, are the
    reference's prefill bits in the mode; the normal mode's logits are not."""
    from tests.glm5.test_invariant_layouts import _decoded, _forward, _ids, _model, _same

    ids = _ids()[:1]
    want = _forward(_model("reference"), ids, True)
    model = _model("cuda")
    assert _same(_forward(model, ids, True), want)
    assert _same(_decoded(model, ids, 38, True), want)  # two decode steps
    assert not torch.equal(_forward(model, ids, False)[0], want[0])
