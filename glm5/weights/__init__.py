"""Checkpoint tensors into a model: the plan-sliced loader (load.py) and the quantized formats'
tensor names (quantized.py), shared by the vLLM plugin (glm5/vllm) and the trainer's rollout engine."""
