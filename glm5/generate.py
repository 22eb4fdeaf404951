"""Generation: prefill + decode on the latent / indexer-key caches, greedy or temperature sampling,
and MTP speculative decoding (draft with the MTP layer(s), verify with one main-model pass, keep the
longest accepted prefix plus one token from the target; acceptance length measured). `glm5 generate`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import click
import torch

from backends.errors import NotSupported
from glm5.cli_args import (
    MODEL_DEFAULT_BACKEND,
    backend_choice,
    check_positions,
    check_preset,
    check_preset_fits,
    model_option,
    one_line_errors,
)
from glm5.core.model import GLM5ForCausalLM
from glm5.loader import load_model


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per request
    main_passes: int  # main-model forward passes (prefill included)
    rounds: list[int] = field(default_factory=list)  # speculative: tokens emitted per verify pass

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens emitted per verify pass (1 + accepted drafts); None without speculation."""
        return sum(self.rounds) / len(self.rounds) if self.rounds else None


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """logits [R, V] -> int64 [R]: argmax (first maximal index) at temperature 0, else a softmax draw."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0].to(logits.device)


def accept_drafts(
    target: torch.Tensor,
    drafts: list[int],
    draft_probs: list[torch.Tensor | None],
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative verification of one round.

    target [k+1, V]: main-model logits at the pending token and at each draft; drafts: k token ids;
    draft_probs: the draft distribution [V] of each draft (temperature > 0 only).
    Greedy: accept while the draft equals the target argmax. Temperature: accept draft d with
    probability min(1, p(d) / q(d)); on rejection draw from normalise(max(p - q, 0)), which keeps the
    output distributed exactly as the target model's. Returns (accepted, next token).
    """
    for j, d in enumerate(drafts):
        if temperature <= 0:
            best = int(target[j].argmax())
            if best != d:
                return j, best
            continue
        p = torch.softmax(target[j].float() / temperature, dim=-1).cpu()
        q = draft_probs[j]
        if torch.rand((), generator=generator) < torch.clamp(p[d] / q[d], max=1.0):
            continue
        residual = torch.clamp(p - q, min=0.0)
        residual = residual / residual.sum() if residual.sum() > 0 else p
        return j, int(torch.multinomial(residual, 1, generator=generator))
    return len(drafts), int(sample(target[len(drafts) : len(drafts) + 1], temperature, generator)[0])


@torch.no_grad()
def generate(
    model: GLM5ForCausalLM,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    eos_token_id: int | None = None,
    block_size: int | None = None,
) -> GenerationResult:
    """input_ids [B, S] -> max_new_tokens per request (stopping early once every request hit eos)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
    g = torch.Generator().manual_seed(seed)
    b, s = input_ids.shape
    cache = model.new_cache(b, s + max_new_tokens, block_size=block_size)
    nxt = sample(model(input_ids, cache).logits[:, -1], temperature, g)
    out, passes, done = [nxt], 1, torch.zeros(b, dtype=torch.bool)
    for _ in range(max_new_tokens - 1):
        if eos_token_id is not None:
            done |= nxt.cpu() == eos_token_id
            if bool(done.all()):
                break
        nxt = sample(model(nxt[:, None], cache).logits[:, -1], temperature, g)
        out.append(nxt)
        passes += 1
    return GenerationResult(torch.stack(out, 1).tolist(), passes)


@torch.no_grad()
def generate_speculative(
    model: GLM5ForCausalLM,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    num_draft: int = 1,
    temperature: float = 0.0,
    seed: int = 0,
    eos_token_id: int | None = None,
    block_size: int | None = None,
) -> GenerationResult:
    """MTP speculative decoding of one request (input_ids [1, S]). Draft j > 1 chains MTP layer 0 on its
    own output hidden state (as vLLM does for several speculative tokens from one MTP layer).

    Invariant between rounds: the main cache holds n tokens, `pending` is token n (sampled, not yet fed),
    and the MTP cache holds slots 0..n-1 (slot i = token i+1 with main hidden i)."""
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"input_ids: speculative decoding takes one request [1, S], got {tuple(input_ids.shape)}"
        )
    if num_draft < 1 or model.config.num_nextn_predict_layers < 1:
        raise ValueError(
            f"num_draft: expected >= 1 with an MTP layer (num_nextn_predict_layers="
            f"{model.config.num_nextn_predict_layers}), got {num_draft}"
        )
    g = torch.Generator().manual_seed(seed)
    s, dev = input_ids.shape[1], input_ids.device
    cap = s + max_new_tokens + num_draft + 2
    cache = model.new_cache(1, cap, block_size=block_size)
    mcache = model.new_cache(1, cap, mtp=True, block_size=block_size)
    pre = model(input_ids, cache)
    pending = int(sample(pre.logits[:, -1], temperature, g)[0])
    emitted, rounds = [pending], []
    feed_tokens, feed_hidden = (
        torch.cat([input_ids[0, 1:], torch.tensor([pending], device=dev)]),
        pre.hidden_states[0],
    )
    passes = 1
    while len(emitted) < max_new_tokens and not (eos_token_id is not None and eos_token_id in emitted):
        drafts, probs = _draft(model, mcache, feed_tokens, feed_hidden, num_draft, temperature, g)
        n0 = cache.lengths[0]
        verify = model(torch.tensor([[pending] + drafts], device=dev), cache)
        passes += 1
        accepted, nxt = accept_drafts(verify.logits[0], drafts, probs, temperature, g)
        new = drafts[:accepted] + [nxt]
        emitted += new
        rounds.append(len(new))
        cache.truncate(0, n0 + 1 + accepted)
        mcache.truncate(0, n0)
        feed_tokens = torch.tensor(new, device=dev)
        feed_hidden = verify.hidden_states[0, : accepted + 1]
        pending = nxt
    if eos_token_id is not None and eos_token_id in emitted:
        emitted = emitted[: emitted.index(eos_token_id) + 1]
    return GenerationResult([emitted[:max_new_tokens]], passes, rounds)


def _draft(
    model: GLM5ForCausalLM,
    mcache,
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    k: int,
    temperature: float,
    g: torch.Generator,
) -> tuple[list[int], list[torch.Tensor | None]]:
    """Feed the newly confirmed MTP slots, then draft k tokens (slots past the confirmed ones are
    speculative; the caller truncates them after verification)."""
    out = model.mtp_forward(tokens[None], hidden[None], mcache, depth=0)
    drafts, probs = [], []
    for j in range(k):
        logits = out.logits[0, -1:]
        d = int(sample(logits, temperature, g)[0])
        drafts.append(d)
        probs.append(torch.softmax(logits[0].float() / temperature, -1).cpu() if temperature > 0 else None)
        if j + 1 < k:
            out = model.mtp_forward(
                torch.tensor([[d]], device=tokens.device), out.hidden_states[:, -1:], mcache, depth=0
            )
    return drafts, probs


def _prompt_ids(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        ids = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not ids or min(ids) < 0:
        raise click.BadParameter(f"expected one or more token ids >= 0, got {value!r}")
    return ids


#: the most tokens `--mtp` drafts per round. The drafts chain the one MTP layer on its own output, so their
#: acceptance falls with each step (serving engines run GLM's and DeepSeek's MTP with 1-4 drafts), while each
#: draft costs an MTP forward and widens the verify pass: past 8, a round costs more than it can save.
MAX_DRAFT = 8


def _finite_temperature(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not math.isfinite(value):
        raise click.BadParameter(f"expected a finite number >= 0 (0 = greedy), got {value}")
    return value


@click.command()
@model_option(aliases=("--checkpoint",))
@click.option(
    "--preset",
    default=None,
    callback=check_preset,
    help="Random weights from glm5/core/presets/<name>.yaml instead of --model.",
)
@click.option("--backend", default=None, help="Backend name (default: $GLM5_BACKEND or cpu).")
@click.option("--prompt-ids", default=None, callback=_prompt_ids, help="Comma-separated prompt token ids.")
@click.option(
    "--prompt-len",
    default=16,
    show_default=True,
    type=click.IntRange(min=1),
    help="Random prompt length when --prompt-ids is absent.",
)
@click.option(
    "--max-new-tokens",
    default=32,
    show_default=True,
    type=click.IntRange(min=1),
    help="Tokens to generate (prompt + these must fit the model's max_position_embeddings).",
)
@click.option(
    "--temperature",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0),
    callback=_finite_temperature,
    help="0 = greedy.",
)
@click.option(
    "--mtp",
    "num_draft",
    default=0,
    show_default=True,
    type=click.IntRange(min=0, max=MAX_DRAFT),
    help=f"Speculative tokens drafted by the MTP layer per round (at most {MAX_DRAFT}).",
)
@click.option(
    "--block-size",
    default=None,
    type=click.IntRange(min=1),
    help="Paged caches with this block size (default ragged).",
)
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def generate_cmd(
    model_path,
    preset,
    backend,
    prompt_ids,
    prompt_len,
    max_new_tokens,
    temperature,
    num_draft,
    block_size,
    seed,
    as_json,
) -> None:
    """Generate token ids with GLM-5 (greedy or sampled; --mtp N for MTP speculative decoding)."""
    from glm5.core.config import GLM5Config

    if (model_path is None) == (preset is None):
        raise click.UsageError("give exactly one of --model or --preset")
    be = backend_choice(backend, default=MODEL_DEFAULT_BACKEND)
    check_preset_fits(preset, "'--preset'")
    with one_line_errors("'--model'" if model_path is not None else "'--preset'"):
        if model_path is not None:
            model = load_model(model_path, backend=be)
        else:
            model = GLM5ForCausalLM(GLM5Config.from_preset(preset), backend=be)
            model.init_weights(seed)
    if num_draft and model.config.num_nextn_predict_layers < 1:
        raise click.BadParameter(
            "this checkpoint has no MTP layer (num_nextn_predict_layers=0): speculative "
            "decoding is unavailable; use --mtp 0",
            param_hint="'--mtp'",
        )
    if prompt_ids and max(prompt_ids) >= model.config.vocab_size:
        raise click.BadParameter(
            f"token ids must be < vocab_size={model.config.vocab_size}", param_hint="'--prompt-ids'"
        )
    n_prompt = len(prompt_ids) if prompt_ids else prompt_len
    prompt_hint = "'--prompt-ids'" if prompt_ids else "'--prompt-len'"
    check_positions(model.config, n_prompt, prompt_hint, "the prompt")
    check_positions(
        model.config,
        n_prompt + max_new_tokens,
        "'--max-new-tokens'",
        f"the prompt ({n_prompt}) + {max_new_tokens} new tokens",
    )
    model.requires_grad_(False)  # inference: lets inference-only backends (onnxruntime) take the weights
    dev = model.backend.device
    if prompt_ids:
        ids = torch.tensor([prompt_ids], device=dev)
    else:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=gen).to(dev)
    eos = model.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    kw = dict(temperature=temperature, seed=seed, eos_token_id=eos, block_size=block_size)
    try:
        res = (
            generate_speculative(model, ids, max_new_tokens, num_draft=num_draft, **kw)
            if num_draft
            else generate(model, ids, max_new_tokens, **kw)
        )
    except NotSupported as exc:  # e.g. an FP8 checkpoint on a backend without the FP8 ops
        raise click.BadParameter(
            f"{str(exc).splitlines()[0]}; choose another backend for this checkpoint",
            param_hint="'--backend'",
        ) from None
    report = {
        "backend": model.backend.name,
        "prompt": ids[0].tolist(),
        "tokens": res.tokens[0],
        "main_passes": res.main_passes,
        "acceptance_length": res.acceptance_length,
    }
    if as_json:
        click.echo(json.dumps(report))
    else:
        for k, v in report.items():
            click.echo(f"{k}: {v}")
