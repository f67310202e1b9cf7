"""Rollouts: sampling, generation, multi-agent episodes, joint rewards and preference pairs."""
