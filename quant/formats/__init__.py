"""Checkpoint formats: compressed-tensors (vLLM, CUDA) and msModelSlim ascendv1 (vllm-ascend)."""
