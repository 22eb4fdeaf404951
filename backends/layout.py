"""`SeqLayout`: where each request's queries and keys live (SPEC 1).

Requests are concatenated along the token axis (TND). Every index an op takes or returns is a
logical key position inside its request; the layout maps it to a physical cache row, either through
`cu_seqlens_k` (ragged cache `[rows, D]`) or through `block_table` (paged cache `[nb, bs, D]`).
Causality is right-down: query i of request b (which has T_b queries) sees key j iff
`j <= seqlens_k[b] - T_b + i`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from backends.argcheck import _shape, check_int, check_tensor, fail

#: serialises the first host copy of any layout (rare and short; a per-object lock would make every
#: layout built inside a compiled region allocate a lock, which dynamo cannot trace)
_HOST_LOCK = threading.Lock()


@dataclass(eq=False)
class SeqLayout:
    """cu_seqlens_q: int32 [B+1]; seqlens_k: int32 [B]; exactly one of
    cu_seqlens_k: int32 [B+1] (ragged cache) or block_table: int32 [B, max_blocks] (paged cache).
    max_seqlen_k: max(seqlens_k) as a host int, given by whoever built the layout (as FlashAttention's
    varlen API and vLLM's metadata carry it), so no op has to read it back from the device; None means
    "not known": it is read once, on first use, or left symbolic while compiling.

    Value checks (monotone offsets, block ids in range, ...) need the values on the host; they run once
    per layout object in `check(...)` and are cached, because one layout serves every layer of a step.
    A layout whose tensors are edited in place after first use is noticed (the tensors' version
    counters) and checked and read again.
    """

    cu_seqlens_q: torch.Tensor
    seqlens_k: torch.Tensor
    cu_seqlens_k: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    max_seqlen_k: int | None = None
    #: built by code that guarantees the invariants (KVCache.begin, an engine's scheduler metadata, a
    #: custom op rebuilding a checked layout): value checks are skipped unless GLM5_VALIDATE=values
    trusted: bool = False
    _host: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        check_tensor("layout.cu_seqlens_q", self.cu_seqlens_q, dtype=torch.int32, ndim=1)
        if self.cu_seqlens_q.shape[0] < 1:
            fail(
                "layout.cu_seqlens_q",
                "shape [B+1] with B >= 0 (at least one element)",
                self.cu_seqlens_q.shape,
            )
        b = self.cu_seqlens_q.shape[0] - 1
        check_tensor("layout.seqlens_k", self.seqlens_k, dtype=torch.int32, shape=(b,))
        if (self.cu_seqlens_k is None) == (self.block_table is None):
            fail(
                "layout",
                "exactly one of cu_seqlens_k (ragged cache) or block_table (paged cache)",
                "both" if self.cu_seqlens_k is not None else "neither",
            )
        if self.cu_seqlens_k is not None:
            check_tensor("layout.cu_seqlens_k", self.cu_seqlens_k, dtype=torch.int32, shape=(b + 1,))
        if self.block_table is not None:
            check_tensor("layout.block_table", self.block_table, dtype=torch.int32, ndim=2)
            if self.block_table.shape[0] != b:
                fail("layout.block_table", f"shape [B={b}, max_blocks]", tuple(self.block_table.shape))
        for name in ("seqlens_k", "cu_seqlens_k", "block_table"):
            t = getattr(self, name)
            if t is not None and t.device != self.cu_seqlens_q.device:
                fail(f"layout.{name}", f"device {self.cu_seqlens_q.device} (as cu_seqlens_q)", t.device)
        if self.max_seqlen_k is not None and not isinstance(self.max_seqlen_k, int):
            check_int("layout.max_seqlen_k", self.max_seqlen_k, min_value=0)

    # -- derived facts -------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        return "ragged" if self.cu_seqlens_k is not None else "paged"

    @property
    def num_requests(self) -> int:
        return self.seqlens_k.shape[0]

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens_q.device

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """(cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table): the layout as custom-op arguments."""
        return self.cu_seqlens_q, self.seqlens_k, self.cu_seqlens_k, self.block_table

    def _versions(self) -> tuple[int, ...]:
        return tuple(-1 if t is None else t._version for t in self.tensors())

    def host(self) -> dict:
        """Host copies of the small metadata tensors, made once per layout (again after an in-place
        edit). Safe to call from several threads: the copies are built aside and published whole."""
        h = self._host
        if h and h["versions"] == self._versions():
            return h
        with _HOST_LOCK:
            h = self._host
            versions = self._versions()
            if h and h["versions"] == versions:
                return h
            new: dict = {"versions": versions}
            new["cu_q"] = self.cu_seqlens_q.tolist()
            new["seqlens_k"] = self.seqlens_k.tolist()
            if self.cu_seqlens_k is not None:
                new["cu_k"] = self.cu_seqlens_k.tolist()
            else:
                new["block_table"] = self.block_table.cpu()
            self._host = new  # published whole: a reader sees the old copies or the new ones
            return new

    @property
    def num_tokens(self) -> int:
        return self.host()["cu_q"][-1]

    def seqlen_k_max(self) -> int:
        """max(seqlens_k): the given host int, else read once from the layout's tensors."""
        if self.max_seqlen_k is not None:
            return self.max_seqlen_k
        s = self.host()["seqlens_k"]
        return max(s) if s else 0

    def check(self, num_tokens: int, cache: torch.Tensor, cache_name: str) -> None:
        """Value checks against the query count and the cache this layout indexes (cached per cache shape)."""
        h = self.host()
        key = ("checked", num_tokens, tuple(cache.shape))
        if key in h:
            return
        cu_q, seqlens_k = h["cu_q"], h["seqlens_k"]
        if cu_q[0] != 0 or any(b < a for a, b in zip(cu_q, cu_q[1:])):
            fail("layout.cu_seqlens_q", "non-decreasing offsets starting at 0", cu_q)
        if cu_q[-1] != num_tokens:
            fail("layout.cu_seqlens_q", f"last offset == number of query tokens T={num_tokens}", cu_q[-1])
        if any(s < 0 for s in seqlens_k):
            fail("layout.seqlens_k", "non-negative key counts", seqlens_k)
        if self.max_seqlen_k is not None and self.max_seqlen_k != max(seqlens_k, default=0):
            fail("layout.max_seqlen_k", f"max(seqlens_k) = {max(seqlens_k, default=0)}", self.max_seqlen_k)
        if self.cu_seqlens_k is not None:
            if cache.dim() != 2:
                fail(cache_name, "a ragged cache [rows, D] (the layout has cu_seqlens_k)", tuple(cache.shape))
            cu_k, rows = h["cu_k"], cache.shape[0]
            if cu_k[0] < 0 or any(b < a for a, b in zip(cu_k, cu_k[1:])):
                fail("layout.cu_seqlens_k", "non-decreasing non-negative offsets", cu_k)
            for b, s in enumerate(seqlens_k):
                if cu_k[b] + s > cu_k[b + 1]:
                    fail(
                        "layout.cu_seqlens_k",
                        f"request {b}: cu_seqlens_k[b] + seqlens_k[b] <= cu_seqlens_k[b+1]",
                        f"{cu_k[b]} + {s} > {cu_k[b + 1]}",
                    )
            if cu_k[-1] > rows:
                fail("layout.cu_seqlens_k", f"last offset <= cache rows ({rows})", cu_k[-1])
        else:
            if cache.dim() != 3:
                fail(
                    cache_name,
                    "a paged cache [num_blocks, block_size, D] (the layout has block_table)",
                    tuple(cache.shape),
                )
            nb, bs = cache.shape[0], cache.shape[1]
            if bs < 1:  # position p lives in block p // bs: a zero block size has no positions
                fail(cache_name, "a paged cache [num_blocks, block_size >= 1, D]", tuple(cache.shape))
            bt = h["block_table"]
            for b, s in enumerate(seqlens_k):
                need = -(-s // bs)
                if need > bt.shape[1]:
                    fail(
                        "layout.block_table",
                        f"request {b}: >= {need} blocks for {s} keys of block size {bs}",
                        f"{bt.shape[1]} columns",
                    )
                used = bt[b, :need]
                if need and (used.min() < 0 or used.max() >= nb):
                    fail(
                        "layout.block_table",
                        f"request {b}: block ids in [0, {nb}) for its {need} used blocks",
                        used.tolist(),
                    )
        h[key] = True

    # -- helpers used by references and adapters -----------------------------------------------
    def request_bounds(self) -> list[tuple[int, int, int]]:
        """[(q_start, q_end, seqlen_k)] per request."""
        h = self.host()
        cu_q = h["cu_q"]
        return [(cu_q[b], cu_q[b + 1], h["seqlens_k"][b]) for b in range(self.num_requests)]

    def physical_rows(self, b: int, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """Map logical positions (all valid, int64) of request b to rows of `cache.flatten(0, -2)`."""
        if self.cu_seqlens_k is not None:
            return positions + self.host()["cu_k"][b]
        bs = cache.shape[1]
        blocks = self.host()["block_table"][b].to(torch.int64)
        return blocks[positions // bs] * bs + positions % bs

    def to(self, device: torch.device | str) -> SeqLayout:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return SeqLayout(
            move(self.cu_seqlens_q),
            move(self.seqlens_k),
            move(self.cu_seqlens_k),
            move(self.block_table),
            self.max_seqlen_k,
            self.trusted,
        )

    @staticmethod
    def from_lengths(
        q_lens: list[int],
        k_lens: list[int],
        *,
        block_size: int | None = None,
        num_blocks: int | None = None,
        device: str | torch.device = "cpu",
        block_order: list[int] | None = None,
    ) -> SeqLayout:
        """Build a layout from per-request lengths: a compact ragged cache, or a paged one with blocks
        assigned in `block_order` (default: consecutive)."""
        if len(q_lens) != len(k_lens):
            fail("k_lens", f"one length per request ({len(q_lens)})", len(k_lens))
        cu_q = torch.tensor([0] + list(_cumsum(q_lens)), dtype=torch.int32, device=device)
        sk = torch.tensor(k_lens, dtype=torch.int32, device=device)
        if block_size is None:
            cu_k = torch.tensor([0] + list(_cumsum(k_lens)), dtype=torch.int32, device=device)
            return SeqLayout(cu_q, sk, cu_seqlens_k=cu_k, max_seqlen_k=max(k_lens) if k_lens else 0)
        check_int("block_size", block_size, min_value=1)
        need = [-(-s // block_size) for s in k_lens]
        max_blocks = max(need, default=0)
        total = sum(need)
        order = list(range(total)) if block_order is None else list(block_order)
        if len(order) < total:
            fail("block_order", f"at least {total} block ids", len(order))
        table = torch.full((len(k_lens), max(max_blocks, 1)), -1, dtype=torch.int32)
        i = 0
        for b, n in enumerate(need):
            table[b, :n] = torch.tensor(order[i : i + n], dtype=torch.int32)
            i += n
        return SeqLayout(cu_q, sk, block_table=table.to(device), max_seqlen_k=max(k_lens) if k_lens else 0)


def _cumsum(xs: list[int]):
    s = 0
    for x in xs:
        s += x
        yield s


# -- an op's cache argument against its layout (the ops' validators, backends/reference/<op>.py) --------


def check_cache(name: str, cache: torch.Tensor, layout: SeqLayout, width: int, dtype) -> None:
    if layout.kind == "ragged" and cache.dim() != 2:
        fail(name, "a ragged cache [rows, D] (the layout has cu_seqlens_k)", f"shape {_shape(cache)}")
    if layout.kind == "paged" and cache.dim() != 3:
        fail(
            name,
            "a paged cache [num_blocks, block_size, D] (the layout has block_table)",
            f"shape {_shape(cache)}",
        )
    check_tensor(name, cache, dtype=dtype)
    if cache.shape[-1] != width:
        fail(name, f"last dim {width}", f"shape {_shape(cache)}")


def check_layout(layout: object, num_tokens: int, cache: torch.Tensor, cache_name: str) -> None:
    if not isinstance(layout, SeqLayout):
        fail("layout", "a backends.SeqLayout", type(layout).__name__)
    if layout.device != cache.device:
        fail("layout", f"device {cache.device} (as {cache_name})", layout.device)
