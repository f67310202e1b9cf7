"""IAC and MAAC stages against the maths written out by hand (docs/algorithms.md, "Actor-critic").

On tiny models, with rewards and values given by hand where a stage takes them: the advantages stage (GAE over
turns with ``0 < lambda < 1``, targets ``G = A + V``, standardising over the kept samples, a Q critic's
leave-one-out baseline, each agent's KL-shaped advantage, episodes that early termination ended), the values
stage (each critic's hidden state at the last real token through its head, NaN at unreached turns), the critic
metrics, the optimizers' parameter groups, and one update: every optimizer step's gradient (an optimizer step
pre-hook; ``max_grad_norm=None``) against the gradient of the actor loss (on-policy ratio, entropy bonus, KL
term) and the critic loss (per-turn clipped MSE over the turns, ``value_loss_coef``, two critic epochs)
written out here. Nothing of comlrl's maths, values or log-probabilities is called on the expected side.

Tolerance: both sides run the same float32 forwards, summed in another order; measured, gradients agree to a
relative distance below 1e-6, values to 1e-6. ``RTOL = 1e-4`` leaves room for other CPUs and BLAS builds.
"""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch
from datasets import Dataset

from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl.trainers.actor_critic.base import Estimates, finish_advantages
from comlrl.training.metrics import MetricWindow
from comlrl.training.reference import ReferenceTerms

RTOL = 1e-4
GAMMA, LAM = 0.5, 0.5
PROMPTS = ["stop at once", "keep going", "stop here too", "keep writing"]


def go_on(prompt, agent_completions, num_agents, **_):
    return ["go on"] * num_agents


def stop_reward(completions_0, completions_1, batch_items):
    """1 for a prompt that says 'stop' (its episode ends above the threshold 0.5), else 0."""
    return [1.0 if "stop" in item["prompt"] else 0.0 for item in batch_items]


def build(kind: str, model: str, **options):
    settings = dict(num_agents=2, max_new_tokens=4, temperature=0.8, top_p=1.0, top_k=None, max_grad_norm=None,
                    per_device_train_batch_size=4, num_train_epochs=1, disable_tqdm=True, seed=5)
    model_config = options.pop("model_config", None)
    settings.update(options)
    data = Dataset.from_dict({"prompt": PROMPTS})
    common = dict(agent_model=model, num_agents=2, reward_func=stop_reward, train_dataset=data,
                  model_config=model_config)
    if settings.get("num_turns", 1) > 1:
        common["external_transition"] = go_on
    if kind == "maac":
        return MAACTrainer(critic_model=model, args=MAACConfig(**settings), **common)
    if kind == "iac_shared":
        return IACTrainer(args=IACConfig(use_separate_critic=False, **settings), **common)
    return IACTrainer(critic_model=model, args=IACConfig(**settings), **common)


# ----- the expected side --------------------------------------------------------------------------------------
def gae_by_hand(rewards: list[list[float | None]], values: list[list[float]], gamma: float, lam: float):
    """Per episode (a row; None: a turn it did not reach): A_t = delta_t + gamma lam A_{t+1} with
    delta_t = r_t + gamma V_{t+1} - V_t, V after the last reached turn 0; the target is A_t + V_t."""
    advantages, targets = [], []
    for r_row, v_row in zip(rewards, values):
        turns = len(r_row)
        a_row: list[float | None] = [None] * turns
        running = 0.0
        for t in reversed(range(turns)):
            if r_row[t] is None:
                continue
            next_value = v_row[t + 1] if t + 1 < turns and r_row[t + 1] is not None else 0.0
            running = r_row[t] + gamma * next_value - v_row[t] + gamma * lam * running
            a_row[t] = running
        advantages.append(a_row)
        targets.append([None if a is None else a + v for a, v in zip(a_row, v_row)])
    return advantages, targets


def standardised(rows: list[list[float | None]], standardise: bool) -> list[list[float]]:
    """None to 0; with ``standardise`` the others to (x - mean) / (sample std + 1e-6)."""
    kept = [x for row in rows for x in row if x is not None]
    if not standardise:
        return [[0.0 if x is None else x for x in row] for row in rows]
    mean = sum(kept) / len(kept)
    std = (sum((x - mean) ** 2 for x in kept) / (len(kept) - 1)) ** 0.5
    return [[0.0 if x is None else (x - mean) / (std + 1e-6) for x in row] for row in rows]


def as_nan(rows):
    return torch.tensor([[math.nan if x is None else x for x in row] for row in rows])


def last_hidden(model, input_ids, attention_mask) -> torch.Tensor:
    """The causal LM's last hidden state (its own forward, ``output_hidden_states``) at each row's last real token;
    positions count real tokens only."""
    positions = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    hidden = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                   output_hidden_states=True).hidden_states[-1]
    last = [max(j for j in range(attention_mask.shape[1]) if attention_mask[i, j]) for i in range(hidden.shape[0])]
    return torch.stack([hidden[i, j] for i, j in enumerate(last)])


def head_by_hand(parameters: list[torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """A linear head (weight, bias) or an MLP (weight, bias, exact GELU, weight, bias), in float32."""
    x = hidden.float()
    if len(parameters) == 4:
        w1, b1, w2, b2 = parameters
        x = x @ w1.T + b1
        x = 0.5 * x * (1 + torch.erf(x / math.sqrt(2.0)))
        return (x @ w2.T + b2)[:, 0]
    weight, bias = parameters
    return (x @ weight.T + bias)[:, 0]


def token_logprobs_and_entropy(model, generation, temperature: float):
    """log pi(o_t | ...) of each completion token and each position's entropy, from one forward over prompt +
    completion, the logits over the temperature."""
    ids = torch.cat([generation.prompt_ids, generation.completion_ids], dim=1)
    mask = torch.cat([generation.prompt_mask, generation.completion_mask.to(generation.prompt_mask.dtype)], dim=1)
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    start, width = generation.prompt_ids.shape[1], generation.completion_ids.shape[1]
    log_p = torch.log_softmax(logits[:, start - 1:start + width - 1].float() / temperature, dim=-1)
    chosen = log_p.gather(-1, generation.completion_ids.unsqueeze(-1)).squeeze(-1)
    return chosen, -(log_p.exp() * log_p).sum(dim=-1)


def sequence_mean(values, mask):
    mask = mask.float()
    return (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


def actor_loss_by_hand(model, generations, advantages_per_turn, temperature, entropy_coef=0.0,
                       reference=None, kl_coef=0.0):
    """On-policy (ratio pi / pi.detach() = 1, the clip never binds): each completion's mean over its tokens of
    -ratio x A (+ kl_coef x k3 to the reference), summed over all turns' completions and divided by their number,
    less entropy_coef x each turn's mean entropy weighted by its share of the completions."""
    total_rows = sum(g.completion_ids.shape[0] for g in generations)
    loss = 0.0
    for turn, (generation, advantages) in enumerate(zip(generations, advantages_per_turn)):
        logprobs, entropy = token_logprobs_and_entropy(model, generation, temperature)
        per_token = -torch.exp(logprobs - logprobs.detach()) * advantages.unsqueeze(1)
        if reference is not None:
            d = reference[turn] - logprobs
            per_token = per_token + kl_coef * (torch.exp(d) - d - 1)
        loss = loss + sequence_mean(per_token, generation.completion_mask).sum() / total_rows
        rows = generation.completion_ids.shape[0]
        loss = loss - entropy_coef * sequence_mean(entropy, generation.completion_mask).mean() * rows / total_rows
    return loss


def critic_loss_by_hand(model, head: list[torch.Tensor], inputs, returns, old_values, rows, clip, coef):
    """coef x the sum over turns of each turn's MSE to the targets (clipped: the larger of the two squared errors,
    the clipped value old + clamp(V - old, +-clip)), over the turns' number; dropped targets (NaN) left out."""
    total = 0.0
    for turn, turn_input in enumerate(inputs):
        values = head_by_hand(head, last_hidden(model, turn_input.input_ids, turn_input.attention_mask))
        episodes = rows[turn]
        targets, old = returns[episodes, turn], old_values[episodes, turn]
        keep = ~torch.isnan(targets)
        v, g, o = values[keep], targets[keep], old[keep]
        squared = (v - g) ** 2
        if clip is not None:
            squared = torch.maximum(squared, (o + torch.clamp(v - o, -clip, clip) - g) ** 2)
        total = total + squared.mean() / len(inputs)
    return coef * total


def relative_distance(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    def norm(tensors) -> float:
        return sum(float(t.double().pow(2).sum()) for t in tensors) ** 0.5

    larger = max(norm(actual), norm(expected))
    return norm(a - e for a, e in zip(actual, expected)) / larger if larger > 0 else 0.0


def copy_at(module, values: list[torch.Tensor]) -> torch.nn.Module:
    """A copy of ``module`` (from before the update) with its parameters set to ``values``, dropout off."""
    model = copy.deepcopy(module).eval()
    with torch.no_grad():
        for parameter, value in zip(model.parameters(), values):
            parameter.copy_(value)
    return model


def gradient(loss: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    grads = torch.autograd.grad(loss, tensors, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(tensors, grads)]


class Steps:
    """Every optimizer step of each component: the parameters (flat over its groups) and their gradients."""

    def __init__(self, trainer) -> None:
        self.steps: dict[str, list[tuple[list[torch.Tensor], list[torch.Tensor]]]] = {}
        for name, component in trainer.model_optimizers.items():
            log = self.steps.setdefault(name, [])
            component.optimizer.register_step_pre_hook(lambda opt, args, kwargs, log=log: log.append((
                [p.detach().clone() for g in opt.param_groups for p in g["params"]],
                [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                 for g in opt.param_groups for p in g["params"]])))


def randomise_heads(trainer, seed: int) -> None:
    """Non-zero heads (a new one predicts 0 and passes no gradient to the backbone)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for model in trainer.value_models:
            for parameter in model.value_head.parameters():
                parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))


# ----- the advantages stage -----------------------------------------------------------------------------------
REWARDS = [[1.0, 3.0], [0.0, 1.0], [2.0, -1.0], [0.5, 0.25]]  # [episode][turn]
VALUES = [[[0.5, 2.0], [1.0, 0.0], [-1.0, 0.5], [0.25, -0.5]],  # [value model][episode][turn]
          [[0.0, 1.0], [-0.5, 0.75], [1.5, 0.0], [2.0, 1.0]]]


@pytest.mark.parametrize("kind", ["maac", "iac"])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "standardised"])
def test_two_turn_advantages_and_targets_are_gae_by_hand(kind, normalize, tiny_llama):
    trainer = build(kind, tiny_llama, num_turns=2, discount=GAMMA, gae_lambda=LAM, normalize_advantages=normalize)
    rewards = [torch.tensor([[r[t]] for r in REWARDS]) for t in range(2)]  # per turn [nodes, 1]
    values = [torch.tensor(v) for v in VALUES[:len(trainer.value_models)]]
    estimates = trainer.advantages(rewards, values)
    assert len(estimates.advantages) == len(estimates.returns) == len(values) and estimates.agent_advantages is None
    for index, model_values in enumerate(VALUES[:len(values)]):
        advantages, targets = gae_by_hand(REWARDS, model_values, GAMMA, LAM)
        torch.testing.assert_close(estimates.returns[index], torch.tensor(targets), rtol=0, atol=1e-6)
        torch.testing.assert_close(estimates.advantages[index], torch.tensor(standardised(advantages, normalize)),
                                   rtol=0, atol=1e-5)
    for agent in range(2):  # IAC: agent i's critic; MAAC: the one critic
        assert estimates.for_agent(agent, trainer.value_model_for_agent(agent)) is \
            estimates.advantages[trainer.value_model_for_agent(agent)]
    if kind == "maac":  # lambda neither 0 nor 1 shows: A_0 of episode 0 is 1.5 + 0.25 x 1.0
        assert estimates.advantages[0][0, 0].item() == pytest.approx(1.75) or normalize


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "standardised"])
def test_kl_shaped_advantages_are_each_agents_own(normalize, tiny_llama):
    """reference_kl_mode='reward': agent i's advantage is its value model's raw estimate less coef x its own
    completions' KL at each turn, then standardised on its own; the critics' advantages and targets keep the
    task reward."""
    trainer = build("iac", tiny_llama, num_turns=2, discount=GAMMA, gae_lambda=LAM, normalize_advantages=normalize,
                    reference_kl_enabled=True, reference_kl_mode="reward", reference_kl_coef=0.3)
    rewards = [torch.tensor([[r[t]] for r in REWARDS]) for t in range(2)]
    kl = [[[0.1, 0.4, 0.0, 1.0], [0.2, 0.0, 0.5, 0.3]],  # [agent][turn][episode]
          [[2.0, 0.0, 0.3, 0.1], [0.0, 0.6, 0.1, 0.9]]]
    reference = ReferenceTerms([], [], [[torch.tensor(k) for k in agent] for agent in kl])
    estimates = trainer.advantages(rewards, [torch.tensor(v) for v in VALUES], reference)
    for agent in range(2):
        raw, targets = gae_by_hand(REWARDS, VALUES[agent], GAMMA, LAM)
        shaped = [[a - 0.3 * kl[agent][t][e] for t, a in enumerate(row)] for e, row in enumerate(raw)]
        torch.testing.assert_close(estimates.agent_advantages[agent], torch.tensor(standardised(shaped, normalize)),
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(estimates.advantages[agent], torch.tensor(standardised(raw, normalize)),
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(estimates.returns[agent], torch.tensor(targets), rtol=0, atol=1e-6)
        assert estimates.for_agent(agent, agent) is estimates.agent_advantages[agent]
    # under reference_kl_mode='loss' the KL is a loss term, not a reward: no per-agent advantages
    trainer.args.reference_kl_mode = "loss"
    assert trainer.advantages(rewards, [torch.tensor(v) for v in VALUES], reference).agent_advantages is None


def test_q_critic_baseline_leaves_out_the_sample_and_the_dropped(tiny_llama):
    """One turn, two joint samples per prompt: A_i = r_i - Q_j of the prompt's other sample, standardised over
    the kept samples; a dropped (NaN) reward has no target, advantage 0, and leaves its partner without a
    baseline (NaN: advantage 0)."""
    trainer = build("maac", tiny_llama, num_generations=2, critic_type="q", normalize_advantages=True,
                    per_device_train_batch_size=2)
    rewards = [torch.tensor([[1.0, 0.0], [2.0, math.nan], [0.5, 3.0]])]
    q = torch.tensor([[0.25], [1.0], [0.5], [4.0], [2.0], [-1.0]])
    estimates = trainer.advantages(rewards, [q])
    raw = [[1.0 - 1.0], [0.0 - 0.25], [None], [None], [0.5 - (-1.0)], [3.0 - 2.0]]
    torch.testing.assert_close(estimates.advantages[0], torch.tensor(standardised(raw, True)), rtol=0, atol=1e-5)
    torch.testing.assert_close(estimates.returns[0], torch.tensor([[1.0], [0.0], [2.0], [math.nan], [0.5], [3.0]]),
                               equal_nan=True)
    metrics = trainer.critic_metrics([q], estimates)
    assert metrics["critic/value_mean"] == pytest.approx(sum(q.reshape(-1).tolist()) / 6)
    errors = [abs(r - v) for r, v in zip([1.0, 0.0, 2.0, 0.5, 3.0], [0.25, 1.0, 0.5, 2.0, -1.0])]
    assert metrics["critic/value_error"] == pytest.approx(sum(errors) / 5)


# ----- early termination: values, advantages and one update by hand ------------------------------------------
def test_ended_episodes_values_advantages_and_update_by_hand(tiny_llama):
    """IAC with separate critics, two turns, early termination: the 'stop' prompts' episodes end after turn 1.
    Values: each critic's forward by hand, NaN where an episode did not go. Advantages: GAE on the reached turns
    (an ended episode's next value is 0), standardised over the reached turns only. Update: each actor's one
    step and each critic's two (critic_update_epochs=2) take the gradients of the losses by hand, the critics'
    second epoch clipped against the rollout-time values."""
    clip, coef, entropy_coef = 0.02, 0.6, 0.05
    trainer = build("iac", tiny_llama, num_turns=2, discount=GAMMA, gae_lambda=LAM, normalize_advantages=True,
                    early_termination_threshold=0.5, critic_update_epochs=2, value_clip_range=clip,
                    value_loss_coef=coef, entropy_coef=entropy_coef, value_head_learning_rate=1e-3,
                    critic_learning_rate=1e-5, agent_learning_rate=1e-3,
                    reference_kl_mode="loss", reference_kl_coef=0.3)  # not enabled: no reference, no KL term
    randomise_heads(trainer, seed=3)
    rollout = trainer.rollout([trainer.train_dataset[i] for i in range(4)])
    rows = rollout.episode_rows()
    assert [r.tolist() for r in rows] == [[0, 1, 2, 3], [1, 3]]
    inputs = trainer.critic_inputs(rollout)
    values = trainer.values(inputs, rollout)

    critics_before = [copy.deepcopy(c) for c in trainer.critics]
    heads_before = [[p.detach().clone() for p in c.value_head.parameters()] for c in trainer.critics]
    with torch.no_grad():
        for k, critic in enumerate(critics_before):
            expected = torch.full((4, 2), math.nan)
            for turn, turn_input in enumerate(inputs[k]):
                hidden = last_hidden(critic, turn_input.input_ids, turn_input.attention_mask)
                expected[rows[turn], turn] = head_by_hand(heads_before[k], hidden)
            torch.testing.assert_close(values[k], expected, rtol=0, atol=1e-5, equal_nan=True)
            assert values[k][[1, 3]].abs().min() > 1e-3  # the heads say something

    rewards = [torch.tensor([[1.0], [0.5], [2.0], [-1.0]]), torch.tensor([[3.0], [0.25]])]  # turn 2: episodes 1, 3
    by_episode = [[1.0, None], [0.5, 3.0], [2.0, None], [-1.0, 0.25]]
    estimates = trainer.advantages(rewards, values, None, rollout)
    for k in range(2):
        advantages, targets = gae_by_hand(by_episode, values[k].nan_to_num(0.0).tolist(), GAMMA, LAM)
        torch.testing.assert_close(estimates.returns[k], as_nan(targets), rtol=0, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(estimates.advantages[k], torch.tensor(standardised(advantages, True)),
                                   rtol=0, atol=1e-5)

    # as reward shaping, each agent's KL of its turn-2 completions belongs to the episodes that went on
    kl = [[torch.tensor([0.1, 0.4, 0.0, 1.0]), torch.tensor([0.2, 0.5])],
          [torch.tensor([2.0, 0.0, 0.3, 0.1]), torch.tensor([0.6, 0.0])]]
    trainer.args.reference_kl_mode = "reward"
    shaped = trainer.advantages(rewards, values, ReferenceTerms([], [], kl), rollout).agent_advantages
    trainer.args.reference_kl_mode = "loss"
    for agent in range(2):
        raw, _ = gae_by_hand(by_episode, values[agent].nan_to_num(0.0).tolist(), GAMMA, LAM)
        by_turn = [dict(zip(rows[t].tolist(), kl[agent][t].tolist())) for t in range(2)]
        less_kl = [[None if a is None else a - 0.3 * by_turn[t][e] for t, a in enumerate(row)] for e, row in enumerate(raw)]
        torch.testing.assert_close(shaped[agent], torch.tensor(standardised(less_kl, True)), rtol=0, atol=1e-5)

    actors_before = [copy.deepcopy(a) for a in trainer.agents]
    steps = Steps(trainer)
    metrics = trainer.update(rollout, inputs, estimates, values)
    for agent in range(2):
        (parameters, applied), = steps.steps[f"agent_{agent}"]
        model = copy_at(actors_before[agent], parameters)
        per_turn = [estimates.advantages[agent][rows[t], t] for t in range(2)]
        loss = actor_loss_by_hand(model, [turn.generations[agent] for turn in rollout.turns], per_turn, 0.8,
                                  entropy_coef)
        assert relative_distance(applied, gradient(loss, list(model.parameters()))) < RTOL, agent
    clipped_somewhere = False
    for k in range(2):
        passes = steps.steps[f"critic_{k}"]
        assert len(passes) == 2  # one optimizer step per critic epoch
        size = len(list(critics_before[k].parameters()))
        for epoch, (parameters, applied) in enumerate(passes):
            model = copy_at(critics_before[k], parameters[:size])
            head = [p.clone().requires_grad_(True) for p in parameters[size:]]
            loss = critic_loss_by_hand(model, head, inputs[k], estimates.returns[k], values[k], rows, clip, coef)
            expected = gradient(loss, list(model.parameters()) + head)
            assert relative_distance(applied, expected) < RTOL, (k, epoch)
        # the second epoch's values moved towards their targets past the clip range for some sample, so without
        # the clipping its gradient would be another
        unclipped = critic_loss_by_hand(model, head, inputs[k], estimates.returns[k], values[k], rows, None, coef)
        clipped_somewhere |= relative_distance(gradient(unclipped, list(model.parameters()) + head), expected) > 1e-3
        # the metrics: the last epoch's loss without the coefficient, its step's gradient norm and learning rate
        assert metrics[f"critic_{k}/value_loss"] == pytest.approx(float(loss.detach()) / coef, rel=1e-5)
        norm = sum(float(g.double().pow(2).sum()) for g in applied) ** 0.5
        assert metrics[f"critic_{k}/grad_norm"] == pytest.approx(norm, rel=1e-5)
        assert metrics[f"critic_{k}/learning_rate"] == 1e-5
    assert clipped_somewhere


# ----- a shared value head: one optimizer step for both losses -----------------------------------------------
def test_shared_head_steps_the_actor_and_value_losses_together(tiny_llama):
    """IAC with use_separate_critic=False and an MLP head: each actor's one optimizer step applies the gradient of
    its actor loss (with the KL to a reference as a loss term) plus value_loss_coef x its value loss, both by
    hand; the head's parameter group has the head's learning rate."""
    coef, kl_coef = 0.5, 0.2
    trainer = build("iac_shared", tiny_llama, num_generations=2, per_device_train_batch_size=2,
                    normalize_advantages=False, value_head_hidden_dim=8, value_loss_coef=coef,
                    reference_kl_enabled=True, reference_kl_mode="loss", reference_kl_coef=kl_coef,
                    agent_learning_rate=1e-4, value_head_learning_rate=2e-2)
    assert not trainer.critics and trainer.critic_optimizers == []
    for agent in trainer.agents:
        groups = trainer.model_optimizers[f"agent_{trainer.agents.index(agent)}"].optimizer.param_groups
        assert [g["lr"] for g in groups] == [1e-4, 2e-2]
        assert [id(p) for p in groups[0]["params"]] == [id(p) for p in agent.parameters()]
        assert [id(p) for p in groups[1]["params"]] == [id(p) for p in agent.value_head.parameters()]
    randomise_heads(trainer, seed=4)
    rollout = trainer.rollout([trainer.train_dataset[i] for i in range(2)])
    inputs = trainer.critic_inputs(rollout)
    values = trainer.values(inputs)
    rewards = [torch.tensor([[1.0, 0.0], [0.5, 2.0]])]
    estimates = trainer.advantages(rewards, values)
    generator = torch.Generator().manual_seed(9)  # the reference's log-probabilities, away from the policy's
    reference = ReferenceTerms([], [[-3.0 + 0.5 * torch.randn(rollout.turns[0].generations[a].completion_ids.shape,
                                                              generator=generator)] for a in range(2)], [])
    before = [copy.deepcopy(a) for a in trainer.agents]
    # the critic loss on its own (rows not given: every episode reached every turn), by hand with coefficient 1
    direct = sum(trainer.critic_losses(trainer.agents[0], inputs[0], estimates.returns[0], values[0]))
    head = [p.detach() for p in trainer.agents[0].value_head.parameters()]
    assert float(direct.detach()) == pytest.approx(float(critic_loss_by_hand(
        before[0], head, inputs[0], estimates.returns[0], values[0], [slice(None)], None, 1.0).detach()), rel=1e-5)
    steps = Steps(trainer)
    trainer.update(rollout, inputs, estimates, values, reference)
    for agent in range(2):
        (parameters, applied), = steps.steps[f"agent_{agent}"]
        size = len(list(before[agent].parameters()))
        model = copy_at(before[agent], parameters[:size])
        head = [p.clone().requires_grad_(True) for p in parameters[size:]]
        loss = actor_loss_by_hand(model, [rollout.turns[0].generations[agent]], [estimates.advantages[agent][:, 0]],
                                  0.8, reference=reference.reference[agent], kl_coef=kl_coef)
        loss = loss + critic_loss_by_hand(model, head, inputs[agent], estimates.returns[agent], values[agent],
                                          [slice(None)], None, coef)
        assert relative_distance(applied, gradient(loss, list(model.parameters()) + head)) < RTOL, agent


def test_separate_critics_step_at_their_own_rates(tiny_llama):
    """A separate critic's optimizer: its backbone at critic_learning_rate, its head at value_head_learning_rate
    (critic_learning_rate when None); the actor's holds the actor alone."""
    for head_rate, expected in ((3e-2, 3e-2), (None, 2e-4)):
        trainer = build("maac", tiny_llama, agent_learning_rate=1e-4, critic_learning_rate=2e-4,
                        value_head_learning_rate=head_rate)
        critic = trainer.critics[0]
        groups = trainer.critic_optimizers[0].param_groups
        assert [g["lr"] for g in groups] == [2e-4, expected]
        assert [id(p) for p in groups[0]["params"]] == [id(p) for p in critic.parameters()]
        assert [id(p) for p in groups[1]["params"]] == [id(p) for p in critic.value_head.parameters()]
        for index, agent in enumerate(trainer.agents):
            groups = trainer.model_optimizers[f"agent_{index}"].optimizer.param_groups
            assert [g["lr"] for g in groups] == [1e-4]
            assert [id(p) for p in groups[0]["params"]] == [id(p) for p in agent.parameters()]


def test_estimates_serve_the_value_models_advantage_without_shaping():
    shared, own = torch.zeros(2, 1), [torch.ones(2, 1), torch.full((2, 1), 2.0)]
    assert Estimates([shared], [shared]).for_agent(1, 0) is shared
    assert Estimates([shared], [shared], own).for_agent(1, 0) is own[1]


def test_finish_advantages_standardises_the_kept_samples_alone():
    """Outside a trainer (no data parallelism given): dropped (NaN) estimates become 0 and stay out of the mean
    and std; without standardising the rest are kept as they are."""
    estimate = torch.tensor([[1.0, math.nan], [3.0, 2.0]])
    scale = 1.0 / (1.0 + 1e-6)  # kept 1, 3, 2: mean 2, sample std 1
    torch.testing.assert_close(finish_advantages(estimate.clone(), True),
                               torch.tensor([[-scale, 0.0], [scale, 0.0]]), rtol=0, atol=1e-7)
    torch.testing.assert_close(finish_advantages(estimate.clone(), False), torch.tensor([[1.0, 0.0], [3.0, 2.0]]))


def test_a_steps_history_row_holds_its_times_values_and_reference_kl(tiny_llama):
    """One training step (four prompts, one batch): its times are positive and within the step's, which is within
    the call's; tokens per second times the step time is the completions' token count; the new critics predict 0,
    so their mean error is the mean reward; the reference KL is reported (0: the reference is the initial policy)."""
    trainer = build("iac", tiny_llama, reference_kl_enabled=True, reference_kl_coef=0.1)
    started = time.perf_counter()
    history = trainer.train()
    elapsed = time.perf_counter() - started
    assert len(history) == 1
    row = history[0]
    assert 0 < row["step_time"] <= elapsed
    for name in ("generation_time", "reward_time", "update_time"):
        assert 0 < row[name] <= row["step_time"], name
    completions = len(PROMPTS) * trainer.args.num_generations
    tokens = sum(row[f"agent_{agent}/completion_length"] * completions for agent in range(2))
    assert row["tokens_per_second"] * row["step_time"] == pytest.approx(tokens, rel=1e-6)
    assert row["reward_mean"] == 0.5  # two of the four prompts say 'stop'
    for k in range(2):
        assert row[f"critic_{k}/value_mean"] == 0.0 and row[f"critic_{k}/value_error"] == pytest.approx(0.5)
    assert row["reference_kl_mean"] == pytest.approx(0.0, abs=1e-6) and "agent_1/reference_kl" in row


def test_a_critic_step_inside_an_accumulation_window_is_reported(tiny_llama):
    """Three critic epochs, accumulation 2: the second pass steps the critic, the third starts a new window;
    the update reports the step the critic took (its gradient norm), not the open window."""
    trainer = build("maac", tiny_llama, critic_update_epochs=3, gradient_accumulation_steps=2,
                    per_device_train_batch_size=2, num_generations=2)
    randomise_heads(trainer, seed=6)
    rollout = trainer.rollout([trainer.train_dataset[i] for i in range(2)])
    inputs = trainer.critic_inputs(rollout)
    values = trainer.values(inputs)
    estimates = trainer.advantages([torch.tensor([[1.0, 0.0], [0.5, 2.0]])], values)
    steps = Steps(trainer)
    metrics = trainer.update(rollout, inputs, estimates, values)
    (_, applied), = steps.steps["critic"]
    assert metrics["critic/grad_norm"] == pytest.approx(sum(float(g.double().pow(2).sum()) for g in applied) ** 0.5,
                                                        rel=1e-5)
    assert "agent_0/grad_norm" not in metrics  # the actors' window (one pass of two) is still open


def test_mixed_precision_actor_update_runs_under_autocast(tiny_llama):
    """precision='bf16-mixed': every forward of an actor that records a graph (the update's) runs under
    autocast."""
    trainer = build("iac", tiny_llama, precision="bf16-mixed")
    seen: list[bool] = []
    for agent in trainer.agents:
        agent.register_forward_pre_hook(
            lambda module, args, kwargs: seen.append(torch.is_autocast_enabled("cpu")) if torch.is_grad_enabled()
            else None, with_kwargs=True)
    rollout = trainer.rollout([trainer.train_dataset[i] for i in range(2)])
    inputs = trainer.critic_inputs(rollout)
    values = trainer.values(inputs)
    trainer.update(rollout, inputs, trainer.advantages(trainer.score(rollout), values), values)
    assert len(seen) == 2 and all(seen)


def test_a_turn_without_targets_adds_no_critic_loss_and_the_next_turn_still_counts(tiny_llama):
    """Turn 1's rewards all dropped (NaN targets), turn 2's kept: the critic's losses are turn 2's MSE over the two
    turns alone."""
    from comlrl.trainers.actor_critic.critics import CriticInput

    trainer = build("maac", tiny_llama, value_clip_range=None)
    critic = trainer.critics[0]
    randomise_heads(trainer, seed=7)
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    inputs = [CriticInput(ids, mask), CriticInput(ids.flip(1), mask.flip(1))]
    returns = torch.tensor([[math.nan, 1.0], [math.nan, -2.0]])
    losses = [float(loss.detach()) for loss in trainer.critic_losses(critic, inputs, returns, torch.zeros(2, 2))]
    head = [p.detach() for p in critic.value_head.parameters()]
    with torch.no_grad():
        values = head_by_hand(head, last_hidden(critic, ids.flip(1), mask.flip(1)))
    assert losses == [pytest.approx(float(((values - returns[:, 1]) ** 2).mean()) / 2, rel=1e-5)]


def test_a_shared_heads_step_is_clipped_over_the_actor_and_its_head_on_the_planned_schedule(tiny_llama):
    """IAC with the value heads on the actors: each actor's one optimizer clips the gradient of the actor and its
    head together (the applied gradient's norm over both is max_grad_norm), and its linear schedule is planned
    with one pass per batch: 4 prompts in batches of 2 is 2 steps, so the rates used are lr, then lr / 2."""
    lr, clip = 1e-3, 1e-4
    trainer = build("iac_shared", tiny_llama, num_generations=2, per_device_train_batch_size=2, max_grad_norm=clip,
                    lr_scheduler_type="linear", agent_learning_rate=lr, value_head_learning_rate=lr)
    randomise_heads(trainer, seed=6)
    used: dict[str, list[tuple[float, float]]] = {}
    for name, component in trainer.model_optimizers.items():
        log = used.setdefault(name, [])
        component.optimizer.register_step_pre_hook(lambda opt, args, kwargs, log=log: log.append((
            opt.param_groups[0]["lr"],
            float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for g in opt.param_groups
                                                        for p in g["params"] if p.grad is not None]))))))
    trainer.train()
    assert set(used) == {"agent_0", "agent_1"}
    for name, steps in used.items():
        assert [rate for rate, _ in steps] == pytest.approx([lr, lr / 2]), name
        for _, norm in steps:  # every step's gradient was larger than the clip (checked: its reported norm)
            assert norm == pytest.approx(clip, rel=1e-3), name
    reported = [row["agent_0/grad_norm"] for row in trainer.state.history]
    assert len(reported) == 2 and all(value > clip for value in reported)


@pytest.mark.parametrize("kind", ["maac", "iac_shared"])
def test_each_optimizer_is_named_by_its_model_in_its_refusals(tiny_llama, kind):
    trainer = build(kind, tiny_llama, num_generations=2)
    trainer.train()  # one step of 4 prompts
    expected = {"agent_0", "agent_1"} | ({"critic"} if kind == "maac" else set())
    assert set(trainer.model_optimizers) == expected
    for name, component in trainer.model_optimizers.items():
        with pytest.raises(RuntimeError) as refused:
            component.replan(10)
        assert str(refused.value) == f"{name}: the schedule cannot be re-planned after 1 steps"


# ----- construction as a user meets it ------------------------------------------------------------------------
@pytest.mark.parametrize("trainer_class, config_class", [(IACTrainer, IACConfig), (MAACTrainer, MAACConfig)])
def test_construction_names_the_trainer_and_its_config_in_its_refusals(tiny_llama, trainer_class, config_class):
    data = Dataset.from_dict({"prompt": PROMPTS})
    with pytest.raises(ValueError) as no_reward:
        trainer_class(agent_model=tiny_llama, critic_model=tiny_llama, reward_func=None, train_dataset=data)
    assert str(no_reward.value) == (f"reward_func must be a callable: {trainer_class.__name__} needs reward_func (a "
                                    "callable or a list of callables), got None")
    with pytest.raises(ValueError) as disagree:
        trainer_class(agent_model=tiny_llama, critic_model=tiny_llama, num_agents=3, reward_func=stop_reward,
                      train_dataset=data, args=config_class(num_agents=2))
    assert str(disagree.value) == (
        f"num_agents must match args.num_agents: num_agents=3 (constructor) disagrees with {config_class.__name__}"
        ".num_agents=2; set both to the same value (the config alone never overrides the constructor argument)")


@pytest.mark.parametrize("trainer_class, config_class, critics", [(IACTrainer, IACConfig, 2),
                                                                   (MAACTrainer, MAACConfig, 1)])
def test_a_trainer_without_args_takes_its_configs_defaults_and_names_its_critics(tiny_llama, trainer_class,
                                                                                 config_class, critics):
    trainer = trainer_class(agent_model=tiny_llama, critic_model=tiny_llama, reward_func=stop_reward,
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    assert type(trainer.args) is config_class and trainer.args.num_agents == 2 == len(trainer.agents)
    assert trainer.critic_sources == [tiny_llama] * critics and len(trainer.critics) == critics


def test_a_critic_device_that_does_not_exist_is_refused_naming_the_field(tiny_llama):
    with pytest.raises(ValueError) as refused:
        build("maac", tiny_llama, critic_device="cuda:99")
    assert str(refused.value).startswith("MAACConfig.critic_device='cuda:99' cannot be used: device 'cuda:99' was "
                                         "requested but this machine has ")


def test_critic_objects_are_trained_in_place_unless_they_are_also_actors(tiny_llama, tiny_llama_b):
    """IAC given model objects: a critic object that is also an actor becomes a copy (never the actor itself);
    one that is not is the very object the user passed (trained in place). Critics get gradient checkpointing
    when asked, like the actors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    actors = [AutoModelForCausalLM.from_pretrained(tiny_llama) for _ in range(2)]
    own_critic = AutoModelForCausalLM.from_pretrained(tiny_llama_b)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    trainer = IACTrainer(agents=actors, critics=[actors[0], own_critic], tokenizer=tokenizer, reward_func=stop_reward,
                         train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                         args=IACConfig(num_agents=2, max_new_tokens=4, gradient_checkpointing=True, disable_tqdm=True))
    shared, own = trainer.critics
    assert shared is not actors[0] and own is own_critic
    actor_weights = {id(p) for a in trainer.agents for p in a.parameters()}
    assert not any(id(p) in actor_weights for p in shared.parameters())
    for name, value in actors[0].state_dict().items():  # the copy starts from the actor's weights
        assert torch.equal(shared.state_dict()[name], value)
    assert all(model.is_gradient_checkpointing for model in list(trainer.agents) + list(trainer.critics))


def test_a_checkpoint_inside_an_accumulation_window_holds_the_shared_heads_gradient_too(tiny_llama):
    """IAC with the heads on the actors, two micro-batches per optimizer step: after the first, each actor's
    component saves the window's gradient of the actor and of its head (a resume adds the second to both)."""
    trainer = build("iac_shared", tiny_llama, num_generations=2, per_device_train_batch_size=2,
                    gradient_accumulation_steps=2)
    randomise_heads(trainer, seed=2)
    trainer.take_step(MetricWindow())
    for index, agent in enumerate(trainer.agents):
        state = trainer.model_optimizers[f"agent_{index}"].state_dict()
        assert state["pending"] == 1 and state["steps"] == 0
        expected = {f"0.{name}": p.grad for name, p in agent.named_parameters()}
        expected |= {f"1.{name}": p.grad for name, p in agent.value_head.named_parameters()}
        assert set(state["pending_grads"]) == set(expected)
        for name, grad in expected.items():
            assert torch.equal(state["pending_grads"][name], grad), name
        assert any(bool(state["pending_grads"][name].abs().sum() > 0) for name in expected if name.startswith("1."))


@pytest.mark.parametrize("kind", ["maac", "iac_shared"])
def test_critics_and_heads_load_in_the_model_configs_dtype(tiny_llama, kind):
    trainer = build(kind, tiny_llama, model_config={"dtype": torch.float64})
    assert {p.dtype for model in trainer.value_models for p in model.parameters()} == {torch.float64}
    assert {p.dtype for agent in trainer.agents for p in agent.parameters()} == {torch.float64}
