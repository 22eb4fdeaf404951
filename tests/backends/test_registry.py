"""The backend registry and capability claims (SPEC 3, SPEC 6).

Nothing is silently absent: built-ins that fail to import and plugins that raise are listed with the
exception. Out-of-tree backends come through the `glm5.backends` entry-point group: a real package is
built and installed with pip into a temporary directory. Claims are tested both ways: every dtype the
reference claims runs, and an unclaimed dtype, layout, device or op raises `NotSupported`.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import backends
from backends import Backend, BackendUnavailable, NotSupported, OpCaps, OpImpl, SeqLayout, registry
from backends.caps import CACHE_KINDS
from backends.contract.ops import OPS
from backends.counters import REFERENCE_CALLS
from backends.reference.w4a8_matmul import pack_int4
from tests.backends.reference._fp8_samples import FP8_OUT_DTYPE

BUILTINS = ["reference", "cpu", "cuda", "ascend", "onnxruntime"]


@pytest.fixture(autouse=True)
def fresh_registry():
    backends.refresh()
    yield
    backends.refresh()


def test_available_lists_every_builtin_with_ok_and_reason():
    rows = backends.available()
    assert [r[0] for r in rows][: len(BUILTINS)] == BUILTINS
    for name, ok, reason in rows:
        assert isinstance(ok, bool) and isinstance(reason, str) and reason, name
    assert rows[0][1] is True


def test_broken_builtin_shows_its_import_error(monkeypatch, tmp_path):
    (tmp_path / "glm5_broken_builtin.py").write_text(
        "raise ImportError('libwidget.so: cannot open shared object')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.BUILTIN, "ascend", "glm5_broken_builtin:AscendBackend")
    monkeypatch.setitem(registry.BUILTIN, "onnxruntime", "glm5_no_such_module_xyz:OnnxRuntimeBackend")
    rows = {name: (ok, reason) for name, ok, reason in backends.available()}
    assert rows["ascend"][0] is False and "ImportError: libwidget.so" in rows["ascend"][1]
    assert rows["onnxruntime"][0] is False and "ModuleNotFoundError" in rows["onnxruntime"][1]
    with pytest.raises(BackendUnavailable, match="ascend.*libwidget.so"):
        backends.get("ascend")
    sys.modules.pop("glm5_broken_builtin", None)


def test_get_by_name_env_and_default(monkeypatch):
    monkeypatch.delenv("GLM5_BACKEND", raising=False)
    ref = backends.get("reference")
    assert ref.name == "reference" and backends.get() is ref
    monkeypatch.setenv("GLM5_BACKEND", "reference")
    assert backends.get() is ref
    monkeypatch.setenv("GLM5_BACKEND", "no-such-backend")
    known = "unknown backend 'no-such-backend'; known: reference, cpu, cuda"
    with pytest.raises(BackendUnavailable, match=known):
        backends.get()


def test_unknown_name_lists_known_ones():
    with pytest.raises(BackendUnavailable) as e:
        backends.get("tpu")
    for name in BUILTINS:
        assert name in str(e.value)


# -- out-of-tree plugins through the entry-point group ---------------------------------------------

PLUGIN_MODULE = """
import torch
from backends import Backend, OpCaps, OpImpl


def _topk(x, k, lengths=None):
    # test plugin: not the reference, just enough for a finite, tie-free input
    vals, idx = torch.sort(x.float(), dim=-1, descending=True, stable=True)
    return vals[:, :k].to(x.dtype), idx[:, :k].to(torch.int32)


class PluginBackend(Backend):
    name = "testplug"
    ops = {"topk": OpImpl(_topk, OpCaps(("float32",), tie_rule="none"))}

    def available(self):
        return True, "widget found"


class OffBackend(Backend):
    name = "offplug"

    def available(self):
        return False, "no widget on this machine"
"""

PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "glm5-test-plugin"
version = "0.0.1"

[project.entry-points."glm5.backends"]
testplug = "glm5_test_plugin:PluginBackend"
offplug = "glm5_test_plugin:OffBackend"
brokenplug = "glm5_test_plugin_broken:Anything"
misnamed = "glm5_test_plugin:PluginBackend"
reference = "glm5_test_plugin:PluginBackend"

[tool.setuptools]
py-modules = ["glm5_test_plugin", "glm5_test_plugin_broken"]
"""


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    src = tmp_path_factory.mktemp("plugin_src")
    (src / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (src / "glm5_test_plugin.py").write_text(textwrap.dedent(PLUGIN_MODULE))
    (src / "glm5_test_plugin_broken.py").write_text("raise RuntimeError('plugin exploded on import')\n")
    site = tmp_path_factory.mktemp("plugin_site")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-build-isolation",
            "--no-deps",
            "--no-index",
            "--quiet",
            "--target",
            str(site),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    yield site
    for mod in ("glm5_test_plugin", "glm5_test_plugin_broken"):
        sys.modules.pop(mod, None)


def test_plugin_through_entry_point(plugin_site, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_site))
    backends.refresh()
    rows = {name: (ok, reason) for name, ok, reason in backends.available()}
    assert list(rows)[: len(BUILTINS)] == BUILTINS
    ok, reason = rows["testplug"]
    assert ok and "widget found" in reason and "plugin glm5-test-plugin" in reason
    be = backends.get("testplug")
    vals, idx = be.topk(torch.tensor([[1.0, 3.0, 2.0]]), 2)
    assert idx.tolist() == [[1, 2]] and be.calls["topk"] == 1
    monkeypatch.setenv("GLM5_BACKEND", "testplug")
    assert backends.get() is be
    # broken plugins are listed with their exception, never absent
    assert (
        rows["brokenplug"][0] is False and "RuntimeError: plugin exploded on import" in rows["brokenplug"][1]
    )
    assert rows["misnamed"][0] is False and "calls itself 'testplug'" in rows["misnamed"][1]
    assert rows["offplug"] == (
        False,
        "no widget on this machine [plugin glm5-test-plugin (glm5_test_plugin:OffBackend)]",
    )
    with pytest.raises(BackendUnavailable, match="offplug.*no widget"):
        backends.get("offplug")
    with pytest.raises(BackendUnavailable, match="plugin exploded"):
        backends.get("brokenplug")
    # a plugin cannot shadow a built-in
    assert (
        backends.get("reference").name == "reference"
        and type(backends.get("reference")).__module__ == "backends.reference.backend"
    )


# -- capability claims -----------------------------------------------------------------------------

FLOAT_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sample(op: str, dt: str, layout_kind: str = "ragged") -> dict:
    """A tiny valid input of `op` on dtype-axis value `dt`."""
    if op.startswith("fp8_") or layout_kind.startswith("fp8_"):  # SPEC 7; FP8 rows (SPEC 7.8)
        from tests.backends.reference._fp8_samples import fp8_sample

        kind = layout_kind.removeprefix("fp8_")
        if op == "indexer_topk":  # float q and weights, the keys in the FP8 indexer cache
            from backends.formats import index_cache_of, write_index_cache

            k = torch.randn(6, 16)
            lay = SeqLayout.from_lengths([2], [6], block_size=3 if kind == "paged" else None)
            kc = index_cache_of(k)
            if kind == "paged":
                kc = torch.zeros(2, 3, 20, dtype=torch.uint8)
                write_index_cache(kc, torch.arange(6), k)
            q = torch.randn(2, 2, 16).to(FLOAT_DT.get(dt, torch.float32))
            return dict(q=q, k_cache=kc, weights=torch.randn(2, 2), layout=lay, topk=3)
        return fp8_sample(op if op.startswith("fp8_") else f"fp8_{op}", dt, kind)
    f = FLOAT_DT.get(dt, torch.float32)
    paged = layout_kind == "paged"

    def cache(rows: int, d: int) -> tuple[torch.Tensor, SeqLayout]:
        bs = 3 if paged else None
        lay = SeqLayout.from_lengths([2], [rows], block_size=bs)
        c = torch.randn((-(-rows // 3), 3, d) if paged else (rows, d)).to(f)
        return c, lay

    if op in ("indexer_logits", "indexer_topk"):
        kc, lay = cache(5, 4)
        a = dict(q=torch.randn(2, 2, 4).to(f), k_cache=kc, weights=torch.randn(2, 2), layout=lay)
        return a | ({"topk": 3} if op == "indexer_topk" else {})
    if op == "topk":
        return dict(x=torch.randn(2, 5).to(f), k=3, lengths=None)
    if op == "sparse_mla_attention":
        kc, lay = cache(4, 6)
        return dict(
            q=torch.randn(2, 2, 6).to(f),
            kv_cache=kc,
            indices=torch.tensor([[0, 1], [3, -1]], dtype=torch.int32),
            layout=lay,
            sm_scale=0.5,
            d_v=4,
        )
    if op == "dynamic_quant_int8":
        return dict(x=torch.randn(3, 4).to(f))
    i8 = lambda *s: torch.randint(-128, 128, s, dtype=torch.int8)  # noqa: E731
    if op == "w8a8_matmul":
        return dict(
            x_q=i8(2, 4), x_scale=torch.rand(2), w_q=i8(3, 4), w_scale=torch.rand(3), bias=None, out_dtype=f
        )
    if op == "w4a8_matmul":
        return dict(
            x_q=i8(2, 4),
            x_scale=torch.rand(2),
            w_packed=pack_int4(torch.randint(-8, 8, (3, 4))),
            w_scale=torch.rand(3, 2),
            group_size=2,
            bias=None,
            out_dtype=f,
        )
    if op == "grouped_matmul":
        offs = torch.tensor([0, 1, 3], dtype=torch.int32)
        if dt == "w8a8":
            return dict(
                x=i8(3, 4),
                w=i8(2, 2, 4),
                group_offsets=offs,
                x_scale=torch.rand(3),
                w_scale=torch.rand(2, 2),
                group_size=None,
                out_dtype=torch.bfloat16,
            )
        if dt == "w4a8":
            return dict(
                x=i8(3, 4),
                w=pack_int4(torch.randint(-8, 8, (2, 2, 4))),
                group_offsets=offs,
                x_scale=torch.rand(3),
                w_scale=torch.rand(2, 2, 2),
                group_size=2,
                out_dtype=torch.bfloat16,
            )
        return dict(
            x=torch.randn(3, 4).to(f),
            w=torch.randn(2, 2, 4).to(f),
            group_offsets=offs,
            x_scale=None,
            w_scale=None,
            group_size=None,
            out_dtype=None,
        )
    if op == "linear_cross_entropy":
        return dict(
            h=torch.randn(3, 4).to(f),
            weight=torch.randn(5, 4).to(f),
            targets=torch.tensor([0, 4, 2]),
            ignore_index=-100,
        )
    return OPS[op].sample(torch.Generator().manual_seed(0), dt, False)  # its declaration's


CLAIMS = [(op, dt) for op, spec in OPS.items() for dt in spec.dtype_axis]


@pytest.mark.parametrize(("op", "dt"), CLAIMS, ids=[f"{o}-{d}" for o, d in CLAIMS])
def test_reference_claims_every_dtype_and_each_runs(op, dt):
    ref = backends.get("reference")
    caps = ref.capabilities(op)
    assert dt in caps.dtypes
    kinds = caps.layouts or ("none",)
    # split pools (backends/cache_layout.py) are run by tests/backends/test_cache_layout.py
    assert OPS[op].cache_arg is None or set(kinds) & {"ragged", "paged", "fp8_ragged", "fp8_paged"}
    assert set(kinds) <= set(CACHE_KINDS) | {"none"}
    for kind in (k for k in kinds if k != "pools"):
        args = sample(op, dt, kind)
        assert OPS[op].dtype_of(args) == dt
        before, ref_before = ref.calls[op], sum(REFERENCE_CALLS.values())
        out = getattr(ref, op)(**args)
        assert ref.calls[op] == before + 1
        # the fallback detector sees every reference op (FP8 rows: the FP8 op's reference runs)
        assert sum(REFERENCE_CALLS.values()) >= ref_before + 1
        first = out[0] if isinstance(out, tuple) else out
        assert first.dtype == OUT_DTYPE[op](dt), (op, dt, first.dtype)


OUT_DTYPE = {
    "indexer_logits": lambda dt: torch.float32,
    "indexer_topk": lambda dt: torch.int32,
    "topk": lambda dt: FLOAT_DT[dt],
    "sparse_mla_attention": lambda dt: FLOAT_DT[dt],
    "dynamic_quant_int8": lambda dt: torch.int8,
    "w8a8_matmul": lambda dt: FLOAT_DT[dt],
    "w4a8_matmul": lambda dt: FLOAT_DT[dt],
    "grouped_matmul": lambda dt: FLOAT_DT.get(dt, torch.bfloat16),
    "linear_cross_entropy": lambda dt: torch.float32,
    "linear_cross_entropy_shard": lambda dt: torch.float32,
    "silu_and_mul": lambda dt: FLOAT_DT[dt],
}
OUT_DTYPE.update(FP8_OUT_DTYPE)


class TinyBackend(Backend):
    """Declares less than the reference: fp32 only, ragged only, two ops, a head limit."""

    name = "tiny"
    served: list[str] = []

    @staticmethod
    def _topk(x, k, lengths=None):
        TinyBackend.served.append("topk")
        return x[:, :k], torch.zeros(x.shape[0], k, dtype=torch.int32)

    @staticmethod
    def _logits(q, k_cache, weights, layout):
        TinyBackend.served.append("indexer_logits")
        return torch.zeros(q.shape[0], layout.max_seqlen_k)

    ops = {
        "topk": OpImpl(_topk, OpCaps(("float32",), tie_rule="none")),
        "indexer_logits": OpImpl(
            _logits,
            OpCaps(
                ("float32",),
                ("ragged",),
                notes={"heads": "power of two"},
                check=lambda a: (
                    [] if a["q"].shape[1] in (1, 2, 4) else [f"heads {a['q'].shape[1]} not a power of two"]
                ),
            ),
        ),
    }


def test_unclaimed_dtype_layout_op_device_and_limit_raise_not_supported():
    be, TinyBackend.served = TinyBackend(), []
    be.topk(torch.randn(2, 5), 2)
    with pytest.raises(
        NotSupported, match=r"tiny\.topk not supported: dtype bfloat16 not in supported \['float32'\]"
    ):
        be.topk(torch.randn(2, 5).bfloat16(), 2)
    with pytest.raises(NotSupported, match="paged cache layout not in supported"):
        be.indexer_logits(**sample("indexer_logits", "float32", "paged"))
    args = sample("indexer_logits", "float32")
    be.indexer_logits(**args)
    args["q"], args["weights"] = torch.randn(2, 3, 4), torch.randn(2, 3)
    with pytest.raises(NotSupported, match="heads 3 not a power of two"):
        be.indexer_logits(**args)
    with pytest.raises(
        NotSupported, match="op 'dynamic_quant_int8' is not implemented by backend 'tiny'"
    ) as e:
        be.dynamic_quant_int8(torch.randn(2, 3))
    assert e.value.backend == "tiny" and e.value.op == "dynamic_quant_int8"
    assert TinyBackend.served == ["topk", "indexer_logits"] and be.calls == {"topk": 1, "indexer_logits": 1}


def test_device_mismatch_is_a_reason():
    class Elsewhere(TinyBackend):
        name, device = "elsewhere", "meta"

    with pytest.raises(NotSupported, match="x is on cpu; this backend runs on meta"):
        Elsewhere().topk(torch.randn(2, 5), 2)


def test_caps_reject_unknown_tie_rule_and_layout():
    with pytest.raises(ValueError, match="^tie_rule: expected"):
        OpCaps(("float32",), tie_rule="random")
    with pytest.raises(ValueError, match="^layouts: expected"):
        OpCaps(("float32",), ("tnd",))
