"""The cpu backend's bitwise claims hold on every x86-64 CPU, not only on the one CI ran on.

A BLAS or a vectorised ATen reduction sums in an order that depends on the CPU (AVX2, AVX-512, AMX; Intel
or AMD) and on the call's shapes, so the cpu backend gets the reference's bits only where they follow by
construction (docs/spec.md 4.1): exact arithmetic, or the reference's own scoring function on the same
block shapes. This file checks both halves: structurally (the indexers' logits come from the reference's
functions, called on the reference's blocks), and by running every exact-compared conformance case under
the ISA levels torch can be forced to here (`ATEN_CPU_CAPABILITY`, MKL's and oneDNN's instruction caps),
at GLM-5 widths (H_I 32 x D_I 128, more keys than topk).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import backends.cpu._fp8_index as cpu_fp8_index
import backends.cpu.indexer_topk as cpu_indexer_topk
from backends import SeqLayout
from backends.reference.fp8_indexer_logits import fp8_score_block, quantize_indexer_inputs
from backends.reference.indexer_logits import score_block

#: every op whose conformance outputs are compared bitwise on the cpu backend (conformance/cases OUTPUTS)
EXACT_OPS = "topk,indexer_topk,fp8_indexer_topk,dynamic_quant_int8,fp8_quant_group,fp8_mla_cache_quant"

ISA_LEVELS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default"},
}


def _glm5_width_inputs(seed: int, q_lens, k_lens, block_size=None):
    """H_I 32, D_I 128 indexer inputs whose logits hold many near-ties: keys from a few shared directions
    plus small noise, so thousands of logits sit within a few ulps of each other."""
    g = torch.Generator().manual_seed(seed)
    t, s = sum(q_lens), sum(k_lens)
    q = torch.randn(t, 32, 128, generator=g).bfloat16()
    base = torch.randn(8, 128, generator=g)
    k = (base[torch.randint(0, 8, (s,), generator=g)] + 1e-3 * torch.randn(s, 128, generator=g)).bfloat16()
    w = torch.randn(t, 32, generator=g) * 32**-0.5
    if block_size is None:
        return q, k, w, SeqLayout.from_lengths(q_lens, k_lens)
    nb = [-(-n // block_size) for n in k_lens]
    cache = torch.zeros(sum(nb), block_size, 128, dtype=k.dtype)
    rows, b0 = 0, 0
    for n, m in zip(k_lens, nb):
        flat = cache[b0 : b0 + m].view(-1, 128)
        flat[:n] = k[rows : rows + n]
        rows, b0 = rows + n, b0 + m
    return q, cache, w, SeqLayout.from_lengths(q_lens, k_lens, block_size=block_size)


@pytest.mark.parametrize("paged", [False, True])
def test_indexer_topk_glm5_widths_bitwise(cpu, ref, paged):
    """MTP decode (4 queries per request) and a 130-query prefill block pair, 4500-5000 keys, topk 2048:
    the shapes on which a separate mm + bmm scorer lost the reference's order on an AVX-512 Xeon."""
    q_lens, k_lens = [4, 4, 130], [4500, 5000, 4200]
    q, cache, w, lay = _glm5_width_inputs(11, q_lens, k_lens, 64 if paged else None)
    got = cpu.indexer_topk(q, cache, w, lay, 2048)
    want = ref.indexer_topk(q, cache, w, lay, 2048)
    assert torch.equal(got, want)


def test_indexer_scores_are_the_reference_function(cpu, monkeypatch):
    """By construction, not by luck: every logit the cpu indexer top-k ranks comes from the reference's
    `score_block`, called on at most 128 queries x 2048 keys (the reference's blocks)."""
    calls = []

    def spy(q, keys, weights, dots=None, out=None):
        calls.append((q.shape[0], keys.shape[0]))
        return score_block(q, keys, weights, dots=dots, out=out)

    monkeypatch.setattr(cpu_indexer_topk, "score_block", spy)
    q, cache, w, lay = _glm5_width_inputs(12, [3, 200], [3000, 2600])
    cpu.indexer_topk(q, cache, w, lay, 2048)
    assert calls and max(t for t, _ in calls) <= 128 and max(s for _, s in calls) <= 2048
    assert sum(s for t, s in calls if t == 3) == 3000  # the decode block scored all its keys


def test_fp8_indexer_scores_are_the_reference_function(cpu, ref, monkeypatch):
    calls = []

    def spy(*args):
        calls.append(args[0].shape[0])
        return fp8_score_block(*args)

    monkeypatch.setattr(cpu_fp8_index, "fp8_score_block", spy)
    q, cache, w, lay = _glm5_width_inputs(13, [4, 70], [3000, 2500])
    qq, kq, ks, wq = quantize_indexer_inputs(q.float(), cache.float(), w)
    got = cpu.fp8_indexer_topk(qq, kq, ks, wq, lay, 2048)
    assert calls and max(calls) <= 64
    assert torch.equal(got, ref.fp8_indexer_topk(qq, kq, ks, wq, lay, 2048))


@pytest.mark.parametrize("level", list(ISA_LEVELS))
def test_exact_conformance_cases_under_each_isa(tmp_path, level):
    """Every bitwise-compared conformance case (smoke, realistic GLM-5 shapes, adversarial, errors) on the
    cpu backend, in a fresh process whose ATen kernels (and MKL / oneDNN where capped) use `level`."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY",)}
    env.update(ISA_LEVELS[level], OMP_NUM_THREADS="1")
    report = tmp_path / "r.json"
    cmd = [
        sys.executable,
        "-m",
        "glm5.cli",
        "conformance",
        "--backend",
        "cpu",
        "--ops",
        EXACT_OPS,
        "--suite",
        "full",
        "--json",
        str(report),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(report.read_text())
    capability = data["environment"]["cpu"]["cpu_capability"]
    if level != "native":
        assert capability.lower() == ISA_LEVELS[level]["ATEN_CPU_CAPABILITY"].lower()


def test_indexer_topk_bits_do_not_follow_the_thread_count(cpu, ref):
    """The scores run on one intra-op thread inside the reference's function, so the cpu backend spreading
    query blocks over threads, and the reference at any thread count, give the same order."""
    q, cache, w, lay = _glm5_width_inputs(14, [4, 4, 140, 3], [4500, 5000, 4200, 2100], 64)
    n = torch.get_num_threads()
    try:
        got = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got[threads] = cpu.indexer_topk(q, cache, w, lay, 2048), ref.indexer_topk(q, cache, w, lay, 2048)
    finally:
        torch.set_num_threads(n)
    assert all(torch.equal(got[1][0], x) for pair in got.values() for x in pair)
