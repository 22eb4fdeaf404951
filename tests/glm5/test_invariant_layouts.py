"""The layout-invariant mode (SPEC 12) on the tiny model, tie-heavy inputs (weights of 17 distinct values,
repeated tokens), index_topk < tokens so DSA is sparse: logits and per-layer top-k sets are the same
bits at TP 1 / 2 / 4, EP 2, batch 1 vs 4, prefill-all vs prefill + decode, on the reference and cpu
backends, and the same bits under ATEN_CPU_CAPABILITY=native / avx2 / default and every exact integer
GEMM; the normal mode differs on the same inputs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from backends.invariant.gemm import GEMM_ENV
from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.parallel import plan
from glm5.parallel.group import Single, TorchGroup
from glm5.parallel.invariant import NotLayoutInvariant, layout_invariant
from tests.ranks import run_ranks

BACKENDS = ("reference", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model(backend: str, **overrides) -> GLM5ForCausalLM:
    """Weights k / 256 (norms 1 + k / 64), k uniform in [-8, 8]: few distinct values, so equal products and
    near-ties everywhere. Drawn as integers: torch.randn's vectorised Box-Muller gives other bits under
    another ATEN_CPU_CAPABILITY, which would compare two different models. `overrides`: of the tiny
    preset's config."""
    m = GLM5ForCausalLM(GLM5Config.from_preset("tiny", **overrides), backend=backend)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            k = torch.randint(-8, 9, p.shape, generator=g).float()
            if name.endswith("norm.bias"):
                k.zero_()
            elif name.endswith("e_score_correction_bias"):
                k /= 64
            elif p.dim() == 1:
                k = 1 + k / 64
            else:
                k /= 256
            p.copy_(k)
    return m


def _ids() -> torch.Tensor:
    # 4 rows of 40 tokens (index_topk 16): a repeated phrase, so equal scores meet at the top-k cut
    base = torch.randint(0, 512, (4, 8), generator=torch.Generator().manual_seed(1))
    return base.repeat(1, 5)


@torch.no_grad()
def _forward(model, ids, invariant: bool):
    ctx = layout_invariant(model.backend) if invariant else _nullctx()
    with ctx:
        out = model(ids, return_topk=True)
    return out.logits, [t.clone() for t in out.topk]


class _nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _same(a, b) -> bool:
    (la, ta), (lb, tb) = a, b
    return torch.equal(la, lb) and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


@torch.no_grad()
def _decoded(model, ids, prefix: int, invariant: bool):
    """Prefill `prefix` tokens, then decode the rest one token per step: (logits, per-layer top-k)."""
    ctx = layout_invariant(model.backend) if invariant else _nullctx()
    b, s = ids.shape
    with ctx:
        cache = model.new_cache(b, s)
        first = model(ids[:, :prefix], cache, return_topk=True)
        logits, topk = [first.logits], [[t.view(b, prefix, -1)] for t in first.topk]
        for i in range(prefix, s):
            o = model(ids[:, i : i + 1], cache, return_topk=True)
            logits.append(o.logits)
            for layer, t in zip(topk, o.topk, strict=True):
                layer.append(t.view(b, 1, -1))
    return torch.cat(logits, 1), [torch.cat(layer, 1).reshape(b * s, -1) for layer in topk]


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_and_prefill_decode_bitwise(backend):
    assert_batch_and_decode_bitwise(_model(backend), _ids())


def assert_batch_and_decode_bitwise(model, ids: torch.Tensor) -> tuple:
    """In the mode: row 2 alone is its row of the batch of 4 (logits and every layer's top-k rows), and
    prefill + decode is the prefill-all bits. Returns the batch's (logits, top-k sets)."""
    full = _forward(model, ids, True)
    one = _forward(model, ids[2:3], True)
    assert torch.equal(one[0][0], full[0][2])
    rows = slice(2 * 40, 3 * 40)
    assert all(torch.equal(a, b[rows]) for a, b in zip(one[1], full[1], strict=True))
    assert _same(_decoded(model, ids, 24, True), full)
    return full


def test_the_mode_refuses_a_backend_that_does_not_declare_it():
    class Undeclared:
        name = "fake"

        def capabilities(self, op):
            return None

    with pytest.raises(NotLayoutInvariant, match="fake's sparse_mla_attention"):
        with layout_invariant(Undeclared()):
            pass


def _layouts_rank(rank: int, world: int, backend: str, normal_too: bool) -> dict:
    out = {}
    g = TorchGroup()
    model = _model(backend)
    plan.apply(model, tp=g, ep=g)  # tp + ep: experts whole per rank (tp-split experts are refused)
    out["tp+ep"] = _forward(model, _ids(), True)
    if normal_too:
        out["tp+ep normal"] = _forward(model, _ids(), False)
        model = _model(backend)
        plan.apply(model, tp=Single(), ep=g)
        out["ep"] = _forward(model, _ids(), True)
        model = _model(backend)
        plan.apply(model, tp=g)
        with pytest.raises(NotLayoutInvariant, match="split them by expert"):
            _forward(model, _ids(), True)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp2_and_ep2_are_the_unsplit_bits_and_the_normal_mode_is_not(backend):
    model = _model(backend)
    ref, ref_normal = _forward(model, _ids(), True), _forward(model, _ids(), False)
    results = run_ranks(_layouts_rank, 2, backend, True)
    for r in results:
        assert _same(r["tp+ep"], ref)
        assert _same(r["ep"], ref)
    # the normal mode's row-parallel float sum moves low bits: the comparison above can fail
    assert not torch.equal(results[0]["tp+ep normal"][0], ref_normal[0])


def test_tp4_is_the_unsplit_bits():
    ref = _forward(_model("cpu"), _ids(), True)
    for r in run_ranks(_layouts_rank, 4, "cpu", False):
        assert _same(r["tp+ep"], ref)


_CHILD = """
import hashlib, torch
from backends.invariant.gemm import ENGINE
from tests.glm5.test_invariant_layouts import _model, _ids, _forward
h = hashlib.sha256()
for be in ("reference", "cpu"):
    logits, topk = _forward(_model(be), _ids(), True)
    for t in (logits, *topk):
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
print(torch.backends.cpu.get_cpu_capability(), ENGINE, h.hexdigest())
"""


def test_the_bits_are_the_same_under_every_cpu_capability_and_integer_gemm():
    """Exact arithmetic cannot depend on the instruction set or on which exact integer GEMM computes the
    products: native, avx2 and default (scalar) kernels, and the int8 digit products (torch._int_mm), the
    fp64 GEMMs and the plain int64 matmul, give the same logits and top-k sets on both backends."""
    hashes, isas = set(), []
    runs = [(c, None) for c in ("native", "avx2", "default")] + [("native", "int8"), ("default", "int64")]
    for capability, gemm in runs:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "ATEN_CPU_CAPABILITY": capability}
        if capability == "native":
            env.pop("ATEN_CPU_CAPABILITY")
        env.pop(GEMM_ENV, None)
        if gemm is not None:
            env[GEMM_ENV] = gemm
        res = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, cwd=ROOT, capture_output=True, text=True
        )
        assert res.returncode == 0, res.stderr[-2000:]
        isa, engine, digest = res.stdout.split()
        assert gemm is None or engine == gemm
        isas.append(f"{isa}/{engine}")
        hashes.add(digest)
    assert len({i.split("/")[0] for i in isas}) > 1, f"the capabilities did not switch kernels: {isas}"
    assert len(hashes) == 1, dict(zip(isas, hashes))


def _logprobs_rank(rank: int, world: int, sampled: torch.Tensor) -> torch.Tensor:
    from glm5.train.rl.rollout import sequence_logprobs

    model = _model("cpu")
    plan.apply(model, tp=TorchGroup(), ep=TorchGroup())  # the vocabulary-split head: logits gathered
    with torch.no_grad(), layout_invariant(model.backend):
        logp = sequence_logprobs(model, _ids()[:2, :8], sampled, 0.7)
        with pytest.raises(NotLayoutInvariant, match="vocabulary-split linear_cross_entropy"):
            model(_ids()[:2], labels=_ids()[:2])
    return logp


def test_the_trainers_logprobs_at_tp2_are_the_engines_and_the_fused_loss_is_refused():
    """In the mode the trainer's log-probs (whole sequences, TP 2, vocabulary-split head, log_softmax of
    the gathered logits) are the bits of the engine's (decode path, one process, unsplit); the fused
    linear cross-entropy (the backend op, or its vocabulary-split form) is refused with one error."""
    from glm5.train.rl.rollout import sample

    model = _model("cpu")
    with layout_invariant(model.backend):
        sampled, logp_engine = sample(model, _ids()[:2, :8], 6, temperature=0.7, generator=torch.Generator())
    for logp_train in run_ranks(_logprobs_rank, 2, sampled):
        assert torch.equal(logp_train, logp_engine)
    with torch.no_grad(), layout_invariant(model.backend):
        with pytest.raises(NotLayoutInvariant, match="^linear_cross_entropy: the fused loss"):
            model(_ids()[:2], labels=_ids()[:2])
