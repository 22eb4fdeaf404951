"""The measurements behind docs/quantization.md: a briefly trained tiny model, its held-out perplexity in
bf16 / W8A8 / W4A8, weight bytes per scheme, and glm5-744b memory against two machines.

    python -m quant.report train --out build/quant/tiny --seconds 480
    python -m quant.report ppl --model build/quant/tiny
    python -m quant.report memory
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import click
import torch

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from quant.data import token_batch


def train_tiny(
    out: Path,
    seconds: float,
    batch: int = 8,
    seq_len: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    init: Path | None = None,
) -> list[tuple[int, float]]:
    """Train the `tiny` preset on stdlib bytes for a wall-clock budget (fp32, AdamW, cosine after warmup),
    from random weights or from the checkpoint `init` (a continuation: its log's steps are kept)."""
    torch.manual_seed(seed)
    prior: list = []
    if init is not None:
        model = GLM5ForCausalLM.from_pretrained(init, backend="reference", dtype=torch.float32)
        log_file = Path(init) / "train_log.json"
        prior = json.loads(log_file.read_text())["loss"] if log_file.is_file() else []
    else:
        model = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="reference")
        model.init_weights(seed)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)
    t0, step, log = time.time(), len(prior), [tuple(x) for x in prior]
    while time.time() - t0 < seconds:
        frac = (time.time() - t0) / seconds
        for g in opt.param_groups:
            warm = min(1.0, (step - len(prior) + 1) / 10)
            g["lr"] = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        ids = token_batch("train", batch, seq_len, seed=10_000 + step)
        loss = model(ids, labels=ids, return_logits=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        log.append((step, loss.item()))
        if step % 10 == 0:
            print(f"step {step} loss {float(loss):.4f} t={time.time() - t0:.0f}s", flush=True)
        step += 1
    model.save_pretrained(out)
    (out / "train_log.json").write_text(
        json.dumps({"steps": step, "batch": batch, "seq_len": seq_len, "lr": lr, "loss": log})
    )
    return log


@torch.no_grad()
def log_probs(model: GLM5ForCausalLM, ids: torch.Tensor, batch: int = 4) -> torch.Tensor:
    """Next-token log-probabilities fp32 [B, S-1, V] over ids [B, S]."""
    out = [
        torch.log_softmax(model(ids[i : i + batch]).logits.float()[:, :-1], -1)
        for i in range(0, ids.shape[0], batch)
    ]
    return torch.cat(out)


def perplexity(model: GLM5ForCausalLM, ids: torch.Tensor, batch: int = 4) -> float:
    """exp(mean next-token NLL) over ids [B, S]; logits in fp32."""
    lp = log_probs(model, ids, batch)
    return math.exp(-float(lp.gather(-1, ids[:, 1:, None]).mean()))


@torch.no_grad()
def ppl_table(model_dir: Path, n_eval: int = 32, n_calib: int = 16, seq_len: int = 128) -> list[dict]:
    """Held-out perplexity of the checkpoint in fp32 / bf16 and quantized by each recipe (bf16 base), with
    and without calibration; weight bytes of each."""
    from quant.apply import plan_model
    from quant.memory import weight_bytes
    from quant.quantize import quantize_model
    from quant.recipe import Recipe

    ev = token_batch("heldout", n_eval, seq_len, seed=1)
    cal = token_batch("train", n_calib, seq_len, seed=2)
    runs = [
        ("fp32", None, None, None),
        ("bf16", None, None, None),
        ("W8A8 (glm5-w8a8), round-to-nearest", "glm5-w8a8", None, False),
        ("W8A8 (glm5-w8a8), SmoothQuant calibrated", "glm5-w8a8", None, True),
        ("W4A8-experts (glm5-w4a8), round-to-nearest", "glm5-w4a8", None, False),
        ("W4A8-experts (glm5-w4a8), SmoothQuant + AWQ + SSZ calibrated", "glm5-w4a8", None, True),
        ("W4A8-experts per-group g16 (glm5-w4a8-g128 recipe), AWQ + GPTQ", "glm5-w4a8-g128", 16, True),
    ]
    rows: list[dict] = []
    ref_lp = None
    for label, recipe, gs, calibrated in runs:
        dtype = torch.float32 if label == "fp32" else torch.bfloat16
        model = GLM5ForCausalLM.from_pretrained(model_dir, backend="reference", dtype=dtype).eval()
        t0 = time.time()
        plan = {}
        if recipe is not None:
            r = Recipe.load(recipe, group_size=gs)
            plan = plan_model(model, r)
            quantize_model(model, r, cal if calibrated else None)
        tq = time.time() - t0
        wb = weight_bytes(GLM5ForCausalLM.from_pretrained(model_dir, backend="reference", dtype=dtype), plan)
        lp = log_probs(model, ev)
        p = math.exp(-float(lp.gather(-1, ev[:, 1:, None]).mean()))
        ref_lp = lp if ref_lp is None else ref_lp
        # paired fidelity against fp32 on the same tokens: mean KL(fp32 || config), top-1 agreement
        kl = float((ref_lp.exp() * (ref_lp - lp)).sum(-1).mean())
        top1 = float((ref_lp.argmax(-1) == lp.argmax(-1)).float().mean())
        rows.append(
            {
                "config": label,
                "ppl": p,
                "kl_vs_fp32": kl,
                "top1_agree": top1,
                "weight_bytes": wb.total,
                "by_scheme": wb.by_scheme,
                "quantize_s": tq,
            }
        )
        print(
            f"{label}: ppl {p:.4f} KL {kl:.2e} top1 {top1:.4f} weights {wb.total} B ({tq:.0f}s)", flush=True
        )
    return rows


@click.group()
def main() -> None:
    """Measurements for docs/quantization.md."""


@main.command()
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--seconds", type=float, default=480.0)
@click.option("--init", type=click.Path(exists=True, path_type=Path), default=None)
@click.option("--lr", type=float, default=3e-3)
def train(out: Path, seconds: float, init: Path | None, lr: float) -> None:
    log = train_tiny(out, seconds, lr=lr, init=init)
    print(f"trained {len(log)} steps, last loss {log[-1][1]:.4f}")


@main.command()
@click.option("--model", "model_dir", type=click.Path(exists=True, path_type=Path), required=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("build/quant/ppl.json"))
@click.option("--n-eval", type=int, default=32)
def ppl(model_dir: Path, out: Path, n_eval: int) -> None:
    rows = ppl_table(model_dir, n_eval=n_eval)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    for r in rows:
        sch = ", ".join(f"{k} {v:,}" for k, v in sorted(r["by_scheme"].items()))
        print(
            f"| {r['config']} | {r['ppl']:.3f} | {r['kl_vs_fp32']:.2e} | {100 * r['top1_agree']:.2f}% | "
            f"{r['weight_bytes']:,} ({sch}) |"
        )


@main.command()
@click.option("--mtp/--no-mtp", default=False, help="count the MTP layer's weights and KV cache")
def memory(mtp: bool) -> None:
    from quant.apply import plan_model
    from quant.memory import GIB, preset_model, weight_bytes
    from quant.recipe import Recipe

    model = preset_model("glm5-744b")
    for name in ("bf16", "glm5-w8a8", "glm5-w4a8", "glm5-w4a8-g128"):
        wb = weight_bytes(model, {} if name == "bf16" else plan_model(model, Recipe.load(name)))
        parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(wb.by_scheme.items()))
        print(f"| {name} | {(wb.total - wb.mtp) / GIB:.1f} | {wb.mtp / GIB:.1f} | {parts} |")
    from quant.memory import memory_table

    for r in memory_table(with_mtp=mtp):
        print(
            f"| {r['scheme']} | {r['machine']} | {r['weights_gib']:.0f} | {r['kv_room_gib']:.0f} | "
            f"{r['seqs_128K_bf16']:.1f} | {r['seqs_200K_bf16']:.1f} | {r['seqs_128K_fp8']:.1f} | "
            f"{r['seqs_200K_fp8']:.1f} |"
        )


if __name__ == "__main__":
    main()
