"""Training text available offline on every machine: the Python standard library's own source files,
as byte-level tokens (0..255, plus EOS_ID between files), with a held-out split by file.

Batches are a pure function of (seed, step): a resumed run sees exactly the batches it would have seen,
so the data position is the step counter (saved in the trainer state).
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

import torch

EOS_ID = 256  # ends every file; byte values are their own token ids
VOCAB_MIN = 257


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_heldout(rel: str, every: int) -> bool:
    # a hash of the path, not the file order: adding a file moves no other file between splits
    return zlib.crc32(rel.encode()) % every == 0


class ByteCorpus:
    """Token streams `train` and `heldout` (int16 [N]) from the `*.py` files under `root`.

    root: default the standard library (site-packages excluded); heldout_every: one file in this many
    (by path hash) is held out; max_bytes: stop reading once each split has this many bytes.
    """

    def __init__(self, root: str | Path | None = None, heldout_every: int = 20, max_bytes: int = 8 << 20):
        if heldout_every < 2:
            raise ValueError(f"heldout_every: expected >= 2, got {heldout_every}")
        self.root = Path(root) if root is not None else stdlib_root()
        files = sorted(p for p in self.root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
        if not files:
            raise FileNotFoundError(f"root: no *.py files under {self.root}")
        parts: dict[bool, list[bytes]] = {True: [], False: []}
        sizes = {True: 0, False: 0}
        self.files: dict[bool, list[str]] = {True: [], False: []}
        for p in files:
            rel = p.relative_to(self.root).as_posix()
            held = _is_heldout(rel, heldout_every)
            if sizes[held] >= max_bytes:
                continue
            data = p.read_bytes()
            parts[held].append(data)
            self.files[held].append(rel)
            sizes[held] += len(data) + 1
        self.train = _tokens(parts[False])
        self.heldout = _tokens(parts[True])
        if self.heldout.numel() == 0 or self.train.numel() == 0:
            raise ValueError(f"root: {self.root} gives an empty train or held-out split")

    def batch(self, batch_size: int, seq_len: int, seed: int, step: int) -> torch.Tensor:
        """Random training windows int64 [B, S] for optimizer step `step` (a function of seed and step)."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, self.train.numel() - seq_len, (batch_size,), generator=g)
        return torch.stack([self.train[s : s + seq_len] for s in starts.tolist()]).long()

    def heldout_batches(self, batch_size: int, seq_len: int, n_batches: int) -> list[torch.Tensor]:
        """The same `n_batches` held-out batches [B, S] every time: windows evenly spaced over the split."""
        n = batch_size * n_batches
        last = self.heldout.numel() - seq_len
        if last < n:
            raise ValueError(f"n_batches: held-out split too small for {n} windows of {seq_len} tokens")
        starts = torch.linspace(0, last, n).long().tolist()
        windows = torch.stack([self.heldout[s : s + seq_len] for s in starts]).long()
        return list(windows.split(batch_size))


def _tokens(chunks: list[bytes]) -> torch.Tensor:
    if not chunks:
        return torch.empty(0, dtype=torch.int16)
    out = []
    for data in chunks:
        if data:  # frombuffer refuses an empty buffer; an empty file is just its EOS
            out.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16))
        out.append(torch.tensor([EOS_ID], dtype=torch.int16))
    return torch.cat(out)


def decode(ids: list[int]) -> str:
    """Token ids back to text (EOS shown as a newline; for samples in logs)."""
    return bytes(i if i < 256 else 10 for i in ids).decode("utf-8", errors="replace")
