"""Deployment planning: per-device memory, parallel layouts and vLLM / vllm-ascend serve commands for
GLM-5 on a machine profile (glm5/machines/*.yaml). `glm5 plan` drives it; docs/deploy.md walks through it."""

from glm5.deploy.inventory import Part, Weight, inventory
from glm5.deploy.machines import Machine
from glm5.deploy.plan import Layout, Plan, Request, evaluate, make_plan, weights_for

__all__ = [
    "Layout",
    "Machine",
    "Part",
    "Plan",
    "Request",
    "Weight",
    "evaluate",
    "inventory",
    "make_plan",
    "weights_for",
]
