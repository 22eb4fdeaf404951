"""Indexer top-k record / replay for asynchronous RL (`--topk-record`, `--topk-replay`).

An engine that cannot run the layout-invariant mode selects other DSA keys than the trainer's forward at
near-ties, and every log-prob after such a token shifts. As routing replay does for MoE, the engine records
per generated token the keys each indexer layer selected, int32 [layers, index_topk] (-1 padded), and the
trainer's forward uses them instead of its own indexer's choice, so the sparse attention of the training
forward reads the rollout's keys.

The one hook point is the output of each main layer's `Indexer` (what `GLM5Output.topk` and the top-k
agreement check of glm5/parallel/agreement.py see as the indexer layers' entries; a shared layer reuses its
full layer's choice, so it needs no record): `recording` collects it in the engine's decode path,
`RolloutTopk.hooks` compares it with the record and (replay) replaces it in the training forward.

Which rows: the N sampled tokens of a response come from the queries at positions P-1 .. P+N-2 (the last
prompt token, then each sampled token but the last); those are the recorded rows, [R, N, layers, k].
The training forward over `cat(prompts, responses)[:, :-1]` recomputes the prompt's own rows (both sides
run a whole prefill there). Cost: layers x index_topk x 4 bytes per generated token (GLM-5: 78 x 2048 x
4 = 624 KiB).

Figure: per indexer layer, |S_rollout & S_train| / |S_train| averaged over the generated tokens, where
S_train is the set the training forward's own indexer selects (before a replay replaces it): how far the
trainer would stray without replay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import torch
from torch import nn


def indexers(model: nn.Module) -> list[nn.Module]:
    """The main layers' indexers of a GLM5ForCausalLM, in layer order (MTP layers left out)."""
    m = model.model
    return [ly.self_attn.indexer for ly in m.layers[: m.num_main] if ly.self_attn.indexer is not None]


def bytes_per_token(config) -> int:
    """The record's size per generated token: indexer layers x index_topk x 4 (int32)."""
    return config.indexer_types.count("full") * config.index_topk * 4


@contextlib.contextmanager
def _hooked(mods: list[nn.Module], fn) -> Iterator[None]:
    """fn(layer, out) -> None or a replacement, on the output of each of `mods` (layer: its index)."""
    handles = [m.register_forward_hook(partial(_call, fn, j)) for j, m in enumerate(mods)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _call(fn, layer: int, _module, _args, out):
    return fn(layer, out)


@contextlib.contextmanager
def recording(model: nn.Module, prompt_len: int) -> Iterator[list[torch.Tensor]]:
    """Around `glm5.train.rl.rollout.sample(model, prompts [B, P], N, ...)`: yields a list that holds, on
    exit, the int32 [B, N, layers, k] top-k of the queries that produced the N sampled tokens (the prefill's
    last row, then one row per decode step)."""
    calls: list[list[torch.Tensor]] = [[] for _ in indexers(model)]
    result: list[torch.Tensor] = []

    def keep(layer: int, out: torch.Tensor) -> None:
        calls[layer].append(out.detach().to("cpu", torch.int32))

    with _hooked(indexers(model), keep):
        yield result
    if not calls or not calls[0]:
        return
    per_layer = []
    for outs in calls:
        prefill, decode = outs[0], outs[1:]
        k = prefill.shape[-1]
        first = prefill.view(-1, prompt_len, k)[:, -1:]  # [B, 1, k]: the last prompt token's query
        per_layer.append(torch.cat([first, *(d.view(-1, 1, k) for d in decode)], 1))  # [B, N, k]
    result.append(torch.stack(per_layer, 2))


def overlap_shares(rollout: torch.Tensor, train: torch.Tensor) -> torch.Tensor:
    """rollout, train int32 [..., k] (-1 padded) -> fp64 [rows]: |S_rollout & S_train| / |S_train| per
    row, by a sorted search (no [rows, k, k] table)."""
    k = train.shape[-1]
    ref = rollout.reshape(-1, k).to(torch.int64).sort(-1).values
    own = train.reshape(-1, k).to(torch.int64)
    at = torch.searchsorted(ref, own).clamp(max=k - 1)
    valid = own >= 0
    hit = (ref.gather(1, at) == own) & valid
    return hit.sum(1, dtype=torch.float64) / valid.sum(1).clamp(min=1)


class RolloutTopk:
    """One step's recorded top-k [R, N, layers, k] of this rank's rollouts, for the training forwards over
    `cat(prompts, responses)[:, :-1]` (any contiguous slice of rows, as the minibatches take them)."""

    def __init__(self, prompts: torch.Tensor, responses: torch.Tensor, topk: torch.Tensor, replay: bool):
        self.seqs = torch.cat([prompts, responses], 1)[:, :-1].cpu()
        self.p, self.n = prompts.shape[1], responses.shape[1]
        if topk.shape[:2] != responses.shape:
            raise ValueError(
                f"topk: expected [{responses.shape[0]}, {self.n}, layers, k] (rows, generated tokens), "
                f"got {tuple(topk.shape)}"
            )
        self.topk, self.replay = topk, replay
        self.measuring = False
        # per layer, summed over the generated tokens: [0] the sets attended to, [1] the indexer's own
        self.sums = torch.zeros(2, topk.shape[2], dtype=torch.float64)
        self.tokens = torch.zeros(2, topk.shape[2], dtype=torch.float64)
        self._rows: slice | None = None
        self._next = 0

    def _find_rows(self, ids: torch.Tensor) -> slice:
        """The rows of this forward: the next minibatch in order if its tokens match, else any match."""
        b, total = ids.shape[0], self.seqs.shape[0]
        if ids.dim() != 2 or ids.shape[1] != self.seqs.shape[1] or total % b:
            raise RuntimeError(
                f"topk replay: a forward over {tuple(ids.shape)} is not of this step's rollouts"
            )
        ids = ids.cpu()
        starts = list(range(0, total, b))
        first = starts.index(self._next) if self._next in starts else 0
        for s in starts[first:] + starts[:first]:
            if torch.equal(self.seqs[s : s + b], ids):
                self._next = (s + b) % total
                return slice(s, s + b)
        raise RuntimeError("topk replay: a forward over rows that are not this step's rollouts")

    def _pre(self, _module, args, kwargs) -> None:
        ids = args[0] if args else kwargs["input_ids"]
        self._rows = self._find_rows(ids)

    def _indexer(self, layer: int, out: torch.Tensor) -> torch.Tensor | None:
        rows = self._rows
        b, k = rows.stop - rows.start, out.shape[-1]
        rec = self.topk[rows, :, layer].to(out.device)  # [B, N, k]
        used = out
        if self.replay:
            used = out.clone()
            used.view(b, -1, k)[:, self.p - 1 :] = rec
        if self.measuring:
            self._add(layer, 0, overlap_shares(rec, used.view(b, -1, k)[:, self.p - 1 :]))
            self._add(layer, 1, overlap_shares(rec, out.view(b, -1, k)[:, self.p - 1 :]))
        return used if self.replay else None

    def _add(self, layer: int, which: int, shares: torch.Tensor) -> None:
        self.sums[which, layer] += float(shares.sum())
        self.tokens[which, layer] += shares.numel()

    @contextlib.contextmanager
    def hooks(self, model: nn.Module) -> Iterator[None]:
        """Install on `model` (a GLM5ForCausalLM, also FSDP- or plan-wrapped) for the forwards inside."""
        pre = model.register_forward_pre_hook(self._pre, with_kwargs=True)
        try:
            with _hooked(indexers(model), self._indexer):
                yield
        finally:
            pre.remove()
            self._rows = None

    def figures(self, dist: bool = False) -> dict:
        """Over the forwards measured: topk_overlap (mean over layers and generated tokens) and
        topk_overlap_layers (per indexer layer) of the sets the training forward attended to; with replay
        also topk_indexer_overlap, of the sets its own indexer chose (without replay: the same).
        `dist`: summed over every process first (a collective)."""
        counts = torch.stack([self.sums, self.tokens])  # [2, 2, layers]
        if dist:
            import torch.distributed as td

            td.all_reduce(counts)
        sums, tokens = counts

        def mean(i: int) -> float | None:
            return float(sums[i].sum() / tokens[i].sum()) if float(tokens[i].sum()) else None

        layers = [float(s / t) if t else None for s, t in zip(sums[0], tokens[0], strict=True)]
        return {
            "topk_overlap": mean(0),
            "topk_overlap_layers": layers,
            "topk_indexer_overlap": mean(1) if self.replay else None,
        }


# -- vLLM: the same hooks in each worker, rows mapped to requests through the model runner's input batch --


class WorkerRecorder:
    """In a vLLM worker (installed by `install_in_worker`): per step, the plugin's forward gives the step's
    token positions and, in its attention metadata, each request's contiguous rows (query_start_loc) in
    the order of the model runner's `input_batch.req_ids`; the indexer hooks store each request's rows by
    position. Requests are keyed by the id the client gave (vLLM appends `-<8 random chars>`)."""

    def __init__(self, worker) -> None:
        runner = worker.model_runner
        if not hasattr(getattr(runner, "input_batch", None), "req_ids"):
            raise RuntimeError(
                f"topk record: vLLM's {type(runner).__name__} has no input_batch.req_ids (the V1 model "
                "runner's batch order), so its rows cannot be mapped to requests"
            )
        self.runner, self.plugin = runner, worker.get_model()
        self.rows: dict[str, dict[int, list[torch.Tensor | None]]] = {}
        # per request of the step: its id and the (row, position) pairs kept, from its last prompt token on
        self._step: list[tuple[str, list[tuple[int, int]]]] | None = None
        self._layers = len(indexers(self.plugin.glm))

    def _pre(self, _module, args, kwargs) -> None:
        from vllm.forward_context import get_forward_context

        self._step = None
        meta = get_forward_context().attn_metadata
        md = meta.get(self.plugin.first_cache) if isinstance(meta, dict) else None
        if md is None:  # profiling run
            return
        positions = args[1] if len(args) > 1 else kwargs["positions"]
        starts = md.layout.cu_seqlens_q.tolist()
        req_ids = self.runner.input_batch.req_ids[: len(starts) - 1]
        if len(req_ids) != len(starts) - 1 or any(r is None for r in req_ids):
            raise RuntimeError("topk record: vLLM's step has other requests than its input batch")
        pos = positions.to("cpu", torch.int64)
        self._step = []
        for r, a, b in zip(req_ids, starts[:-1], starts[1:], strict=True):
            first = self.runner.requests[r].num_prompt_tokens - 1  # the prompt's other rows are not kept
            keep = [(a + i, p) for i, p in enumerate(pos[a:b].tolist()) if p >= first]
            if keep:
                self._step.append((r.rsplit("-", 1)[0], keep))

    def _indexer(self, layer: int, out: torch.Tensor) -> None:
        if self._step is None:
            return
        for req, keep in self._step:
            per_pos = self.rows.setdefault(req, {})
            for row, p in keep:
                per_pos.setdefault(p, [None] * self._layers)[layer] = out[row].to(
                    "cpu", torch.int32, copy=True
                )

    def take(self, request: str, positions: range) -> torch.Tensor:
        """int32 [len(positions), layers, k] of one request (forgotten afterwards)."""
        per_pos = self.rows.pop(request, {})
        missing = [p for p in positions if p not in per_pos or any(t is None for t in per_pos[p])]
        if missing:
            raise RuntimeError(f"topk record: request {request!r} has no top-k at positions {missing[:4]}")
        return torch.stack([torch.stack(per_pos[p]) for p in positions])


def install_in_worker(worker) -> int:
    """In a vLLM worker (the rollout engine's `glm5_topk_install`, glm5/train/rl/engines/vllm_worker.py):
    record the plugin's indexer top-k -> the indexer layers."""
    rec = worker._glm5_topk = WorkerRecorder(worker)
    rec.plugin.register_forward_pre_hook(rec._pre, with_kwargs=True)
    for j, m in enumerate(indexers(rec.plugin.glm)):
        m.register_forward_hook(partial(_call, rec._indexer, j))
    return rec._layers


def take_from_worker(worker, requests: list[tuple[str, int, int]]) -> torch.Tensor:
    """In a vLLM worker (the rollout engine's `glm5_topk_take`): (request id, prompt length P, tokens N)
    each -> int32 [R, N, layers, k], the rows of positions P-1 .. P+N-2."""
    rec = worker._glm5_topk
    return torch.stack([rec.take(r, range(p - 1, p + n - 1)) for r, p, n in requests])
