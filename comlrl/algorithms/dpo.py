"""Direct preference optimisation, as pure functions over tensors.

For a pair of responses to one prompt, ``y_w`` preferred to ``y_l``, an agent's log-ratio
difference is

    delta = [log pi(y_w) - log pi_ref(y_w)] - [log pi(y_l) - log pi_ref(y_l)]

(sequence log-probabilities: sums over the completion tokens). DPO minimises
``-log sigmoid(beta * delta)``. In the joint (multi-agent) form each pair is a joint response,
one completion per agent, whose probability factorises over the agents, so the joint
difference is the sum of the agents' differences; agent ``a`` is trained on

    L_a = -log sigmoid(beta * (delta_a + sum_{b != a} sg(delta_b)))

where ``sg`` stops the gradient: every agent sees the joint loss but moves only its own policy.
Because ``delta_b`` depends on agent ``b``'s weights alone, the gradient of ``L_a`` with respect
to agent ``a`` equals that of the undetached joint loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sequence_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Log-probability of each whole completion: ``[rows, tokens]`` masked and summed to ``[rows]``."""
    return (token_logprobs * mask.to(token_logprobs.dtype)).sum(dim=1)


def log_ratio_differences(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor | None = None,
    reference_rejected: torch.Tensor | None = None,
) -> torch.Tensor:
    """``delta`` per pair: ``(pi_w - ref_w) - (pi_l - ref_l)`` on sequence log-probabilities ``[pairs]``.

    Without a reference (both None) it is the raw difference ``pi_w - pi_l`` (the original comlrl's form).
    """
    if (reference_chosen is None) != (reference_rejected is None):
        raise ValueError("give both reference_chosen and reference_rejected, or neither")
    difference = policy_chosen - policy_rejected
    if reference_chosen is not None:
        difference = difference - (reference_chosen - reference_rejected).to(difference)
    return difference


def joint_dpo_loss(own: torch.Tensor, others: torch.Tensor, beta: float) -> torch.Tensor:
    """One agent's joint DPO loss, the mean over pairs of ``-log sigmoid(beta * (own + sg(others)))``.

    ``own`` is this agent's ``delta`` per pair (with its graph), ``others`` the sum of the other
    agents' ``delta`` (detached here). An empty batch gives 0 (still differentiable).
    """
    if own.numel() == 0:
        return own.sum()
    joint = own + others.detach().to(own)
    return -F.logsigmoid(beta * joint).mean()


def dpo_statistics(joint_differences: torch.Tensor, beta: float, normaliser: float | None = None) -> dict[str, float]:
    """What a DPO step reports about its pairs (``joint_differences``: the summed ``delta`` per pair).

    ``loss`` the joint DPO loss, ``accuracy`` the share of pairs whose implicit reward
    ``beta * delta`` ranks the chosen response first (ties count half), ``margin`` the mean implicit
    reward margin: sums over the pairs divided by ``normaliser`` (default: their number). Under data
    parallelism each process passes its own pairs and the mean pair count over the processes, so the
    plain mean of the processes' values is the statistic over all their pairs (a process without
    pairs reports zeros). With nothing to normalise by (no pairs anywhere) there is no statistic:
    ``{}``, never NaN.
    """
    count = float(joint_differences.numel()) if normaliser is None else float(normaliser)
    if count <= 0:
        return {}
    margins = beta * joint_differences.detach().float().reshape(-1)
    wins = (margins > 0).float() + 0.5 * (margins == 0).float()
    return {"loss": float(-F.logsigmoid(margins).sum() / count), "accuracy": float(wins.sum() / count),
            "margin": float(margins.sum() / count)}
