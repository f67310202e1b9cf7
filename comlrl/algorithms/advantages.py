"""Advantage estimators and returns, as pure functions over tensors."""

from __future__ import annotations

import torch


def group_relative_advantages(rewards: torch.Tensor, normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages: each reward minus its group's mean, optionally over its std.

    ``rewards`` has shape ``[num_groups, group_size]`` (one row per prompt/node). A group
    whose rewards are all equal gets zero advantages, never NaN.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not normalize or rewards.shape[1] < 2:
        return centered
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return torch.where(std > eps, centered / (std + eps), torch.zeros_like(centered))


def joint_index(num_agents: int, num_generations: int, mode: str) -> torch.Tensor:
    """Which completion of each agent forms each joint sample: shape ``[num_joint, num_agents]``.

    ``"aligned"`` pairs completion g of every agent (``num_generations`` joint samples);
    ``"cross"`` takes the Cartesian product (``num_generations ** num_agents`` samples).
    """
    if mode == "aligned":
        return torch.arange(num_generations).unsqueeze(1).expand(num_generations, num_agents).clone()
    if mode == "cross":
        grids = torch.meshgrid(*[torch.arange(num_generations)] * num_agents, indexing="ij")
        return torch.stack([grid.reshape(-1) for grid in grids], dim=1)
    raise ValueError(f"joint mode must be 'aligned' or 'cross', got {mode!r}")


def agent_advantages(joint_advantages: torch.Tensor, index: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Credit each agent's completion with the mean advantage of the joint samples it is part of.

    ``joint_advantages`` is ``[num_groups, num_joint]`` and ``index`` comes from
    :func:`joint_index`; the result is ``[num_agents, num_groups, num_generations]``.
    With aligned joints this is the joint advantage itself.
    """
    num_groups, _ = joint_advantages.shape
    num_agents = index.shape[1]
    out = torch.zeros(num_agents, num_groups, num_generations, dtype=joint_advantages.dtype)
    counts = torch.zeros(num_agents, 1, num_generations, dtype=joint_advantages.dtype)
    for agent in range(num_agents):
        out[agent].index_add_(1, index[:, agent], joint_advantages)
        counts[agent, 0].index_add_(0, index[:, agent], torch.ones(index.shape[0], dtype=joint_advantages.dtype))
    return out / counts.clamp(min=1)


def tree_returns(rewards_per_turn: list[torch.Tensor], discount: float) -> list[torch.Tensor]:
    """Discounted returns over a rollout tree.

    ``rewards_per_turn[t]`` is ``[num_nodes_t, num_joint]``; joint sample ``j`` of node ``n``
    at turn ``t`` spawns node ``n * num_joint + j`` at turn ``t + 1``. The return of a joint
    sample is its reward plus ``discount`` times the mean return of its child node's samples.
    """
    returns = [rewards.clone() for rewards in rewards_per_turn]
    for turn in range(len(returns) - 2, -1, -1):
        nodes, joints = returns[turn].shape
        child_means = returns[turn + 1].mean(dim=1).reshape(nodes, joints)
        returns[turn] = returns[turn] + discount * child_means
    return returns
