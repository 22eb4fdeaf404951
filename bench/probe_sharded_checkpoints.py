"""Probe: damaged sharded checkpoints x loaders, and kills of a 2-rank run (issue 33's measurement).

    python bench/probe_sharded_checkpoints.py [--kinds N] [--no-kills]

Saves one 2-rank run (tiny, 2 steps), then for each kind of damage (a copy each) runs the three loaders as
a user would (`glm5 checkpoint export-hf`, `glm5 train --resume`, `glm5 train --nproc 2 --resume`) and
counts the outcomes: a one-line refusal (exit != 0, one `Error:` line, no traceback), a traceback, a hang
(no exit within the timeout) or a silent load (exit 0 on damage the loader reads; export-hf of a
checkpoint whose model part is intact is a correct load, counted apart). Then kills: SIGKILL of the
launcher (ranks left running after 10 s), SIGKILL of rank 1 and SIGINT of the launcher (the launcher's
lines and exit code), each followed by a --resume. Prints one line per trial and the totals."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--batch-size", "2", "--seq-len", "16", "--eval-every", "2", "--save-every", "2", "--quiet"]
ARGS += ["--no-rollout-check"]
M0 = "model/shard-00001-model-00001-of-00001.safetensors"
O1 = "trainer/optim/shard-00002-model-00001-of-00001.safetensors"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def glm5(*args: str, timeout: float = 180) -> tuple[str, int | None, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "glm5.cli", *args],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "hang", None, ""
    text = out + err
    if proc.returncode == 0:
        return "load", 0, text
    errors = [ln for ln in text.splitlines() if ln.startswith("Error")]
    kind = "traceback" if "Traceback" in text else "refusal" if len(errors) == 1 else "other"
    return kind, proc.returncode, (errors or text.splitlines()[-1:] or [""])[0]


# -- damage ------------------------------------------------------------------------------------------
def _st_rewrite(f: Path, fn) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(f, "pt") as h:
        tensors, meta = {k: h.get_tensor(k) for k in h.keys()}, dict(h.metadata() or {})
    fn(tensors, meta)
    save_file(tensors, f, metadata=meta)


def _restamp(ckpt: Path, name: str) -> None:
    from glm5.train.distributed.manifest import file_record

    man = json.loads((ckpt / "manifest.json").read_text())
    man["files"][name] = file_record(ckpt / name)
    (ckpt / "manifest.json").write_text(json.dumps(man))


def _k2(t):
    return next(k for k, v in sorted(t.items()) if v.dim() == 2 and v.shape[0] > 1)


def _int32(t, m):
    t[_k2(t)] = t[_k2(t)].to(__import__("torch").int32)


def _half(t, m):
    k = _k2(t)
    t[k] = t[k][: t[k].shape[0] // 2].contiguous()


def _offsets(value):
    def fn(t, m):
        info = json.loads(m["DCP_SHARDING_INFO"])
        info[_k2(t)]["saved_offsets"] = value
        m["DCP_SHARDING_INFO"] = json.dumps(info)

    return fn


def _info_text(t, m):
    m["DCP_SHARDING_INFO"] = "{not json"


def _drop(t, m):
    del t[_k2(t)]


def st(fn):  # a safetensors rewrite, the manifest restamped (only the headers can tell)
    return lambda c, name: (_st_rewrite(c / name, fn), _restamp(c, name))


def json_edit(old, new, restamp=True):
    def damage(c, name):
        p = c / name
        p.write_text(p.read_text().replace(old, new, 1))
        if restamp:
            _restamp(c, name)

    return damage


def unlink(c, name):
    p = c / name
    shutil.rmtree(p) if p.is_dir() else p.unlink()


def fifo(c, name):
    (c / name).unlink()
    os.mkfifo(c / name)


def truncate(frac):
    return lambda c, name: os.truncate(c / name, int((c / name).stat().st_size * frac))


def symlink_out(c, name):
    target = c.parent.parent.parent / f"outside-{Path(name).name}"
    shutil.copy(c / name, target)
    (c / name).unlink()
    (c / name).symlink_to(target)


def symlink_in(c, name):
    (c / name).unlink()
    (c / name).symlink_to(c / "model" / "shard-00002-model-00001-of-00001.safetensors")


def flip(c, name):
    p = c / name
    b = bytearray(p.read_bytes())
    b[-3] ^= 0xFF
    p.write_bytes(bytes(b))


def dir_instead(c, name):
    (c / name).unlink()
    (c / name).mkdir()


def extra(c, name):
    shutil.copy(c / M0, c / name)


def manifest_outside(c, name):
    man = json.loads((c / "manifest.json").read_text())
    man["files"]["../../../outside.safetensors"] = man["files"][M0]
    (c / "manifest.json").write_text(json.dumps(man))


def write(text):
    return lambda c, name: (c / name).write_text(text)


# (kind, file, damage, reaches the model part: export-hf must refuse it too)
KINDS = [
    ("model shard missing", M0, unlink, True),
    ("model shard truncated", M0, truncate(0.5), True),
    ("model shard empty", M0, truncate(0), True),
    ("model shard a FIFO", M0, fifo, True),
    ("model shard a symlink outside", M0, symlink_out, True),
    ("model shard a symlink to another shard", M0, symlink_in, True),
    ("model shard a byte flipped", M0, flip, True),
    ("model shard a directory", M0, dir_instead, True),
    ("extra shard in model/", "model/extra.safetensors", extra, True),
    ("model shard int32 (restamped)", M0, st(_int32), True),
    ("half the rows of a tensor (restamped)", M0, st(_half), True),
    ("overlapping offsets (restamped)", M0, st(_offsets([1, 0])), True),
    ("out-of-range offsets (restamped)", M0, st(_offsets([10**6, 0])), True),
    ("offsets of wrong rank (restamped)", M0, st(_offsets([0])), True),
    ("DCP_SHARDING_INFO not JSON (restamped)", M0, st(_info_text), True),
    ("a key removed (restamped)", M0, st(_drop), True),
    ("model/ missing", "model", unlink, True),
    (
        "config.json hidden_size changed",
        "config.json",
        json_edit('"hidden_size": ', '"hidden_size": 1', False),
        True,
    ),
    ("config.json missing", "config.json", unlink, True),
    (
        "config.json not JSON (restamped)",
        "config.json",
        lambda c, n: (write("{")(c, n), _restamp(c, n)),
        True,
    ),
    ("manifest.json missing", "manifest.json", unlink, True),
    ("manifest.json not JSON", "manifest.json", write("{"), True),
    ("manifest.json a FIFO", "manifest.json", fifo, True),
    ("manifest.json names a path outside", "manifest.json", manifest_outside, True),
    ("optimizer shard missing", O1, unlink, False),
    ("optimizer shard truncated", O1, truncate(0.5), False),
    ("optimizer shard int32 (restamped)", O1, st(_int32), False),
    ("optimizer shard half rows (restamped)", O1, st(_half), False),
    ("optimizer.json missing", "trainer/optimizer.json", unlink, False),
    (
        "optimizer.json not JSON (restamped)",
        "trainer/optimizer.json",
        lambda c, n: (write("[")(c, n), _restamp(c, n)),
        False,
    ),
    ("trainer_state.json missing", "trainer/trainer_state.json", unlink, False),
    (
        'trainer_state.json step "six" (restamped)',
        "trainer/trainer_state.json",
        json_edit('"step": 2', '"step": "six"'),
        False,
    ),
    (
        "trainer_state.json unknown option (restamped)",
        "trainer/trainer_state.json",
        json_edit('"config": {', '"config": {"bogus": 1, '),
        False,
    ),
    ("trainer/ missing", "trainer", unlink, False),
    ("rng-rank1 missing", "trainer/rng-rank1.safetensors", unlink, False),
    ("rng-rank0 a FIFO", "trainer/rng-rank0.safetensors", fifo, False),
]


def probe_damage(base: Path, tmp: Path, kinds: list) -> dict:
    totals: dict[str, int] = {}
    for i, (kind, name, damage, model_part) in enumerate(kinds):
        for loader in ("export-hf", "resume", "nproc2-resume"):  # a copy each: a silent resume changes it
            run = tmp / f"d{i}-{loader}"
            shutil.copytree(base, run, symlinks=True)
            ckpt = run / "checkpoints" / "step-000002"
            damage(ckpt, name)
            train = ["train", "--out", str(run), *ARGS, "--steps", "3", "--resume"]
            args = {
                "export-hf": ["checkpoint", "export-hf", str(ckpt), str(tmp / f"hf{i}")],
                "resume": train,
                "nproc2-resume": [*train, "--nproc", "2"],
            }[loader]
            outcome, code, line = glm5(*args)
            if outcome == "load":
                outcome = "correct load" if loader == "export-hf" and not model_part else "silent load"
            totals[outcome] = totals.get(outcome, 0) + 1
            print(f"{kind:45s} {loader:14s} {outcome:13s} {code}  {line[:150]}", flush=True)
    return totals


# -- kills -------------------------------------------------------------------------------------------
def _descendants(pid: int) -> list[int]:
    try:
        kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return kids + [d for k in kids for d in _descendants(k)]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def probe_kill(tmp: Path, how: str) -> None:
    out = tmp / f"kill-{how}"
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
        "6",
    ]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (out / "checkpoints" / "step-000002").is_dir():
        if proc.poll() is not None:
            print(f"kill {how}: the run ended first: {proc.stderr.read()[-500:]}")
            return
        time.sleep(0.01)
    ranks = _descendants(proc.pid)
    {
        "launcher": lambda: proc.kill(),
        "rank1": lambda: os.kill(ranks[-1], signal.SIGKILL),
        "sigint": lambda: proc.send_signal(signal.SIGINT),
    }[how]()
    t0 = time.monotonic()
    while any(_running(r) for r in ranks) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    gone_s = time.monotonic() - t0
    left = [r for r in ranks if _running(r)]
    _, err = proc.communicate(timeout=120)
    for r in left:
        os.kill(r, signal.SIGKILL)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    outcome, code, line = glm5("train", "--nproc", "2", "--out", str(out), *ARGS, "--steps", "6", "--resume")
    print(
        f"kill {how:8s}: launcher exit {proc.returncode}, {len(lines)} line(s) on stderr, ranks gone after "
        f"{gone_s:.2f} s, left running: {len(left)}; resume: {outcome} ({code}) {line[:160] if code else ''}"
    )
    for ln in lines[:3]:
        print(f"    {ln[:200]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", type=int, default=len(KINDS))
    ap.add_argument("--no-kills", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        base = tmp / "base"
        outcome, code, line = glm5(
            "train", "--nproc", "2", "--out", str(base), *ARGS, "--steps", "2", timeout=600
        )
        assert outcome == "load", line
        totals = probe_damage(base, tmp, KINDS[: a.kinds])
        print(f"damaged sharded checkpoints: {min(a.kinds, len(KINDS))} kinds x 3 loaders: {totals}")
        if not a.no_kills:
            for how in ("launcher", "rank1", "sigint"):
                probe_kill(tmp, how)


if __name__ == "__main__":
    main()
