"""Model-level checks of a backend on the tiny GLM-5 (random weights, seed 0), run by `glm5 port status`:

- greedy: the backend generates the reference's greedy tokens (ragged cache, paged cache, MTP speculative);
- shadow: one generation with shadow mode on (backends/shadow.py, GLM5_VALIDATE=reference): the first op
  call whose result differs from the reference's, or how many calls were checked without a difference.

Each check returns {"status": "pass" | "fail" | "unsupported" | "error" | "not applicable", "detail": ...}.
"""

from __future__ import annotations

from typing import Any

import torch

import backends
from backends.errors import NotSupported
from backends.shadow import ShadowMismatch
from conformance.result import describe

PROMPT_LEN, NEW_TOKENS, SEED = 24, 8, 9


def _models(name: str):
    from glm5.core.config import GLM5Config
    from glm5.core.model import GLM5ForCausalLM

    cfg = GLM5Config.from_preset("tiny")
    ref = GLM5ForCausalLM(cfg, backend="reference")
    ref.init_weights(0)
    ref.eval().requires_grad_(False)
    model = GLM5ForCausalLM(cfg, backend=backends.get(name))
    model.load_state_dict(ref.state_dict())
    model.eval().requires_grad_(False)  # inference: lets inference-only backends take the weights
    ids = torch.randint(0, cfg.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(SEED))
    return ref, model, ids


def _first_difference(got: list[int], want: list[int]) -> str:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"token {i}: {a} vs reference {b}"
    return f"{len(got)} tokens vs reference {len(want)}"


def greedy(name: str) -> dict[str, Any]:
    """The tiny model's greedy tokens on `name` against the reference's."""
    from glm5.generate import generate, generate_speculative

    if name == "reference":
        return {"status": "not applicable", "detail": "the reference is the baseline", "runs": {}}
    runs: dict[str, str] = {}
    try:
        ref, model, ids = _models(name)
        dev_ids = ids.to(model.backend.device)
        for what, fn in (
            ("ragged", lambda m, x: generate(m, x, NEW_TOKENS)),
            ("paged", lambda m, x: generate(m, x, NEW_TOKENS, block_size=4)),
            ("mtp_speculative", lambda m, x: generate_speculative(m, x, NEW_TOKENS, num_draft=2)),
        ):
            want = fn(ref, ids).tokens[0]
            got = fn(model, dev_ids).tokens[0]
            runs[what] = "pass" if got == want else "fail: " + _first_difference(got, want)
    except NotSupported as exc:
        return {"status": "unsupported", "detail": str(exc), "runs": runs}
    except Exception as exc:
        return {"status": "error", "detail": describe(exc), "runs": runs}
    bad = {k: v for k, v in runs.items() if v != "pass"}
    detail = "; ".join(f"{k} {v}" for k, v in bad.items()) or (
        f"{NEW_TOKENS} greedy tokens equal the reference's (ragged, paged, MTP speculative)"
    )
    return {"status": "fail" if bad else "pass", "detail": detail, "runs": runs}


def shadow(name: str) -> dict[str, Any]:
    """One greedy generation of the tiny model with every op call shadowed by the reference."""
    from glm5.generate import generate

    if name == "reference":
        return {"status": "not applicable", "detail": "shadow mode compares a backend with the reference"}
    be = backends.get(name)
    before = sum(be.calls.values())
    was = be.shadow
    try:
        _, model, ids = _models(name)
        be.shadow = True
        generate(model, ids.to(be.device), 2)
    except ShadowMismatch as exc:
        first = str(exc).splitlines()[0]
        op = first.split(" ", 1)[0].split(".", 1)[-1]
        calls = sum(be.calls.values()) - before
        return {"status": "fail", "first_divergent_op": op, "calls": calls, "detail": first}
    except NotSupported as exc:
        return {"status": "unsupported", "first_divergent_op": None, "detail": str(exc)}
    except Exception as exc:
        return {"status": "error", "first_divergent_op": None, "detail": describe(exc)}
    finally:
        be.shadow = was
    calls = sum(be.calls.values()) - before
    return {
        "status": "pass",
        "first_divergent_op": None,
        "calls": calls,
        "detail": f"no op diverged from the reference over {calls} calls (prefill + 1 decode step)",
    }
