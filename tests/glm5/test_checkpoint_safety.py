"""Hostile and interrupted checkpoints (issue 13 items 3, 4, 8, 9): saves killed with SIGKILL never leave
the path without a checkpoint nor leak staging directories, an index cannot name files outside the
directory (nor a FIFO), files are readable by other users, and a checkpoint without an MTP layer loads."""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm5.core.checkpoint import CheckpointError, NotACheckpoint
from glm5.core.model import GLM5ForCausalLM
from tests.glm5._util import random_ids

_SAVER = textwrap.dedent(
    """
    import sys, torch
    torch.set_num_threads(1)
    from tests.glm5._util import make_model
    m = make_model()
    m.save_pretrained(sys.argv[1])
    print("ready", flush=True)
    while True:
        m.save_pretrained(sys.argv[1], max_shard_size=40_000)
    """
)


def _staging(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def _kill_a_saver(path) -> int:
    """Start a process that saves to `path` in a loop, watch the path for a second, SIGKILL the saver;
    the number of looks that found no complete checkpoint."""
    child = subprocess.Popen(
        [sys.executable, "-c", _SAVER, str(path)],
        stdout=subprocess.PIPE,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert child.stdout.readline().strip() == b"ready"
    end = time.monotonic() + 1.0
    gaps = 0
    while time.monotonic() < end:  # the path always holds a complete checkpoint
        gaps += not (path / "config.json").is_file()
    child.send_signal(signal.SIGKILL)
    child.wait()
    return gaps


def test_killed_saves_never_empty_the_path_nor_leak_staging(tmp_path):
    path = tmp_path / "ckpt"
    # the kill lands between two saves now and then (the loop's short gap): kill again until one
    # interrupts a save mid-way, so the staging clean-up below is exercised
    for _ in range(5):
        assert _kill_a_saver(path) == 0
        GLM5ForCausalLM.from_pretrained(path, backend="reference")  # whichever save won, it is whole
        if _staging(tmp_path):
            break
    assert _staging(tmp_path), "none of 5 kills interrupted a save mid-way"
    GLM5ForCausalLM.from_pretrained(path, backend="reference").save_pretrained(path)
    assert _staging(tmp_path) == []  # the next save removed what the killed ones left


def test_saved_files_are_readable_by_others(tiny, tmp_path):
    tiny.save_pretrained(tmp_path / "c")
    mask = os.umask(0)
    os.umask(mask)
    for p in [tmp_path / "c", *(tmp_path / "c").iterdir()]:
        mode = stat.S_IMODE(p.stat().st_mode)
        want = (0o777 if p.is_dir() else 0o666) & ~mask
        assert mode == want, (p.name, oct(mode))


def _sharded(tiny, tmp_path):
    path = tmp_path / "c"
    tiny.save_pretrained(path, max_shard_size=40_000)
    return path, json.loads((path / "model.safetensors.index.json").read_text())


def _write_index(path, index):
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_index_cannot_name_files_outside_the_directory(tiny, tmp_path, kind):
    path, index = _sharded(tiny, tmp_path)
    name = next(iter(index["weight_map"]))
    shard = path / index["weight_map"][name]
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.safetensors").write_bytes(shard.read_bytes())
    if kind == "dotdot":
        target = "../other/x.safetensors"
    elif kind == "absolute":
        target = str(other / "x.safetensors")
    else:
        (path / "link.safetensors").symlink_to(other / "x.safetensors")
        target = "link.safetensors"
    index["weight_map"][name] = target
    _write_index(path, index)
    with pytest.raises(ValueError, match="weight_map"):
        GLM5ForCausalLM.from_pretrained(path, backend="reference")


def _alarm(seconds):
    def boom(*_):
        raise TimeoutError("blocked opening a checkpoint file")

    signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)


def test_index_naming_a_fifo_or_proc_fails_instead_of_hanging(tiny, tmp_path):
    path, index = _sharded(tiny, tmp_path)
    os.mkfifo(path / "pipe.safetensors")
    name = next(iter(index["weight_map"]))
    for target in ("pipe.safetensors", "/proc/self/environ"):
        index["weight_map"][name] = target
        _write_index(path, index)
        _alarm(20)
        try:
            with pytest.raises(ValueError, match="regular file|outside|inside"):
                GLM5ForCausalLM.from_pretrained(path, backend="reference")
        finally:
            signal.alarm(0)


def test_fifo_among_shards_without_index_fails_instead_of_hanging(tiny, tmp_path):
    tiny.save_pretrained(tmp_path / "c")
    os.mkfifo(tmp_path / "c" / "a.safetensors")
    _alarm(20)
    try:
        with pytest.raises(ValueError, match="regular file"):
            GLM5ForCausalLM.from_pretrained(tmp_path / "c", backend="reference")
    finally:
        signal.alarm(0)


def test_directory_that_is_not_a_checkpoint_says_so(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "checkpoints" / "latest").symlink_to("step-000002")
    with pytest.raises(NotACheckpoint, match="checkpoints/latest"):
        GLM5ForCausalLM.from_pretrained(run, backend="reference")


def _drop_mtp(path, names=None, config_key=True):
    f = path / "model.safetensors"
    t = load_file(f)
    for k in [k for k in t if k.startswith("model.layers.4.") and (names is None or k.endswith(names))]:
        del t[k]
    save_file(t, f)
    if not config_key:
        cfg = json.loads((path / "config.json").read_text())
        del cfg["num_nextn_predict_layers"]
        (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("config_key", [False, True], ids=["transformers-saved", "mtp-dropped"])
def test_checkpoint_without_mtp_loads_as_no_mtp(tiny, tmp_path, caplog, config_key):
    tiny.save_pretrained(tmp_path / "c")
    _drop_mtp(tmp_path / "c", config_key=config_key)
    with caplog.at_level(logging.WARNING, logger="glm5"):
        m = GLM5ForCausalLM.from_pretrained(tmp_path / "c", backend="reference")
    assert m.config.num_nextn_predict_layers == 0
    assert len([r for r in caplog.records if "MTP" in r.getMessage()]) == 1
    ids = random_ids(1, 12)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, tiny(ids).logits)


def test_partial_mtp_layer_fails_by_name(tiny, tmp_path):
    tiny.save_pretrained(tmp_path / "c")
    _drop_mtp(tmp_path / "c", names="eh_proj.weight")
    with pytest.raises(CheckpointError, match=r"model\.layers\.4\.eh_proj\.weight"):
        GLM5ForCausalLM.from_pretrained(tmp_path / "c", backend="reference")


def test_quantized_loader_refuses_an_index_outside_the_directory(tiny, tmp_path):
    from quant.load import export, load_quantized
    from quant.quantize import quantize_model

    m = GLM5ForCausalLM(tiny.config, backend="reference")
    m.load_state_dict(tiny.state_dict())
    quantize_model(m, "glm5-w8a8")
    export(m, tmp_path / "q", "compressed-tensors")
    names = list(load_file(tmp_path / "q" / "model.safetensors"))
    (tmp_path / "elsewhere.safetensors").write_bytes((tmp_path / "q" / "model.safetensors").read_bytes())
    index = {"weight_map": {n: "../elsewhere.safetensors" for n in names}}
    (tmp_path / "q" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="leaves the directory"):
        load_quantized(tmp_path / "q")
