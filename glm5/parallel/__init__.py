"""Parallelism applied from outside the model: one plan (plan.py), two hosts (group.py's torch.distributed
group for training; glm5/vllm/parallel.py for vLLM's groups)."""
