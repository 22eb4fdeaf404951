"""Peak memory of converting a GLM-5-FP8-style checkpoint to the Ascend W8A8 recipe (issue 16): the streamed
converter (`glm5 quantize`, quant/stream.py: one decoder layer in memory at a time) against the whole-model
path in the same run (load the de-quantized float model, `quantize_model`, `export`).

The checkpoint: GLM-5's layer structure at small width (hidden --hidden, --experts routed experts of
--expert-dim, --layers layers plus the MTP layer, vocab 2048) with random weights, written once as FP8.
Each variant runs --runs times, each in a fresh process; the figure is the median peak RSS (VmHWM) above
the process's RSS after its imports, as a ratio of the whole-model path's, and against the checkpoint's
bf16 size. Both write the same checkpoint (tests/quant/test_stream.py checks it bitwise; here the tensor
files are compared by hash).

    OMP_NUM_THREADS=2 python bench/bench_quantize_stream.py [--layers 12] [--runs 3] [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import emit  # noqa: E402

VARIANTS = ("whole", "streamed")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(variant: str, src: str, out: str) -> None:
    import torch

    from glm5.core.model import GLM5ForCausalLM
    from quant import quantize_model, stream
    from quant.formats import fp8
    from quant.load import export
    from quant.recipe import Recipe

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    from glm5.core.config import GLM5Config

    with torch.device("meta"):  # the lazy imports (torch._dynamo, the reference ops) before the base
        GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="reference")
    base = _rss_kib("VmRSS")
    t0 = time.perf_counter()
    if variant == "whole":
        model = fp8.load_fp8(src, backend="reference", fp8_modules=False)
        with torch.no_grad():
            quantize_model(model, "glm5-w8a8")
        export(model, Path(out), "modelslim")
    else:
        stream.convert(src, out, "modelslim", Recipe.load("glm5-w8a8"), backend="reference")
    print(json.dumps({"extra_mib": (_rss_kib("VmHWM") - base) / 1024, "s": time.perf_counter() - t0}))


def build(path: Path, layers: int, hidden: int, experts: int, expert_dim: int) -> int:
    """Write the FP8 checkpoint; returns its size in bf16 bytes."""
    import torch

    from glm5.core.config import GLM5Config
    from glm5.core.model import GLM5ForCausalLM
    from quant.formats import fp8

    cfg = GLM5Config.from_preset(
        "tiny",
        vocab_size=2048,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        q_lora_rank=hidden // 2,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_routed_experts=experts,
        moe_intermediate_size=expert_dim,
        index_topk_pattern="F" * layers,
    )
    model = GLM5ForCausalLM(cfg, backend="reference", dtype=torch.bfloat16)
    fp8.export(model, path)
    return 2 * sum(p.numel() for p in model.parameters())


def _digest(path: Path) -> str:
    import torch
    from safetensors.torch import load_file

    from glm5.core.checkpoint import weight_files

    h = hashlib.sha256()
    tensors = {}
    for f in sorted(set(weight_files(path).values())):
        tensors.update(load_file(f))
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--expert-dim", type=int, default=512)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--child", nargs=3, metavar=("VARIANT", "SRC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(*args.child)
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        bf16_bytes = build(d / "src", args.layers, args.hidden, args.experts, args.expert_dim)
        results = {}
        digests = {}
        for v in VARIANTS:
            runs = []
            for r in range(args.runs):
                out = d / f"{v}-{r}"
                res = subprocess.run(
                    [sys.executable, __file__, "--child", v, str(d / "src"), str(out)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
                digests[v] = _digest(out)
            results[v] = {
                "extra_mib": statistics.median(x["extra_mib"] for x in runs),
                "s": statistics.median(x["s"] for x in runs),
            }
    ckpt_mib = bf16_bytes / 2**20
    rec = {
        "bench": "quantize_stream",
        "layers": args.layers + 1,
        "bf16_checkpoint_mib": round(ckpt_mib, 1),
        "whole_extra_mib": round(results["whole"]["extra_mib"], 1),
        "streamed_extra_mib": round(results["streamed"]["extra_mib"], 1),
        "streamed_over_whole": round(results["streamed"]["extra_mib"] / results["whole"]["extra_mib"], 3),
        "streamed_over_bf16_checkpoint": round(results["streamed"]["extra_mib"] / ckpt_mib, 3),
        "whole_s": round(results["whole"]["s"], 1),
        "streamed_s": round(results["streamed"]["s"], 1),
        "same_tensors": digests["whole"] == digests["streamed"],
        "runs": args.runs,
    }
    emit(rec, args.json)


if __name__ == "__main__":
    main()
