"""Bytes the Ascend sparse_mla_attention adapter copies out of the latent cache per call (one layer), at
GLM-5 decode shapes: on the contract's one-tensor cache for the route it takes now and for whole-request
packing (the route before), and on the split pools the backend declares (`AscendBackend.mla_cache`,
read in place as PA_BSND: no copy).

Counted by tests/backends/ascend/_copies.CacheCopies (a dispatch mode following the cache's storage;
views are free, the operator's own reads are not counted), on the CPU emulation: a byte count, not a
time, so it holds for the NPU too. Runs in the ascend-interpret env:
    TRITON_INTERPRET=1 GLM5_ASCEND_EMULATE=1 python bench/ascend/copies_sparse_mla.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

#: (name, q_lens, k_lens): decode at 128K, MTP (1 + 3 draft tokens) at 128K, 8 requests at 16K
SHAPES = (
    ("decode B1 S131072", [1], [131072]),
    ("mtp4 B1 S131072", [4], [131072]),
    ("decode B8 S16384", [1] * 8, [16384] * 8),
)
HEADS, TOPK, BLOCK = 64, 2048, 128


def _inputs(q_lens, k_lens):
    from backends import SeqLayout

    g = torch.Generator().manual_seed(0)
    nb = sum(-(-s // BLOCK) for s in k_lens)
    lay = SeqLayout.from_lengths(q_lens, k_lens, block_size=BLOCK, block_order=torch.randperm(nb).tolist())
    kv = torch.randn(nb, BLOCK, 576, generator=g).bfloat16()
    q = torch.randn(sum(q_lens), HEADS, 576, generator=g).bfloat16()
    rows = [
        torch.randperm(s - t + i + 1, generator=g)[:TOPK] for t, s in zip(q_lens, k_lens) for i in range(t)
    ]
    return q, kv, torch.stack(rows).to(torch.int32), lay


def main() -> None:
    os.environ.setdefault("GLM5_ASCEND_EMULATE", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from backends.ascend import AscendBackend
    from backends.ascend import sparse_mla_attention as sfa
    from backends.cache_layout import write_rows
    from tests.backends.ascend._copies import CacheCopies, record_operator

    be = AscendBackend()
    be.provider.module.npu_sparse_flash_attention = record_operator(be.provider, sfa.OP, [])
    fn = be.ops["sparse_mla_attention"].fn
    now_rule = sfa._compaction_cheaper
    print(f"H={HEADS} d_qk=576 d_v=512 topk={TOPK} block_size={BLOCK} bf16, one layer, return_lse=False")
    for name, q_lens, k_lens in SHAPES:
        q, kv, idx, lay = _inputs(q_lens, k_lens)
        got = {}
        for route, rule in (("whole requests (before)", lambda *a: True), ("now", now_rule)):
            sfa._compaction_cheaper = rule
            with CacheCopies(kv) as c:
                out, _ = fn(q, kv, idx, lay, 0.0625, 512, False)
            got[route] = (c.bytes, out)
        sfa._compaction_cheaper = now_rule
        buffer = torch.empty_like(kv)
        pools = be.mla_cache.view(buffer, BLOCK)
        write_rows(pools, torch.arange(kv.shape[0] * BLOCK), kv.view(-1, kv.shape[-1]))
        del kv
        with CacheCopies(buffer) as c:
            out, _ = fn(q, pools, idx, lay, 0.0625, 512, False)
        (b0, o0), (b1, o1) = got.values()
        same = torch.equal(o0, o1) and torch.equal(o1, out)
        print(
            f"{name:20s} cache {buffer.numel() * 2 / 1e6:8.1f} MB  copied before {b0 / 1e6:8.2f} MB  "
            f"now {b1 / 1e6:6.2f} MB  split pools {c.bytes / 1e6:4.2f} MB  same out: {same}"
        )


if __name__ == "__main__":
    main()
