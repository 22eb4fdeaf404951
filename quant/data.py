"""Calibration and evaluation text: byte-level tokens of the Python standard library's .py files (the
training corpus's idea: token id = byte value, 0..255).

Files are taken in sorted path order; every 10th file (index % 10 == 0) is held out, so calibration
("train") and perplexity ("heldout") never see the same file.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

SPLITS = ("train", "heldout")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(split: str, root: Path | None = None) -> list[Path]:
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {list(SPLITS)}, got {split!r}")
    root = root or stdlib_dir()
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    if not files:
        raise FileNotFoundError(f"root: no .py files under {root}")
    return [f for i, f in enumerate(files) if (i % 10 == 0) == (split == "heldout")]


def token_batch(
    split: str, n_seqs: int, seq_len: int, seed: int = 0, root: Path | None = None
) -> torch.Tensor:
    """int64 [n_seqs, seq_len] byte ids: windows at random offsets of random files of the split (seeded)."""
    files = corpus_files(split, root)
    g = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < n_seqs:
        f = files[int(torch.randint(len(files), (1,), generator=g))]
        data = f.read_bytes()
        if len(data) <= seq_len:
            continue
        off = int(torch.randint(len(data) - seq_len, (1,), generator=g))
        out.append(torch.frombuffer(bytearray(data[off : off + seq_len]), dtype=torch.uint8).long())
    return torch.stack(out)
