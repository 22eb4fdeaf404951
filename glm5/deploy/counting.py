"""What one rank of a layout does, counted while the code runs: FLOPs by op (a torch dispatch mode) and
bytes by collective (a `Group` wrapper). Both work on real tensors (a gloo run: the check) and on fake
tensors (FakeTensorMode: the full-size model: the ledger, glm5/deploy/ledger.py).

FLOPs: the matrix products, counted as torch's FlopCounterMode counts them (`flop_registry`: mm, addmm,
bmm, baddbmm, convolution, attention; 2 per multiply-add); elementwise ops, norms, softmax and top-k
count 0. The project's custom ops (`torch.ops.glm5.*`) have no aten decomposition, so each has a formula
in `CUSTOM_FLOPS` below, applied to the arguments of the actual call: grouped_matmul 2 M N K (every row
of x: the contiguous layout holds exactly the routed rows), sparse_mla_attention 2 T H topk (d_qk + d_v)
(every index slot, as the kernels do), the indexer 2 T H_I L (D_I + 1) over the L = max_seqlen_k keys
of the call's layout.

Bytes: what one rank puts on the wire per collective, at the algorithm's cost: all_reduce (the host's
ring) 2 (N-1)/N x; reduce_scatter (N-1)/N x; all_gather (N-1) x (x this rank's part); all_to_all the
rows sent to other ranks. An exact (fixed-order) sum is counted through the all-to-all and all-gather it
issues (glm5/parallel/group.py), so its bytes are the code's own.
"""

from __future__ import annotations

import math
from collections import Counter, deque

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from backends.contract import library
from backends.moe import expert_parallel as expert_dispatch
from glm5.parallel.group import Group, fixed_order_all_reduce, fixed_order_reduce_scatter

_aten = torch.ops.aten


def _attention(a: dict) -> int:
    t, h, d_qk = a["q"].shape
    return 2 * t * h * a["indices"].shape[-1] * (d_qk + a["d_v"])


def _indexer(a: dict) -> int:
    t, h, d = a["q"].shape
    return 2 * t * h * a["layout"].max_seqlen_k * (d + 1)  # q.k per head, then the weighted head sum


def _grouped(a: dict) -> int:
    m, k = a["x"].shape
    return 2 * m * a["w"].shape[1] * k


def _linear(a: dict) -> int:
    m, k = a["x"].shape[0], a["x"].shape[-1]
    return 2 * m * a["w"].shape[0] * k


#: custom op -> FLOPs of one call, from its named arguments (backends/reference/<op>.py: the signatures)
CUSTOM_FLOPS = {
    "grouped_matmul": _grouped,
    "fp8_grouped_matmul": _grouped,
    "sparse_mla_attention": _attention,
    "fp8_sparse_mla_attention": _attention,
    "indexer_logits": _indexer,
    "indexer_topk": _indexer,
    "fp8_indexer_logits": _indexer,
    "fp8_indexer_topk": _indexer,
    "w8a8_matmul": _linear,
    "w4a8_matmul": _linear,
    "fp8_block_matmul": _linear,
}


class UnexpectedHostRead(RuntimeError):
    """A fake tensor's values were read where the ledger has no answer (the hot path reads nothing back
    but the dispatch's split sizes)."""


class CountOps(TorchDispatchMode):
    """FLOPs and calls by op of everything run inside (`flops['glm5::grouped_matmul']`, `['aten::mm']`).

    Under FakeTensorMode (entered before this mode) a host read has no values: `answer(values)` queues the
    next ones (the expert dispatch's split sizes, from FakeHost); any other host read of a fake tensor
    raises UnexpectedHostRead."""

    def __init__(self) -> None:
        super().__init__()
        self.flops: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._answers: deque[int] = deque()

    def answer(self, values: list[int]) -> None:
        self._answers.extend(values)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            if not self._answers:
                raise UnexpectedHostRead(f"a host read of a fake {tuple(args[0].shape)} tensor")
            return self._answers.popleft()
        out = func(*args, **kwargs)
        name = func._schema.name
        self.calls[name] += 1
        packet = func._overloadpacket
        if packet in flop_registry:
            self.flops[name] += int(flop_registry[packet](*args, **kwargs, out_val=out))
        elif name.startswith("glm5::"):
            op = name.removeprefix("glm5::")
            if op in CUSTOM_FLOPS:
                self.flops[name] += int(CUSTOM_FLOPS[op](library.named_args(op, args)))
        return out


class Counted:
    """A Group that counts the bytes this rank sends per collective kind, around any Group (a real
    TorchGroup in a gloo run, a FakeHost on fake tensors); `tensor_bytes` holds the summed tensors'
    own bytes per kind (an ideal's input)."""

    def __init__(self, inner: Group) -> None:
        self.inner = inner
        self.rank, self.size = inner.rank, inner.size
        self.bytes: Counter[str] = Counter()
        self.tensor_bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        if hasattr(inner, "expert_steps"):
            self.expert_steps = inner.expert_steps

    def _count(self, kind: str, x: torch.Tensor, wire: float) -> None:
        self.calls[kind] += 1
        self.tensor_bytes[kind] += x.numel() * x.element_size()
        self.bytes[kind] += round(wire)

    def all_reduce(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        if self.size == 1:
            return x
        if exact:
            return fixed_order_all_reduce(self, x)
        n, nb = self.size, x.numel() * x.element_size()
        self._count("all_reduce", x, 2 * (n - 1) / n * nb)
        return self.inner.all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.size == 1:
            return x
        self._count("all_gather", x, (self.size - 1) * x.numel() * x.element_size())
        return self.inner.all_gather(x, dim)

    def reduce_scatter(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        if self.size == 1:
            return x
        if exact:
            return fixed_order_reduce_scatter(self, x)
        n = self.size
        self._count("reduce_scatter", x, (n - 1) / n * x.numel() * x.element_size())
        return self.inner.reduce_scatter(x)

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        if self.size == 1:
            return x
        row = math.prod(x.shape[1:]) * x.element_size()
        self._count("all_to_all", x, (sum(send) - send[self.rank]) * row)
        return self.inner.all_to_all(x, send, recv)


class _BalancedSteps:
    """The reference dispatch steps (backends/moe/expert_parallel.py) with the split sizes a fake run cannot
    read answered as balanced routing: every rank sends each rank an equal share of its T k pairs (the
    remainder, where N does not divide them, one pair each to the ranks after the sender's)."""

    def __init__(self, host: FakeHost) -> None:
        self.host = host
        self.layout, self.combine = expert_dispatch.layout, expert_dispatch.combine

    def dispatch(self, x, lay, group, capacity=None):
        if capacity is None:
            n, r, k = group.size, group.rank, lay.top_k

            def share(pairs: int, src: int, dst: int) -> int:  # the remainder to the next ranks after src
                return pairs // n + ((dst - src) % n < pairs % n)

            sources = [lay.tokens] * n  # ranks with their own tokens: every rank runs the same step
            if self.host.tokens is not None:  # replicated tokens: rank s dispatches chunk s of T
                t, c = self.host.tokens, -(-self.host.tokens // n)
                sources = [min(c, max(t - s * c, 0)) for s in range(n)]
            send = [share(lay.tokens * k, r, s) for s in range(n)]
            self.host.counter.answer(send + [share(p * k, s, r) for s, p in enumerate(sources)])
        return expert_dispatch.dispatch(x, lay, group, capacity)


class FakeHost:
    """Rank `rank` of `size` without a process group: every collective returns a result of the right
    shape and dtype (values are meaningless; meant for fake tensors), and the expert dispatch's split
    sizes are those of balanced routing (answered to `counter`, the CountOps mode of the run). tokens:
    the step's token count where the ranks hold the same tokens (each dispatches its 1/N chunk), None
    where each holds its own."""

    def __init__(self, rank: int, size: int, counter: CountOps, tokens: int | None = None) -> None:
        self.rank, self.size, self.counter, self.tokens = rank, size, counter, tokens
        self.expert_steps = _BalancedSteps(self)

    def all_reduce(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        return torch.empty_like(x)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat([x] * self.size, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        return x[: x.shape[0] // self.size].clone()

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        return x.new_empty((sum(recv), *x.shape[1:]))


__all__ = ["CUSTOM_FLOPS", "CountOps", "Counted", "FakeHost", "UnexpectedHostRead"]
