"""Advantage estimators and returns, as pure functions over tensors."""

from __future__ import annotations

import torch


def group_relative_advantages(rewards: torch.Tensor, normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages: each reward minus its group's mean, optionally over its std.

    ``rewards`` has shape ``[num_groups, group_size]`` (one row per prompt/node). A group
    whose rewards are all equal gets zero advantages, never NaN. NaN marks a dropped sample:
    it is left out of its group's statistics and gets advantage 0.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    valid = ~torch.isnan(rewards)
    count = valid.sum(dim=1, keepdim=True).clamp(min=1)
    filled = torch.where(valid, rewards, torch.zeros_like(rewards))
    mean = filled.sum(dim=1, keepdim=True) / count
    centered = torch.where(valid, rewards - mean, torch.zeros_like(rewards))
    if not normalize or rewards.shape[1] < 2:
        return centered
    std = torch.sqrt((centered**2).sum(dim=1, keepdim=True) / count)
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
        child_means = torch.nan_to_num(returns[turn + 1].nanmean(dim=1)).reshape(nodes, joints)
        returns[turn] = returns[turn] + discount * child_means
    return returns


def td_targets(rewards: torch.Tensor, values: torch.Tensor, discount: float) -> torch.Tensor:
    """One-step TD targets ``r_t + discount * V_{t+1}`` over episodes, with ``V_T = 0``.

    ``rewards`` and ``values`` are ``[num_episodes, num_turns]``; the last turn's target is its reward.
    """
    if rewards.shape != values.shape or rewards.dim() != 2:
        raise ValueError(
            f"rewards and values must both be [num_episodes, num_turns], got {tuple(rewards.shape)} and {tuple(values.shape)}"
        )
    next_values = torch.zeros_like(values)
    next_values[:, :-1] = values[:, 1:]
    return rewards + discount * next_values


def gae(rewards: torch.Tensor, values: torch.Tensor, discount: float, lam: float) -> torch.Tensor:
    """Generalised advantage estimates ``A_t = delta_t + discount * lam * A_{t+1}``.

    ``delta_t = r_t + discount * V_{t+1} - V_t`` (the TD error); ``lam=0`` gives the TD error,
    ``lam=1`` the discounted return minus ``V_t``. With one turn both are ``r - V``.
    """
    deltas = td_targets(rewards, values, discount) - values
    advantages = torch.zeros_like(deltas)
    running = torch.zeros_like(deltas[:, 0])
    for turn in range(deltas.shape[1] - 1, -1, -1):
        running = deltas[:, turn] + discount * lam * running
        advantages[:, turn] = running
    return advantages


def normalize(values: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Zero mean, unit (population) std over all entries; fewer than two entries or constant ones give zeros."""
    if values.numel() < 2:
        return torch.zeros_like(values)
    std = values.std(unbiased=False)
    if std <= eps:
        return torch.zeros_like(values)
    return (values - values.mean()) / (std + eps)
