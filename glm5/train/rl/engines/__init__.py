"""Rollout engines of asynchronous RL."""
