"""Loss curves as PNG from `metrics.jsonl` (matplotlib, the `train` extra)."""

from __future__ import annotations

import json
from pathlib import Path


def plot_metrics(metrics: str | Path, png: str | Path, init_eval: float | None = None) -> Path:
    """Training / held-out / MTP / indexer-KL losses, the largest attention logit and (stage rl) the mean
    reward against the step."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on training machines
    import matplotlib.pyplot as plt

    recs = [json.loads(ln) for ln in Path(metrics).read_text().splitlines() if ln.strip()]
    if not recs:
        raise ValueError(f"metrics: {metrics} has no records")

    def series(key: str) -> tuple[list[int], list[float]]:
        pts = [(r["step"], r[key]) for r in recs if r.get(key) is not None]
        return [s for s, _ in pts], [v for _, v in pts]

    rl = any(r.get("mismatch_min") is not None for r in recs)  # stage rl: a second row of figures
    topk = any(r.get("topk_overlap_layers") for r in recs)  # --topk-record / --topk-replay: a third
    rows = 1 + rl + topk
    fig, axes = plt.subplots(rows, 2, figsize=(11, 4 * rows), squeeze=False)
    (ax, ax2) = axes[0]
    if rl:
        _rl_figures(axes[1], series)
    if topk:
        _topk_figure(axes[rows - 1], recs, series)
    for key, label in (("lm_loss", "train LM"), ("mtp_loss", "train MTP")):
        xs, ys = series(key)
        if xs:
            ax.plot(xs, ys, lw=1, label=label)
    xs, ys = series("kl_loss")
    if xs:  # its own scale: the KL is orders of magnitude below the LM loss
        axk = ax.twinx()
        axk.plot(xs, ys, ":", color="tab:green", lw=1)
        axk.set_ylabel("indexer KL (dotted)", color="tab:green")
    xs, ys = series("eval_loss")
    if init_eval is not None:
        xs, ys = [0, *xs], [init_eval, *ys]
    if xs:
        ax.plot(xs, ys, "o-", lw=2, label="held-out LM")
    ax.set_xlabel("step")
    ax.set_ylabel("nats per byte")
    ax.grid(alpha=0.3)
    ax.legend()
    xs, ys = series("max_attn_logit")
    ax2.plot(xs, ys, lw=1)
    ax2.set_xlabel("step")
    ax2.set_ylabel("largest attention logit")
    xs, ys = series("reward_mean")
    if xs:  # stage rl
        axr = ax2.twinx()
        axr.plot(xs, ys, color="tab:red", lw=1)
        axr.set_ylabel("mean reward (red)", color="tab:red")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    png = Path(png)
    from glm5.infra import fsio

    # replaced in one step: a reader (an image viewer refreshing) never sees half a file
    fsio.write_file_atomically(png, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
    return png


def _rl_figures(axes, series) -> None:
    """Stage rl: pi_train / pi_rollout (min, max, share outside [1/2, 2]); with a rollout engine
    (glm5/train/rl/asynchronous.py) the staleness, the overlap and the rollout / train tokens per second."""
    ax, ax2 = axes
    for key, label in (("mismatch_min", "min"), ("mismatch_max", "max")):
        xs, ys = series(key)
        ax.plot(xs, ys, lw=1, label=f"pi_train / pi_rollout {label}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    xs, ys = series("mismatch_outside")
    if xs:
        axo = ax.twinx()
        axo.plot(xs, ys, ":", color="tab:red", lw=1)
        axo.set_ylabel("share outside [1/2, 2] (dotted)", color="tab:red")
    for key, label in (("staleness_max", "staleness (max)"), ("overlap", "overlap")):
        xs, ys = series(key)
        if xs:
            ax2.plot(xs, ys, lw=1, label=label)
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    xs, ys = series("rollout_tokens_per_s")
    if xs:
        ax2.legend(loc="upper left")
        axt = ax2.twinx()
        axt.plot(xs, ys, "--", color="tab:purple", lw=1, label="rollout")
        xs, ys = series("train_tokens_per_s")
        axt.plot(xs, ys, "-.", color="tab:brown", lw=1, label="train")
        axt.set_ylabel("tokens/s (dashed: rollout, dash-dot: train)")


def _topk_figure(axes, recs, series) -> None:
    """The rollout/train indexer top-k overlap per layer (glm5/train/rl/topk_replay.py); with replay, dotted,
    that of the trainer's own indexers."""
    ax, spare = axes
    per_layer = [(r["step"], r["topk_overlap_layers"]) for r in recs if r.get("topk_overlap_layers")]
    for j in range(len(per_layer[0][1])):
        pts = [(s, v[j]) for s, v in per_layer if v[j] is not None]
        ax.plot([s for s, _ in pts], [v for _, v in pts], lw=1, label=f"indexer layer {j}")
    xs, ys = series("topk_indexer_overlap")
    if xs:
        ax.plot(xs, ys, ":", color="black", lw=1, label="trainer's own indexers (replay)")
    ax.set_xlabel("step")
    ax.set_ylabel("top-k overlap |S_rollout & S_train| / |S_train|")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize="small")
    spare.axis("off")
