"""Rollout engines of asynchronous RL (glm5/train/rl/asynchronous.py): token in, token out.

local.py        the engine interface and PolicyEngine, the project's decode path on a private copy
vllm_engine.py  vLLM with the project's plugin (glm5/vllm), started by name: this package imports no plugin
vllm_worker.py  the worker extension vLLM mixes into each worker (weight pushes, top-k records)
"""
