"""Apply a recipe to a GLM-5 model from outside (gpt-fast style): plan which modules get which scheme,
quantize their weights and swap in `QuantLinear` / `QuantExperts`.

Names are the Hugging Face module names: a linear is `model.layers.3.self_attn.q_a_proj`; one routed
expert's projection is `model.layers.3.mlp.experts.5.gate_proj` (in memory the experts are stacked, so
all experts of one layer must share a scheme).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from glm5.core.checkpoint import hf_names
from glm5.core.moe import Experts
from quant.gptq import gptq_quantize
from quant.modules import QuantExperts, QuantLinear
from quant.quantizers import quantize_weight
from quant.recipe import FLOAT, Recipe, Scheme

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def mtp_layers(model: nn.Module) -> list[int]:
    c = model.config
    return list(range(c.num_hidden_layers, c.num_hidden_layers + c.num_nextn_predict_layers))


def quantizable(model: nn.Module) -> Iterator[tuple[str, nn.Module, int | None, str | None]]:
    """(module name, module, expert index, projection) for every linear weight a recipe may quantize."""
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, QuantLinear)):
            yield name, mod, None, None
        elif isinstance(mod, (Experts, QuantExperts)):
            n = mod.gate_proj.shape[0] if isinstance(mod, Experts) else mod.n_experts
            for e in range(n):
                for p in EXPERT_PROJS:
                    yield f"{name}.{e}.{p}", mod, e, p


def plan_model(model: nn.Module, recipe: Recipe) -> dict[str, Scheme]:
    """module name -> scheme for every module the recipe quantizes (stacked experts: one scheme per layer)."""
    plan = recipe.plan([n for n, *_ in quantizable(model)], mtp_layers(model))
    per_layer: dict[str, set] = {}
    for name, _mod, e, _ in quantizable(model):
        if e is not None:
            per_layer.setdefault(name.rsplit(".", 2)[0], set()).add(plan.get(name))
    for prefix, schemes in per_layer.items():
        if len(schemes) > 1:
            raise ValueError(
                f"recipe {recipe.name}: the experts of {prefix} get different schemes "
                f"{sorted(str(s) for s in schemes)}; stacked experts need one"
            )
    return plan


def hf_tensor_names(model: nn.Module) -> Iterator[tuple[str, str]]:
    """(checkpoint tensor name, owning module name) of every float tensor the model stores."""
    for hf, _, _ in hf_names(model):
        yield hf, hf.rsplit(".", 1)[0]


def tensor_schemes(model: nn.Module, plan: dict[str, Scheme]) -> dict[str, str]:
    """Every checkpoint tensor of the float model -> the scheme its weight gets (FLOAT if not quantized)."""
    out = {}
    for t, mod in hf_tensor_names(model):
        s = plan.get(mod)
        out[t] = s.name if s is not None and t.endswith(".weight") else FLOAT
    return out


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def quantize_tensor(
    w: torch.Tensor, scheme: Scheme, recipe: Recipe, hessian: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q int8 [N, K], scale fp32 [N, G]) with the recipe's weight method for the scheme's
    bit width (calibration.int4 / calibration.int8: minmax | ssz | gptq; gptq needs the layer's hessian)."""
    opts = recipe.calibration.get(f"int{scheme.bits}", {}) or {}
    method = opts.get("weight_method", "minmax")
    if method == "gptq":
        if hessian is None:
            raise ValueError(
                f"calib: recipe {recipe.name} quantizes int{scheme.bits} weights with GPTQ, "
                "which needs calibration data"
            )
        return gptq_quantize(
            w, hessian, scheme.bits, scheme.group_size, recipe.convention, damp=float(opts.get("damp", 0.01))
        )
    return quantize_weight(
        w, scheme.bits, scheme.group_size, recipe.convention, method, int(opts.get("ssz_steps", 10))
    )


def empty_like_plan(
    model: nn.Module, plan: dict[str, Scheme], device: str | torch.device | None = None
) -> None:
    """Swap every planned module for a zero-filled quantized one (on `device`, default the backend's; "meta"
    for a loader that allocates later); the loaders fill them. Unplanned float modules are left alone."""
    backend = model.backend
    dev = device or backend.device
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and name in plan:
            set_module(
                model,
                name,
                QuantLinear(
                    mod.in_features, mod.out_features, plan[name], backend, mod.bias is not None, dev
                ),
            )
        elif isinstance(mod, Experts) and f"{name}.0.gate_proj" in plan:
            e, i, d = mod.gate_proj.shape
            set_module(model, name, QuantExperts(e, d, i, plan[f"{name}.0.gate_proj"], dev))


@torch.no_grad()
def quantize_modules(
    model: nn.Module,
    plan: dict[str, Scheme],
    recipe: Recipe,
    names: set[str] | None = None,
    hessians: dict[str, torch.Tensor] | None = None,
) -> None:
    """Quantize the planned float modules (only those in `names` if given) from their current weights and
    swap them in. hessians: module name -> H [K, K] for GPTQ."""
    hessians = hessians or {}
    backend = model.backend
    for name, mod in list(model.named_modules()):
        if names is not None and name not in names:
            continue
        if isinstance(mod, nn.Linear) and name in plan:
            q, s = quantize_tensor(mod.weight.detach(), plan[name], recipe, hessians.get(name))
            bias = mod.bias.detach() if mod.bias is not None else None
            set_module(model, name, QuantLinear.from_int(q, s, plan[name], backend, bias))
        elif isinstance(mod, Experts) and f"{name}.0.gate_proj" in plan:
            e, i, d = mod.gate_proj.shape
            scheme = plan[f"{name}.0.gate_proj"]
            new = QuantExperts(e, d, i, scheme, mod.gate_proj.device)
            for j in range(e):
                for p in EXPERT_PROJS:
                    key = f"{name}.{j}.{p}"
                    q, s = quantize_tensor(getattr(mod, p)[j].detach(), scheme, recipe, hessians.get(key))
                    new.set_int(j, p, q, s)
            set_module(model, name, new)
