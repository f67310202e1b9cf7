"""Advantage estimators and returns, as pure functions over tensors."""

from __future__ import annotations

from typing import Sequence

import torch


def group_relative_advantages(
    rewards: torch.Tensor, normalize: bool = True, eps: float = 1e-6, unbiased: bool = True
) -> torch.Tensor:
    """Group-relative advantages: each reward minus its group's mean, optionally over its std.

    ``rewards`` has shape ``[num_groups, group_size]`` (one row per prompt/node). With ``normalize``
    the centred rewards are divided by the group's std: the sample std (Bessel-corrected,
    ``sqrt(sum((r - mean)^2) / (n - 1))`` over the ``n`` kept samples) when ``unbiased`` (the
    default, as ``torch.std`` and TRL's GRPO compute it), the population std (``/ n``) otherwise.
    A group whose rewards are all equal, or that keeps fewer than two samples, gets zero
    advantages, never NaN. NaN marks a dropped sample: it is left out of its group's statistics
    and gets advantage 0.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    valid = ~torch.isnan(rewards)
    kept = valid.sum(dim=1, keepdim=True)
    count = kept.clamp(min=1)
    filled = torch.where(valid, rewards, torch.zeros_like(rewards))
    mean = filled.sum(dim=1, keepdim=True) / count
    centered = torch.where(valid, rewards - mean, torch.zeros_like(rewards))
    if not normalize or rewards.shape[1] < 2:
        return centered
    dof = (kept - 1 if unbiased else kept).clamp(min=1)
    std = torch.sqrt((centered**2).sum(dim=1, keepdim=True) / dof)
    return torch.where((std > eps) & (kept >= 2), centered / (std + eps), torch.zeros_like(centered))


def zero_variance_groups(returns: torch.Tensor) -> torch.Tensor:
    """Which groups give a group baseline nothing to compare: ``[num_groups]`` booleans.

    ``returns`` is ``[num_groups, group_size]``, as :func:`baseline_advantages` takes it. A group is
    zero-variance when its kept returns are all exactly equal (tolerance 0: a scorer gives equal
    outcomes bit-identical floats, and a tolerance would hide real if small differences), or when it
    keeps fewer than two. NaN marks a dropped sample and is left out.
    """
    if returns.dim() != 2:
        raise ValueError(f"returns must be [num_groups, group_size], got shape {tuple(returns.shape)}")
    valid = ~torch.isnan(returns)
    highest = torch.where(valid, returns, torch.full_like(returns, -torch.inf)).amax(dim=1)
    lowest = torch.where(valid, returns, torch.full_like(returns, torch.inf)).amin(dim=1)
    return (highest == lowest) | (valid.sum(dim=1) < 2)


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


def agent_advantages(joint_advantages: torch.Tensor, index: torch.Tensor, num_generations: int,
                     kept: torch.Tensor | None = None) -> torch.Tensor:
    """Credit each agent's completion with the mean advantage of the kept joint samples it is part of.

    ``joint_advantages`` is ``[num_groups, num_joint]`` and ``index`` comes from
    :func:`joint_index`; the result is ``[num_agents, num_groups, num_generations]``.
    ``kept`` (``[num_groups, num_joint]`` booleans, default all) marks the joint samples that count:
    a dropped one (``invalid_reward="drop"``) has no advantage to give, so it is left out of the mean
    rather than counted as 0; a completion whose joints were all dropped gets 0.
    With aligned joints this is the joint advantage itself.
    """
    num_groups, num_joint = joint_advantages.shape
    if kept is None:
        kept = torch.ones(num_groups, num_joint, dtype=torch.bool)
    if kept.shape != joint_advantages.shape:
        raise ValueError(f"kept has shape {tuple(kept.shape)}, the joint advantages {tuple(joint_advantages.shape)}; "
                         "give one flag per joint sample")
    num_agents = index.shape[1]
    weights = kept.to(joint_advantages.dtype)
    credited = torch.where(kept, joint_advantages, torch.zeros_like(joint_advantages))
    out = torch.zeros(num_agents, num_groups, num_generations, dtype=joint_advantages.dtype)
    counts = torch.zeros(num_agents, num_groups, num_generations, dtype=joint_advantages.dtype)
    for agent in range(num_agents):
        out[agent].index_add_(1, index[:, agent], credited)
        counts[agent].index_add_(1, index[:, agent], weights)
    return out / counts.clamp(min=1)


def tree_returns(rewards_per_turn: list[torch.Tensor], discount: float,
                 parents: Sequence[Sequence[int] | None] | None = None) -> list[torch.Tensor]:
    """Discounted returns over a rollout tree.

    ``rewards_per_turn[t]`` is ``[num_nodes_t, num_joint]``. Joint sample ``j`` of node ``n`` at turn
    ``t`` has flat index ``n * num_joint + j``; ``parents[t + 1][k]`` is the flat index of the turn-``t``
    sample that spawned node ``k`` of turn ``t + 1`` (``None``, or no ``parents``: every sample spawned
    one node, in order). The return of a joint sample is its reward plus ``discount`` times the mean
    return of its child node's samples; a sample that spawned no node (early termination) ended its
    episode, so its return is its reward.

    NaN marks a dropped sample (``invalid_reward="drop"``). The child mean is taken over the
    kept children only; a sample whose children were all dropped has an unknown future, so its
    return is NaN (dropped too) rather than its reward alone, as if the future were worth 0.
    """
    returns = [rewards.clone() for rewards in rewards_per_turn]
    for turn in range(len(returns) - 2, -1, -1):
        nodes, joints = returns[turn].shape
        child_means = returns[turn + 1].nanmean(dim=1)  # per child node; NaN when every child was dropped
        spawned_by = parents[turn + 1] if parents is not None else None
        if spawned_by is None:
            future = child_means
        else:
            future = torch.zeros(nodes * joints, dtype=child_means.dtype)
            future[torch.as_tensor(list(spawned_by), dtype=torch.long)] = child_means
        returns[turn] = returns[turn] + discount * future.reshape(nodes, joints)
    return returns


def leave_one_out_mean(values: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """For every entry, the mean of the *other* entries along ``dim`` (same shape as ``values``).

    NaN entries are left out of every mean; an entry with no other kept entry gets NaN.
    """
    valid = ~torch.isnan(values)
    filled = torch.where(valid, values, torch.zeros_like(values))
    others_total = filled.sum(dim=dim, keepdim=True) - filled
    others_count = valid.sum(dim=dim, keepdim=True) - valid.long()
    return torch.where(others_count > 0, others_total / others_count.clamp(min=1),
                       torch.full_like(values, float("nan")))


def q_critic_advantages(targets: torch.Tensor, q_values: torch.Tensor, group_size: int) -> torch.Tensor:
    """Advantages for a Q critic: ``A_i = G_i - mean_{j != i} Q(h, a_j)``.

    ``targets`` (``G``, the critic's targets: the reward for one turn) and ``q_values`` (``Q(h, a)``
    of each taken action) are ``[num_episodes, num_turns]``; consecutive blocks of ``group_size``
    episodes were sampled from the same context ``h``. The baseline of sample ``i`` is the mean Q
    of the *other* samples of its group, so it does not depend on ``a_i`` and the policy gradient
    stays unbiased whatever the critic's errors; ``G_i - Q(h, a_i)`` would instead shrink to zero
    as Q fits, whatever the action. (With a perfectly fitted Q = r this is the leave-one-out
    ``r_i - mean_{j != i} r_j``; the critic lowers the baseline's variance when rewards are noisy.)
    Dropped samples (NaN target) are left out of the baselines; a NaN result (dropped, or no other
    kept sample in the group) means "no advantage".
    """
    if targets.shape != q_values.shape or targets.dim() != 2:
        raise ValueError(
            f"targets and q_values must both be [num_episodes, num_turns], got {tuple(targets.shape)} and "
            f"{tuple(q_values.shape)}"
        )
    num_episodes, num_turns = targets.shape
    if group_size < 1 or num_episodes % group_size:
        raise ValueError(f"{num_episodes} episodes do not split into groups of group_size={group_size}")
    kept_q = torch.where(torch.isnan(targets), torch.full_like(q_values, float("nan")), q_values)
    grouped = kept_q.reshape(-1, group_size, num_turns)  # [num_groups, group_size, num_turns]
    baseline = leave_one_out_mean(grouped, dim=1).reshape(num_episodes, num_turns)
    return targets - baseline


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


def moments(values: torch.Tensor) -> torch.Tensor:
    """``[count, sum, sum of squares]`` of ``values`` in float64: what :func:`normalize` needs, summable
    over processes (data parallelism standardises over the global batch this way)."""
    flat = values.double().reshape(-1)
    return torch.stack([flat.new_tensor(float(flat.numel())), flat.sum(), (flat * flat).sum()])


def normalize(values: torch.Tensor, eps: float = 1e-6, unbiased: bool = True,
              totals: torch.Tensor | None = None) -> torch.Tensor:
    """Zero mean, unit std over all entries; fewer than two entries or constant ones give zeros.

    The std is the sample std (Bessel-corrected, ``n - 1``) when ``unbiased``, as in
    :func:`group_relative_advantages`, or the population std (``n``) otherwise. ``totals``
    (:func:`moments` summed over every process's values) standardises over all of them instead.
    """
    if totals is not None:
        count, total, squares = (float(x) for x in totals)
        if count < 2:
            return torch.zeros_like(values)
        mean = total / count
        std = max(squares - count * mean * mean, 0.0) / (count - 1 if unbiased else count)
        std = std ** 0.5
        if std <= eps:
            return torch.zeros_like(values)
        return (values - mean) / (std + eps)
    if values.numel() < 2:
        return torch.zeros_like(values)
    std = values.std(unbiased=unbiased)
    if std <= eps:
        return torch.zeros_like(values)
    return (values - values.mean()) / (std + eps)


ADVANTAGE_MODES = ("mean", "raw", "max", "rloo")


def baseline_advantages(
    rewards: torch.Tensor, mode: str = "mean", normalize: bool = True, eps: float = 1e-6, unbiased: bool = True
) -> torch.Tensor:
    """Per-group advantages ``A = R - b`` for the REINFORCE family, ``rewards`` ``[num_groups, group_size]``.

    ``mode`` picks the baseline ``b`` of each sample: ``"mean"`` the group mean (MAGRPO, exactly
    :func:`group_relative_advantages`), ``"raw"`` none (``A = R``, MAREINFORCE), ``"max"`` the group's
    maximum (``A = R - max R <= 0``, MAReMax), ``"rloo"`` the mean of the *other* samples of the group
    (``A_i = R_i - mean_{j != i} R_j``, MARLOO; a sample alone in its group gets 0). With ``normalize`` the advantages are divided by the
    group's reward std (sample std when ``unbiased``); they are never re-centred, so the modes stay
    different estimators (re-centring would turn every mode into ``"mean"``). A group whose std is at
    most ``eps`` is left unscaled. NaN marks a dropped sample: left out of every statistic, advantage 0.
    """
    if mode == "mean":
        return group_relative_advantages(rewards, normalize=normalize, eps=eps, unbiased=unbiased)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    valid = ~torch.isnan(rewards)
    if mode == "raw":
        baseline = torch.zeros_like(rewards)
    elif mode == "max":
        baseline = torch.where(valid, rewards, torch.full_like(rewards, -torch.inf)).amax(dim=1, keepdim=True)
        baseline = baseline.expand_as(rewards)
    elif mode == "rloo":
        baseline = leave_one_out_mean(rewards, dim=1)
        baseline = torch.where(torch.isnan(baseline), rewards, baseline)  # alone in its group: no baseline, A = 0
    else:
        raise ValueError(f"advantage_mode must be one of {list(ADVANTAGE_MODES)}, got {mode!r}")
    advantages = torch.where(valid, rewards - baseline, torch.zeros_like(rewards))
    if not normalize:
        return advantages
    kept = valid.sum(dim=1, keepdim=True)
    filled = torch.where(valid, rewards, torch.zeros_like(rewards))
    mean = filled.sum(dim=1, keepdim=True) / kept.clamp(min=1)
    squares = torch.where(valid, (rewards - mean) ** 2, torch.zeros_like(rewards)).sum(dim=1, keepdim=True)
    std = torch.sqrt(squares / (kept - 1 if unbiased else kept).clamp(min=1))
    scale = torch.where((std > eps) & (kept >= 2), std + eps, torch.ones_like(std))
    return advantages / scale
