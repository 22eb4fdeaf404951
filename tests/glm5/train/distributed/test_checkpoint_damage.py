"""A damaged sharded checkpoint is refused by every loader in one line naming the file and the problem,
before any shard is opened (issue 33 item 3, glm5/train/distributed/manifest.py): `checkpoint export-hf`,
single-process `train --resume`, and the launcher of `train --nproc 2 --resume` (no rank starts). The
checkpoint is saved once for the module by a 2-rank run; each case damages a copy. Cases marked
`restamp` also rewrite the manifest's size and sha256 of the changed file, so only the shards' own
headers (what a rank checks after its launcher read the checksums) can tell."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from glm5.cli import main
from glm5.train.distributed import runtime as distributed
from glm5.train.distributed.manifest import MANIFEST, file_record, verify

ARGS = ["--batch-size", "2", "--seq-len", "16", "--eval-every", "2", "--save-every", "2", "--quiet"]
ARGS += ["--no-rollout-check"]
M0 = "model/shard-00001-model-00001-of-00001.safetensors"
O1 = "trainer/optim/shard-00002-model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("damage") / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "glm5.cli",
        "train",
        "--nproc",
        "2",
        "--out",
        str(out),
        *ARGS,
        "--steps",
        "2",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _rewrite(f: Path, fn) -> None:
    """Re-save the safetensors file `f` with fn(tensors, metadata) applied."""
    with safe_open(f, "pt") as h:
        tensors, meta = {k: h.get_tensor(k) for k in h.keys()}, dict(h.metadata() or {})
    fn(tensors, meta)
    save_file(tensors, f, metadata=meta)


def _restamp(ckpt: Path, name: str) -> None:
    man = json.loads((ckpt / MANIFEST).read_text())
    man["files"][name] = file_record(ckpt / name)
    (ckpt / MANIFEST).write_text(json.dumps(man))


def _first_2d(tensors: dict) -> str:
    return next(k for k, v in sorted(tensors.items()) if v.dim() == 2 and v.shape[0] > 1)


def _int32(t, m):
    k = _first_2d(t)
    t[k] = t[k].to(torch.int32)


def _half_rows(t, m):
    k = _first_2d(t)
    t[k] = t[k][: t[k].shape[0] // 2].contiguous()


def _overlap(t, m):
    info = json.loads(m["DCP_SHARDING_INFO"])
    k = _first_2d(t)
    info[k]["saved_offsets"] = [1, 0]  # one row past its place: it reaches outside or overlaps
    m["DCP_SHARDING_INFO"] = json.dumps(info)


def _drop_key(t, m):
    del t[_first_2d(t)]


def _drop_state(p: Path) -> None:
    meta = json.loads(p.read_text())
    del meta["state"][next(iter(meta["state"]))]  # a parameter would resume with a fresh optimizer state
    p.write_text(json.dumps(meta))


def _name_outside(p: Path) -> None:
    man = json.loads(p.read_text())
    man["files"]["../../../outside.safetensors"] = man["files"][M0]
    p.write_text(json.dumps(man))


def _fifo(p: Path) -> None:
    p.unlink()
    os.mkfifo(p)


def _outside(p: Path) -> None:
    target = p.parent.parent.parent / "elsewhere.safetensors"
    shutil.copy(p, target)
    p.unlink()
    p.symlink_to(target)


# (name, file, damage(path), restamp, word in the one line, trainer-only)
CASES = [
    ("missing", M0, Path.unlink, False, "missing", False),
    ("truncated", M0, lambda p: os.truncate(p, p.stat().st_size // 2), False, "truncated", False),
    ("empty", M0, lambda p: os.truncate(p, 0), False, "truncated", False),
    ("fifo", M0, _fifo, False, "not a regular file", False),
    ("outside", M0, _outside, False, "symlink", False),
    ("changed", M0, lambda p: p.write_bytes(p.read_bytes()[:-4] + b"\0\0\0\0"), False, "sha256", False),
    (
        "extra",
        "model/extra.safetensors",
        lambda p: shutil.copy(p.parent / Path(M0).name, p),
        False,
        "not in manifest.json",
        False,
    ),
    ("int32", M0, lambda p: _rewrite(p, _int32), True, "int32", False),
    ("half-rows", M0, lambda p: _rewrite(p, _half_rows), True, "elements", False),
    ("offsets", M0, lambda p: _rewrite(p, _overlap), True, "piece", False),
    # the tensor's other piece is in the other shard: the line names the model directory and that shard
    ("key-removed", M0, lambda p: _rewrite(p, _drop_key), True, "model: tensor", False),
    (
        "config",
        "config.json",
        lambda p: p.write_text(p.read_text().replace('"hidden_size": ', '"hidden_size": 1')),
        False,
        "the save wrote",
        False,
    ),
    ("manifest-missing", MANIFEST, Path.unlink, False, "missing", False),
    ("manifest-outside", MANIFEST, _name_outside, False, "outside the checkpoint directory", False),
    ("config-not-json", "config.json", lambda p: p.write_text("{"), True, "not valid JSON", False),
    ("manifest-json", MANIFEST, lambda p: p.write_text("{"), False, "not valid JSON", False),
    ("optim-missing", O1, Path.unlink, False, "missing", True),
    ("optim-int32", O1, lambda p: _rewrite(p, _int32), True, "int32", True),
    (
        "optim-entry-dropped",
        "trainer/optimizer.json",
        _drop_state,
        True,
        "optimizer state is incomplete",
        True,
    ),
    ("state-missing", "trainer/trainer_state.json", Path.unlink, False, "trainer_state.json", True),
    (
        "state-six",
        "trainer/trainer_state.json",
        lambda p: p.write_text(p.read_text().replace('"step": 2', '"step": "six"')),
        True,
        "integer 'step'",
        True,
    ),
    ("rng-missing", "trainer/rng-rank1.safetensors", Path.unlink, False, "missing", True),
]


def _one_error(res, *words):
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert res.exit_code == 2, (res.output, repr(res.exception))
    assert len(errors) == 1 and all(w in errors[0] for w in words), res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("name, file, damage, restamp, word, trainer_only", CASES, ids=[c[0] for c in CASES])
def test_every_loader_refuses_a_damaged_sharded_checkpoint_naming_the_file(
    run, tmp_path, monkeypatch, name, file, damage, restamp, word, trainer_only
):
    out = tmp_path / "run"
    shutil.copytree(run, out, symlinks=True)
    ckpt = out / "checkpoints" / "step-000002"
    damage(ckpt / file)
    if restamp:
        _restamp(ckpt, file)
    shown = Path(file).name if name != "key-removed" else "of 32768 elements"
    monkeypatch.setattr(distributed, "launch", lambda argv, n: pytest.fail(f"ranks started for {argv}"))
    runner = CliRunner()
    resume = ["train", "--out", str(out), *ARGS, "--steps", "3", "--resume"]
    _one_error(runner.invoke(main, resume), shown, word)
    _one_error(runner.invoke(main, [*resume, "--nproc", "2"]), shown, word)
    res = runner.invoke(main, ["checkpoint", "export-hf", str(ckpt), str(tmp_path / "hf")])
    if trainer_only:  # the model alone is intact: the export needs nothing else
        assert res.exit_code == 0, res.output
    else:
        _one_error(res, shown, word)
        assert not (tmp_path / "hf").exists()
    if restamp and file.endswith(".safetensors"):  # what a rank checks alone (its launcher read the sha256)
        with pytest.raises(ValueError, match=word):
            verify(ckpt, trainer=True, checksums=False)


def test_generate_and_quantize_on_a_sharded_checkpoint_say_how_to_convert_it(run, tmp_path):
    ckpt = str(run / "checkpoints" / "latest")
    for args in (
        ["generate", "--model", ckpt, "--prompt-ids", "1,2"],
        ["quantize", "--model", ckpt, "--out", str(tmp_path / "q"), "--format", "fp8"],
    ):
        _one_error(CliRunner().invoke(main, args), "glm5 checkpoint export-hf")
