"""Reinforcement learning: the RL stage, IcePop, rollouts and rollout engines."""
