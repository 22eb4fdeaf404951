"""The rollout engine's vLLM worker extension (glm5/train/rl/engines/vllm_engine.py passes it as
`worker_extension_cls`): vLLM mixes `RolloutWorkerExtension` into every worker, and the engine calls its
methods by name through `llm.collective_rpc("glm5_...", args=...)`, so no Python callable crosses vLLM's IPC
and vLLM's pickle fallback (VLLM_ALLOW_INSECURE_SERIALIZATION) stays off.

vLLM's msgpack IPC decodes a utility call's arguments and results without their types: a tensor would
arrive as [dtype, shape, buffer index] without its data, so tensors travel as `Wire` = [dtype name, shape,
raw bytes] (bytes, str, int and lists are msgpack's own). Importable in a worker without the trainer.
"""

from __future__ import annotations

import torch

from glm5.train.rl.topk_replay import install_in_worker, take_from_worker

Wire = list  # [dtype name, shape, raw bytes]: one tensor in msgpack's native types


def tensor_to_wire(t: torch.Tensor) -> Wire:
    """A tensor -> [dtype name, shape, its bytes] (any dtype, bf16 included: copied byte for byte)."""
    t = t.detach().to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return [str(t.dtype).removeprefix("torch."), list(t.shape), raw]


def tensor_from_wire(wire: Wire) -> torch.Tensor:
    """[dtype name, shape, bytes] (as `tensor_to_wire` wrote it, lists decoded from msgpack) -> the tensor."""
    name, shape, raw = wire
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"tensor wire: {name!r} is not a torch dtype")
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def named_to_wire(named: list[tuple[str, torch.Tensor]]) -> list[list]:
    """(checkpoint name, tensor) pairs -> [name, Wire] pairs for `glm5_update_weights`."""
    return [[name, tensor_to_wire(t)] for name, t in named]


class RolloutWorkerExtension:
    """Mixed into each vLLM worker (`self` is the worker: `get_model()` is the plugin's model). Names start
    with `glm5_`: vLLM refuses an extension whose attributes collide with the worker's."""

    def glm5_update_weights(self, named: list[list]) -> int:
        """The plugin's in-place `update_weights` on [name, Wire] pairs (each rank keeps its slice) -> how
        many parameters were loaded."""
        pairs = [(name, tensor_from_wire(w)) for name, w in named]
        return len(self.get_model().update_weights(pairs))

    def glm5_topk_install(self) -> int:
        """Record the plugin's indexer top-k per request (glm5/train/rl/topk_replay.py) -> the indexer
        layers."""
        return install_in_worker(self)

    def glm5_topk_take(self, requests: list[list]) -> Wire:
        """[request id, prompt length P, tokens N] each -> the int32 [R, N, layers, k] record as a Wire."""
        return tensor_to_wire(take_from_worker(self, [(r, int(p), int(n)) for r, p, n in requests]))
