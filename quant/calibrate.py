"""Layer-by-layer calibration (msModelSlim `layer_wise`, llm-compressor `sequential` with error propagation).

One decoder layer at a time: run the float layer on the inputs the already-quantized layers produced,
collecting per-channel activation statistics; smooth (SmoothQuant for W8A8 subgraphs, an AWQ scale
search for int4 experts); collect GPTQ Hessians from the smoothed layer if the recipe asks for GPTQ;
quantize and swap the layer's modules; run the quantized layer to make the next layer's inputs.

Subgraphs (as msModelSlim's GLM-5 recipe smooths them), names relative to `model.layers.{i}`:
  norm-linear  input_layernorm -> self_attn.{q_a_proj, kv_a_proj_with_mqa, indexer.wk, indexer.weights_proj}
  norm-linear  self_attn.q_a_layernorm -> self_attn.{q_b_proj, indexer.wq_b}
  ov           self_attn.kv_b_proj (value half) -> self_attn.o_proj
  up-down      mlp[.shared_experts].up_proj -> down_proj; each routed expert's up_proj -> down_proj
post_attention_layernorm is not smoothed (it also feeds the router), as in the GLM-5 msModelSlim recipe.
Routed experts see every calibration token for their statistics (llm-compressor moe_calibrate_all_experts),
so rarely routed experts are calibrated too.
"""

from __future__ import annotations

import torch
from torch import nn

from glm5.core.moe import Experts
from quant.apply import quantize_modules
from quant.gptq import Hessian
from quant.quantizers import dequantize, quantize_weight
from quant.recipe import W4A8, W8A8, Recipe, Scheme


class _Stats:
    """Per-linear input statistics: running per-channel absmax and, on request, the GPTQ Hessian."""

    def __init__(self, layer: nn.Module, prefix: str, hessian_for: set[str]) -> None:
        self.absmax: dict[str, torch.Tensor] = {}
        self.hess: dict[str, Hessian] = {}
        self.moe_in: list[torch.Tensor] = []
        self._handles = []
        for rel, mod in layer.named_modules():
            name = f"{prefix}.{rel}"
            if isinstance(mod, nn.Linear):
                self._handles.append(mod.register_forward_pre_hook(self._hook(name, name in hessian_for)))
        mlp = getattr(layer, "mlp", None)
        if isinstance(getattr(mlp, "experts", None), Experts):
            self._handles.append(mlp.register_forward_pre_hook(self._moe_hook))

    def _moe_hook(self, mod: nn.Module, inp: tuple) -> None:
        self.moe_in.append(inp[0].detach().float())

    def _hook(self, name: str, hessian: bool):
        def fn(mod: nn.Module, inp: tuple) -> None:
            x = inp[0].detach().reshape(-1, inp[0].shape[-1]).float()
            a = x.abs().amax(0)
            self.absmax[name] = torch.maximum(self.absmax[name], a) if name in self.absmax else a
            if hessian:
                self.hess.setdefault(name, Hessian(x.shape[1])).add(x)

        return fn

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def _smooth_scale(act: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """SmoothQuant s_j = max|X_j|^a / max_W |W[:, j]|^(1-a), clamped at 1e-5; 1 for dead channels."""
    w = torch.stack([x.float().abs().amax(0) for x in weights]).amax(0)
    s = (act.pow(alpha) / w.clamp_min(1e-5).pow(1 - alpha)).clamp_min(1e-5)
    return torch.where(act > 0, s, torch.ones_like(s))


def _scale_cols(p: torch.Tensor, s: torch.Tensor) -> None:
    p.copy_((p.float() * s[None, :]).to(p.dtype))


def _scale_rows(p: torch.Tensor, s: torch.Tensor) -> None:
    p.copy_((p.float() / s.reshape(-1, *([1] * (p.dim() - 1)))).to(p.dtype))


def _int8_fake(x: torch.Tensor) -> torch.Tensor:
    """Per-token symmetric int8 quantize-dequantize (SPEC 2.5 numerics, in float)."""
    s = x.abs().amax(1, keepdim=True).clamp_min(1e-10) / 127
    return torch.round(x / s).clamp(-127, 127) * s


def awq_search(
    a: torch.Tensor, w_down: torch.Tensor, scheme: Scheme, recipe: Recipe, n_grid: int
) -> torch.Tensor:
    """AWQ for the up->down pair: s = mean|a|^r (r on a grid in [0, 1], normalised by sqrt(max*min));
    keep the s whose quantized down projection (int4 weights, int8 per-token activations) best matches
    a @ w_down^T in squared error. a [T, I] float, w_down [D, I] -> s [I] (r = 0 gives s = 1)."""
    opts = recipe.calibration.get(f"int{scheme.bits}") or {}
    method = "ssz" if opts.get("weight_method") == "ssz" else "minmax"  # GPTQ runs after, on the winner
    steps = int(opts.get("ssz_steps", 10))
    ref = a @ w_down.T
    x_mean = a.abs().mean(0)
    best, best_s = float("inf"), torch.ones_like(x_mean)
    for i in range(n_grid + 1):
        s = x_mean.pow(i / n_grid).clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        q, sc = quantize_weight(
            w_down * s[None, :], scheme.bits, scheme.group_size, recipe.convention, method, steps
        )
        err = float((_int8_fake(a / s) @ dequantize(q, sc).T - ref).pow(2).mean())
        if err < best:
            best, best_s = err, s
    return best_s


def _expert_acts(h: torch.Tensor, ex: Experts, e: int) -> torch.Tensor:
    return nn.functional.silu(h @ ex.gate_proj[e].float().T) * (h @ ex.up_proj[e].float().T)


@torch.no_grad()
def _smooth_layer(layer: nn.Module, prefix: str, plan: dict[str, Scheme], recipe: Recipe, st: _Stats) -> None:
    sq = recipe.calibration.get("smoothquant")
    int4 = recipe.calibration.get("int4") or {}
    attn, mlp = layer.self_attn, layer.mlp

    def w8(rel: str) -> bool:
        s = plan.get(f"{prefix}.{rel}")
        return s is not None and s.name == W8A8

    if sq:
        alpha = float(sq.get("alpha", 0.5))
        # norm -> linear: every consumer of the normed input is rescaled, float ones included
        cons = [attn.q_a_proj, attn.kv_a_proj_with_mqa]
        if attn.indexer is not None:
            cons += [attn.indexer.wk, attn.indexer.weights_proj]
        if w8("self_attn.q_a_proj") or w8("self_attn.kv_a_proj_with_mqa"):
            s = _smooth_scale(st.absmax[f"{prefix}.self_attn.q_a_proj"], [c.weight for c in cons], alpha)
            _scale_rows(layer.input_layernorm.weight, s)
            for c in cons:
                _scale_cols(c.weight, s)
        cons = [attn.q_b_proj] + ([attn.indexer.wq_b] if attn.indexer is not None else [])
        if w8("self_attn.q_b_proj"):
            s = _smooth_scale(st.absmax[f"{prefix}.self_attn.q_b_proj"], [c.weight for c in cons], alpha)
            _scale_rows(attn.q_a_layernorm.weight, s)
            for c in cons:
                _scale_cols(c.weight, s)
        if w8("self_attn.o_proj"):
            s = _smooth_scale(st.absmax[f"{prefix}.self_attn.o_proj"], [attn.o_proj.weight], alpha)
            _scale_cols(attn.o_proj.weight, s)
            kvb = attn.kv_b_proj.weight.view(attn.n_heads, attn.nope + attn.v_dim, attn.c)
            w_uv = kvb[:, attn.nope :]  # [H, v, c]: o_proj input (h, v)
            w_uv.copy_((w_uv.float() / s.view(attn.n_heads, attn.v_dim, 1)).to(w_uv.dtype))
        for rel, m in (("mlp", mlp), ("mlp.shared_experts", getattr(mlp, "shared_experts", None))):
            if m is not None and hasattr(m, "down_proj") and w8(f"{rel}.down_proj"):
                s = _smooth_scale(st.absmax[f"{prefix}.{rel}.down_proj"], [m.down_proj.weight], alpha)
                _scale_rows(m.up_proj.weight, s)
                _scale_cols(m.down_proj.weight, s)
    ex = getattr(mlp, "experts", None)
    scheme = plan.get(f"{prefix}.mlp.experts.0.down_proj")
    if not isinstance(ex, Experts) or scheme is None or not st.moe_in:
        return
    h = torch.cat(st.moe_in)
    for e in range(ex.gate_proj.shape[0]):
        a = _expert_acts(h, ex, e)
        if scheme.name == W4A8 and int4.get("smoothing") == "awq":
            s = awq_search(a, ex.down_proj[e].float(), scheme, recipe, int(int4.get("awq_grid", 20)))
        elif scheme.name == W8A8 and sq:
            s = _smooth_scale(a.abs().amax(0), [ex.down_proj[e]], float(sq.get("alpha", 0.5)))
        else:
            continue
        _scale_rows(ex.up_proj[e], s)
        _scale_cols(ex.down_proj[e], s)


def _gptq_names(plan: dict[str, Scheme], recipe: Recipe, prefix: str) -> set[str]:
    out = set()
    for name, s in plan.items():
        opts = recipe.calibration.get(f"int{s.bits}") or {}
        if name.startswith(prefix + ".") and opts.get("weight_method") == "gptq":
            out.add(name)
    return out


@torch.no_grad()
def calibrate_layer(
    model: nn.Module,
    layer: nn.Module,
    prefix: str,
    x: torch.Tensor,
    step,
    topk,
    plan: dict[str, Scheme],
    recipe: Recipe,
) -> None:
    """Smooth and quantize one decoder layer (`prefix`: its module name) from its float weights and the
    input x the already-quantized layers produced; its planned modules are swapped in `model`."""
    st = _Stats(layer, prefix, set())
    layer(x, step, topk)
    st.close()
    _smooth_layer(layer, prefix, plan, recipe, st)
    gptq = _gptq_names(plan, recipe, prefix)
    hess: dict[str, torch.Tensor] = {}
    if gptq:
        st = _Stats(layer, prefix, gptq)
        layer(x, step, topk)
        st.close()
        hess = {n: h.h for n, h in st.hess.items()}
        ex = getattr(layer.mlp, "experts", None)
        if isinstance(ex, Experts) and st.moe_in and f"{prefix}.mlp.experts.0.gate_proj" in gptq:
            h = torch.cat(st.moe_in)
            hh = Hessian(h.shape[1])
            hh.add(h)
            for e in range(ex.gate_proj.shape[0]):
                hd = Hessian(ex.down_proj.shape[2])
                hd.add(_expert_acts(h, ex, e))
                hess.update(
                    {
                        f"{prefix}.mlp.experts.{e}.gate_proj": hh.h,
                        f"{prefix}.mlp.experts.{e}.up_proj": hh.h,
                        f"{prefix}.mlp.experts.{e}.down_proj": hd.h,
                    }
                )
    names = {f"{prefix}.{n}" for n, _ in layer.named_modules() if n}
    quantize_modules(model, plan, recipe, names, hess)


def begin(model: nn.Module, calib_ids: torch.Tensor):
    """(the first layer's input, the step) of a calibration pass over calib_ids [B, S]."""
    b, s = calib_ids.shape
    step = model.begin_step([s] * b, None)
    x = model.model.embed_tokens(calib_ids.reshape(-1).to(model.model.embed_tokens.weight.device))
    return x, step


@torch.no_grad()
def calibrate(
    model: nn.Module, recipe: Recipe, plan: dict[str, Scheme], calib_ids: torch.Tensor, log: bool = False
) -> None:
    """Smooth and quantize every main decoder layer in order on calib_ids [B, S] (see module docstring).
    Modules outside the main layers (MTP, head) are left for the caller's data-free pass."""
    x, step = begin(model, calib_ids)
    topk = None
    for i, layer in enumerate(model.model.layers[: model.config.num_hidden_layers]):
        prefix = f"model.layers.{i}"
        if any(n.startswith(prefix + ".") for n in plan):
            calibrate_layer(model, layer, prefix, x, step, topk, plan, recipe)
            if log:
                print(f"calibrated {prefix}", flush=True)
        x, topk = model.model.layers[i](x, step, topk)
