"""The arithmetic of the layout-invariant mode (backends/invariant/engine.py, SPEC 12): exact products
under any K split, row subset or transpose; the stated precision; formula transcendentals within a few
ulp of torch and independent of an element's position; the fixed tree."""

from __future__ import annotations

import math

import pytest
import torch

from backends.invariant import engine as num
from glm5.parallel.invariant import layout_invariant


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


def test_a_k_split_summed_as_integer_partials_is_the_unsplit_product():
    a, b = torch.randn(9, 96, generator=_g()), torch.randn(96, 7, generator=_g(1))
    full = num.exact_matmul(a, b)
    parts = [(a[:, i : i + 24], b[i : i + 24]) for i in range(0, 96, 24)]  # K over 4 ranks
    # what the ranks exchange: the maxima (elementwise max) and the integer partials (summed, any order)
    row = torch.stack([pa.abs().amax(-1) for pa, _ in parts]).amax(0)
    col = torch.stack([pb.abs().amax(-2) for _, pb in parts]).amax(0)
    t, e, f = num.grid_bits(96), num.scale_exponent(row), num.scale_exponent(col)
    ints = [num.to_grid(pa, e[:, None], t).long() @ num.to_grid(pb, f[None, :], t).long() for pa, pb in parts]
    for order in (ints, ints[::-1], [ints[2], ints[0], ints[3], ints[1]]):
        assert torch.equal(num.scaled(sum(order), e, f, t, torch.float32), full)
    # the same through exact_matmul's hooks, as a rank calls it
    for r, (pa, pb) in enumerate(parts):
        got = num.exact_matmul(
            pa,
            pb,
            k_total=96,
            max_over=lambda m: row if m.shape == row.shape else col,
            sum_over=lambda p, r=r: sum(ints[:r]) + p + sum(ints[r + 1 :]),
        )
        assert torch.equal(got, full)
    plain = sum(pa @ pb for pa, pb in parts)  # a float split sum: not the unsplit bits here
    assert not torch.equal(plain, full)


def test_row_subsets_batches_and_transposes_are_the_same_bits():
    a, b = torch.randn(33, 200, generator=_g(2)), torch.randn(200, 17, generator=_g(3))
    full = num.exact_matmul(a, b)
    assert torch.equal(num.exact_matmul(a[5:6], b), full[5:6])
    assert torch.equal(num.exact_matmul(a[[3, 1, 30]], b[:, [2, 16]]), full[[3, 1, 30]][:, [2, 16]])
    assert torch.equal(num.exact_matmul(b.T.contiguous(), a.T.contiguous()), full.T)
    stacked = num.exact_matmul(torch.stack([a, a.flip(0)]), torch.stack([b, b]))
    assert torch.equal(stacked[0], full) and torch.equal(stacked[1], full.flip(0))


@pytest.mark.parametrize("k", [1, 7, 64, 6144])
def test_precision_is_t_bits_of_the_row_and_column_maxima(k):
    t = num.grid_bits(k)
    assert t == min(27, (62 - math.ceil(math.log2(k))) // 2)
    a, b = torch.randn(8, k, generator=_g(4)), torch.randn(k, 5, generator=_g(5))
    a[3] = 0  # a zero row works (e = 0) and gives zeros
    got = num.exact_matmul(a, b).double()
    want = a.double() @ b.double()
    # each input moves at most half a grid step 2^(e - t); fp32 rounding of the result on top
    bound = k * 2.0**-t * (a.abs().amax(1, keepdim=True).double() * 2 * b.abs().amax(0).double())
    assert ((got - want).abs() <= bound + want.abs() * 2**-23).all()
    assert torch.equal(got[3], torch.zeros(5, dtype=torch.float64))


def test_bf16_inputs_give_the_output_dtype():
    a, b = torch.randn(4, 32, generator=_g(6)).bfloat16(), torch.randn(32, 3, generator=_g(7)).bfloat16()
    out = num.exact_matmul(a, b)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, (a.double() @ b.double()).bfloat16())


@pytest.mark.parametrize(
    "ours, theirs, lo, hi",
    [
        (num.exp, torch.exp, -87.0, 88.0),
        (num.sigmoid, torch.sigmoid, -30.0, 30.0),
        (num.silu, torch.nn.functional.silu, -30.0, 30.0),
        (num.log, torch.log, 1e-30, 1e30),
    ],
)
def test_transcendentals_within_an_ulp_or_two_of_the_correctly_rounded_value(ours, theirs, lo, hi):
    x = torch.rand(200_000, generator=_g(8)) * (hi - lo) + lo
    if ours is num.log:
        x = torch.exp(torch.rand(200_000, generator=_g(8)) * 138 - 69)
    got, want = ours(x), theirs(x.double()).float()
    assert _ulps(got, want) <= (1 if ours is num.exp else 2)  # fp32 formulas (SPEC 12)
    assert _ulps(got, theirs(x)) <= 4  # and near torch's own fp32 kernel


def test_transcendental_edges():
    x = torch.tensor([-math.inf, -1e4, 0.0, 1e4, math.inf, math.nan])
    assert num.exp(x)[:5].tolist() == [0.0, 0.0, 1.0, math.inf, math.inf] and num.exp(x)[5].isnan()
    assert num.log(torch.tensor([0.0, 1.0, math.inf]).float()).tolist() == [-math.inf, 0.0, math.inf]
    assert num.log(torch.tensor([-1.0])).isnan().all()
    ang = torch.rand(10_000, generator=_g(9), dtype=torch.float64) * 1e5
    assert (num.sin(ang) - torch.sin(ang)).abs().max() < 1e-12
    assert (num.cos(ang) - torch.cos(ang)).abs().max() < 1e-12


@pytest.mark.parametrize("fn", [num.exp, num.sigmoid, num.silu, num.log, num.cos])
def test_an_elements_bits_do_not_depend_on_its_position_or_the_length(fn):
    x = torch.rand(1037, generator=_g(10)) * 20 + 0.01
    full = fn(x)
    for start, n in [(0, 1), (5, 3), (100, 17), (1000, 37), (3, 1031)]:
        assert torch.equal(fn(x[start : start + n].clone()), full[start : start + n])


def test_tree_sum_is_a_fixed_tree_whose_aligned_blocks_are_subtrees():
    x = torch.randn(5, 1000, generator=_g(11))
    s = num.tree_sum(x, -1)
    assert torch.equal(num.tree_sum(x[2:3], -1), s[2:3])
    assert torch.equal(num.tree_sum(x.T.contiguous(), 0), s)
    padded = torch.cat([x, torch.zeros(5, 24)], -1)  # the tree pads to 1024 with zeros itself
    halves = num.tree_sum(padded[:, :512], -1) + num.tree_sum(padded[:, 512:], -1)
    assert torch.equal(halves, s)  # two aligned halves: the tree's last level
    torch.testing.assert_close(s, x.double().sum(-1).float())


def test_the_mode_reroutes_the_models_arithmetic():
    a, w = torch.randn(37, 64, generator=_g(12)), torch.randn(48, 64, generator=_g(13))
    with layout_invariant():
        full = torch.sigmoid(torch.nn.functional.linear(a, w))
        part = torch.sigmoid(torch.nn.functional.linear(a[:5], w))
        sm = torch.softmax(a, -1)
        mean = a.pow(2).mean(-1)
    assert torch.equal(full[:5], part)
    assert torch.equal(full, num.sigmoid(num.exact_matmul(a, w.T)))
    assert torch.equal(sm, num.softmax(a, -1))
    assert torch.equal(mean, num.tree_sum(a * a, -1) / 64)


@pytest.mark.parametrize("block_size", [None, 4])
def test_the_cpu_attention_has_its_own_invariant_path_with_the_specs_bits(block_size):
    """In the mode the cpu backend's sparse_mla_attention runs its own blocks (no reference call, counted)
    and gives the bits SPEC 12 writes down, which the reference gives too."""
    from backends.counters import REFERENCE_CALLS
    from backends.cpu.sparse_mla_attention import sparse_mla_attention as cpu_attention
    from backends.reference.sparse_mla_attention import sparse_mla_attention as ref_attention
    from tests.backends.reference._cases import pack

    keys = [torch.randn(s, 24, generator=_g(20 + s)) for s in (9, 5, 0)]
    cache, layout = pack(keys, [3, 2, 1], block_size=block_size, fill=0.0)
    q = torch.randn(6, 4, 24, generator=_g(21))
    idx = torch.randint(-1, 10, (6, 7), generator=_g(22), dtype=torch.int32)  # -1 and out of range too
    idx[4] = -1  # a query with no valid key
    before = REFERENCE_CALLS["sparse_mla_attention"]
    with layout_invariant():
        out, lse = cpu_attention(q, cache, idx, layout, 0.2, 16)
        assert REFERENCE_CALLS["sparse_mla_attention"] == before
        ref_out, ref_lse = ref_attention(q, cache, idx, layout, 0.2, 16)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert torch.isneginf(lse[4]).all() and not out[4].any()
    normal, _ = cpu_attention(q, cache, idx, layout, 0.2, 16)
    torch.testing.assert_close(out, normal)


def test_a_weights_cached_grid_follows_every_write():
    """The weight side of a product is cached, and served only while the weight holds the same values:
    a write through the parameter, one through `.data` and one that keeps the version counter (as
    FSDP2's all-gather into the unsharded parameter does), also to the experts the cpu backend's
    grouped_matmul receives through the custom op, are all seen by the next forward."""
    from glm5.core.config import GLM5Config
    from glm5.core.model import GLM5ForCausalLM

    ids = torch.randint(0, 512, (1, 12), generator=_g(30))

    def forward(m):
        with torch.no_grad(), layout_invariant(m.backend):
            return m(ids).logits

    model = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="cpu")
    model.init_weights(0)
    forward(model)  # fills the cache
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.down_proj", "o_proj.weight")):
                p.mul_(1.5)
            elif name.endswith("kv_b_proj.weight"):
                p.data.mul_(1.5)
            elif name.endswith(("experts.gate_proj", "q_a_proj.weight")):
                with torch.autograd._unsafe_preserve_version_counter(p):
                    p.mul_(1.5)
    fresh = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="cpu")
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(forward(model), forward(fresh))


def test_fp32_and_narrower_transcendentals_never_widen_to_fp64(monkeypatch):
    """exp / log / sigmoid / silu of fp32, bf16 and fp16 run in fp32 (what Ascend's vector unit and a GPU's
    fp32 units have): no fp64 tensor is made; bf16 / fp16 are the fp32 formula rounded once; the edges of
    fp32's range give 0, subnormals and inf as the correctly rounded exp does."""
    made = []
    real = torch.Tensor.double

    def spy(self, *a, **k):
        made.append(self.shape)
        return real(self, *a, **k)

    x = torch.cat([torch.linspace(-110, 95, 20_001), torch.tensor([-math.inf, math.inf, -3e38, 3e38])])
    monkeypatch.setattr(torch.Tensor, "double", spy)
    outs = {
        dt: [f(x.to(dt)) for f in (num.exp, num.sigmoid, num.silu)] for dt in (torch.float32, torch.bfloat16)
    }
    logs = num.log(x.abs())
    monkeypatch.undo()
    assert made == []
    for got, f in zip(outs[torch.bfloat16], (num.exp, num.sigmoid, num.silu), strict=True):
        want = f(x.to(torch.bfloat16).float()).bfloat16()
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # silu(-inf) is NaN
    exp32 = outs[torch.float32][0]
    assert _ulps(exp32, torch.exp(x.double()).float()) <= 1  # subnormal results and overflow included
    assert _ulps(logs[:-4], torch.log(x.abs().double()).float()[:-4]) <= 2


def test_ropes_cos_and_sin_from_integer_turns_are_within_a_few_ulp_and_use_no_fp64():
    """SPEC 12 RoPE: the angle p w_i as exact integer turns, then fp32 only. Against fp64 cos / sin of the
    same angles at GLM-5's rope width and theta, up to and past its 202,752 positions; position 0 exact."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Dtypes(TorchDispatchMode):
        seen: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.seen.add(t.dtype)
            return out

    pos = torch.cat([torch.arange(0, 4096), torch.randint(0, 1 << 24, (8192,), generator=_g(11))])
    pos[-1] = (1 << 24) - 1
    for dim, theta in ((64, 1e6), (64, 1e4), (16, 10_000.0)):
        num.rope_cos_sin(pos[:1], dim, theta)  # the host's constants, made once
        with Dtypes() as seen:
            cos, sin = num.rope_cos_sin(pos, dim, theta)
        assert torch.float64 not in seen.seen and cos.dtype == sin.dtype == torch.float32
        inv = 1.0 / torch.tensor(theta, dtype=torch.float64) ** (torch.arange(0, dim, 2).double() / dim)
        ang = pos.double()[:, None] * inv[None, :]
        assert (cos.double() - ang.cos()).abs().max() < 2.5e-7  # about 4 fp32 ulp at 1
        assert (sin.double() - ang.sin()).abs().max() < 2.5e-7
        small = (ang > 0) & (ang < 1e-2)  # sin's relative error where it is small
        assert ((sin.double() - ang.sin()).abs() / ang.sin())[small].max() < 5e-7
        assert cos[0].eq(1).all() and sin[0].eq(0).all()


def test_the_model_takes_ropes_integer_turns_in_the_mode():
    from glm5.core.layers import rope_angles

    pos = torch.arange(0, 300)
    with layout_invariant():
        inv = rope_angles(pos, 64, 1e6)
    normal = rope_angles(pos, 64, 1e6)
    assert all(torch.equal(a, b) for a, b in zip(inv, num.rope_cos_sin(pos, 64, 1e6)))
    assert not torch.equal(inv[1], normal[1])  # the normal mode's fp64 table: other low bits
