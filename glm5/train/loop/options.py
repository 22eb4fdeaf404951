"""The options of a training run (`glm5 train`'s flags; saved with every checkpoint, so a resumed run keeps
them) and the process-wide determinism they set."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from glm5.train.loop.dsa import STAGES
from glm5.train.rl.stage import check_rl_options

TRAIN_STAGES = (*STAGES, "rl")


@dataclass
class TrainConfig:
    preset: str = "tiny"
    backend: str | None = None
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    optimizer: str = "muon-split"
    stage: str = "sparse"
    mtp_steps: int = 1
    mtp_weight: float = 0.3
    kl_weight: float = 1.0
    balance_gamma: float = 1e-3
    eval_every: int = 25
    eval_batches: int = 4
    save_every: int = 100
    keep: int = 2
    seed: int = 0
    deterministic: bool = False
    threads: int | None = 1
    init: str | None = None  # start from this Hugging Face directory (e.g. before an indexer warm-up)
    max_bytes: int = 8 << 20
    # stage 'rl' (glm5/train/rl/stage.py): batch_size prompts per step, group_size responses each
    group_size: int = 8
    prompt_len: int = 16
    response_len: int = 16
    ppo_epochs: int = 2
    minibatches: int = 1
    temperature: float = 1.0
    rollout_precision: str = "bf16"
    # asynchronous RL (glm5/train/rl/asynchronous.py): the engine, weights pushed every push_every steps, a
    # batch at most max_staleness versions behind, the vLLM engine's tensor-parallel size
    rollout_engine: str = "sync"
    push_every: int = 1
    max_staleness: int = 1
    engine_tp: int = 1
    layout_invariant: bool = False  # the rollout engine's and the trainer's forwards in SPEC 12's mode
    # the engine's indexer top-k per generated token: compared with the trainer's (record), and used by
    # the trainer's forwards instead of its own (replay; glm5/train/rl/topk_replay.py)
    topk_record: bool = False
    topk_replay: bool = False
    # --mesh pp=N (glm5/train/distributed/pipeline/run.py), and per decoder layer what autograd keeps for the
    # backward
    pp_schedule: str = "1f1b"
    mtp_stage: str = "last"
    microbatches: int = 1
    activations: str = "none"

    def __post_init__(self) -> None:
        if self.stage not in TRAIN_STAGES:
            raise ValueError(f"stage: expected one of {TRAIN_STAGES}, got {self.stage!r}")
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 2:
            raise ValueError(
                f"steps/batch_size/seq_len: expected >= 1, >= 1, >= 2, got "
                f"{self.steps}, {self.batch_size}, {self.seq_len}"
            )
        for name in ("temperature", "grad_clip"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")
        for name in ("lr", "min_lr_ratio", "mtp_weight", "kl_weight", "weight_decay", "balance_gamma"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
        check_rl_options(self)
        for name in ("topk_record", "topk_replay"):
            if getattr(self, name) and self.rollout_engine == "sync":
                raise ValueError(
                    f"{name}: expected a rollout engine (--rollout-engine policy|vllm: it records the "
                    "indexer top-k; the sync stage samples with the trainer's own), got rollout_engine 'sync'"
                )

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to min_lr_ratio * lr at the last step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        frac = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        cos = 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cos)


def set_determinism(cfg: TrainConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    if cfg.deterministic:
        # fixed algorithms; on CUDA cuBLAS needs a fixed workspace for deterministic GEMMs
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
