"""A full disk is one line naming the file, exit 1, in every command (the glm5 group turns ENOSPC / EDQUOT /
EROFS / EFBIG into it; DCP's CheckpointException is unwrapped to the OSError it holds), and `port init`'s
file-system refusals are one line, exit 2 (issue 33 item 4)."""

from __future__ import annotations

import errno
import os

import pytest
from click.testing import CliRunner
from torch.distributed.checkpoint.api import CheckpointException

from glm5.cli import main
from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.infra import fsio
from glm5.train.distributed import checkpoint as dist_state


def _one_line(res, code, *words):
    lines = [ln for ln in res.output.splitlines() if ln.lower().startswith("error")]
    assert res.exit_code == code, (res.output, repr(res.exception))
    assert len(lines) == 1 and all(w in lines[0] for w in words), res.output
    assert "Traceback" not in res.output


def _full(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_port_init_on_a_full_disk_is_one_line_exit_1(tmp_path, monkeypatch):
    def full(path, text):
        raise _full(path)

    monkeypatch.setattr(fsio, "write_text_atomic", full)
    res = CliRunner().invoke(main, ["port", "init", "npu2", "--dir", str(tmp_path / "pkg")])
    _one_line(res, 1, "No space left on device", "pkg")
    assert not (tmp_path / "pkg").exists()


def test_import_hf_on_a_full_disk_is_one_line_exit_1(tmp_path, monkeypatch):
    hf = tmp_path / "hf"
    GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="reference").save_pretrained(hf)

    def full(state, storage_writer, no_dist):  # what DCP raises: each rank's error, wrapped
        raise CheckpointException(
            "save failed", {0: (_full(f"{storage_writer.path}/shard.safetensors"), None)}
        )

    monkeypatch.setattr(dist_state.dcp, "save", full)
    res = CliRunner().invoke(main, ["checkpoint", "import-hf", str(hf), str(tmp_path / "out")])
    _one_line(res, 1, "No space left on device", "shard.safetensors")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["long-name", "symlink-loop", "read-only"])
def test_port_init_file_system_refusals_are_one_line(tmp_path, case):
    name, where = "npu2", tmp_path / "pkg"
    if case == "long-name":
        name, where = "n" * 300, None
    elif case == "symlink-loop":
        (tmp_path / "a").symlink_to(tmp_path / "b")
        (tmp_path / "b").symlink_to(tmp_path / "a")
        where = tmp_path / "a" / "pkg"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only directory")
        (tmp_path / "ro").mkdir(mode=0o555)
        where = tmp_path / "ro" / "pkg"
    args = ["port", "init", name] + ([] if where is None else ["--dir", str(where)])
    res = CliRunner().invoke(main, args)
    _one_line(res, 2)


def test_conformance_report_on_a_full_disk_is_one_line_exit_1(tmp_path, monkeypatch):
    from conformance import report

    def full(path, text):
        raise _full(path)

    monkeypatch.setattr(report, "write_text_report", full)
    out = tmp_path / "c.json"
    args = ["conformance", "--backend", "reference", "--ops", "topk", "--suite", "smoke", "--json", str(out)]
    res = CliRunner().invoke(main, args)
    _one_line(res, 1, "No space left on device", "c.json")


@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM])
def test_a_file_the_user_may_not_touch_is_one_line_exit_1(tmp_path, monkeypatch, code):
    # what an unreadable `quantize` source or an unwritable output raises (untestable as root with chmod):
    # the glm5 group turns it into one line naming the file, whichever command met it
    from conformance import report

    def denied(path, text):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(report, "write_text_report", denied)
    out = tmp_path / "c.json"
    args = ["conformance", "--backend", "reference", "--ops", "topk", "--suite", "smoke", "--json", str(out)]
    res = CliRunner().invoke(main, args)
    _one_line(res, 1, os.strerror(code), "c.json")
