"""Zero-variance groups: the metric ``reward/zero_variance_groups`` and ``skip_zero_variance_groups``.

A group is the joint samples of one prompt (or node) at one turn: what a baseline is taken over. The
pure function is checked on hand-made returns; the metric against the rewards the reward function
really returned; the update against gradients written out here in plain torch (a fresh copy of the
model, a forward over the kept rows only, ``log_softmax`` and ``gather``): with the option off the
constant groups' rows stay in the batch and in the normaliser, as before; with it on the gradient is
that of the batch with those rows removed. Nothing of comlrl's maths is called on the expected side.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from comlrl.algorithms.advantages import group_relative_advantages, zero_variance_groups
from comlrl.callbacks import MetricsRecorder
from comlrl.trainers.reinforce import (CentralizedMAGRPOConfig, CentralizedMAGRPOTrainer, MAGRPOConfig,
                                       MAGRPOTrainer, MAREINFORCEConfig, MAREINFORCETrainer)

ROWS = [{"prompt": "write about the cat"}, {"prompt": "write a long story about the river and the hill"}]
NUM_GENERATIONS = 4
TEMPERATURE = 0.8
# Group 0 (the first prompt) earns 1 on every joint sample: zero variance. Group 1's rewards differ.
REWARDS = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.5, 0.2, 0.0, 0.9]])
KEPT = slice(NUM_GENERATIONS, 2 * NUM_GENERATIONS)  # generation rows of group 1
RTOL = 1e-4  # float32 forwards summed in another order (as tests/test_trainer_maths.py measures)
SEPARATION = 10 * RTOL
FAMILY = {"mean": (MAGRPOTrainer, MAGRPOConfig), "raw": (MAREINFORCETrainer, MAREINFORCEConfig)}


def constant_reward(completions_0, completions_1):
    return [1.0] * len(completions_0)


def build(model_dir: str, mode: str = "raw", rows=ROWS, reward=constant_reward, **options):
    trainer_class, config_class = FAMILY[mode]
    settings = dict(num_agents=2, num_generations=NUM_GENERATIONS, max_new_tokens=4, temperature=TEMPERATURE,
                    top_p=1.0, top_k=None, max_grad_norm=None, per_device_train_batch_size=2, num_train_epochs=1,
                    agent_learning_rate=1e-3, seed=5, disable_tqdm=True)
    return trainer_class(agent_model=model_dir, reward_func=reward, train_dataset=Dataset.from_list(rows),
                         args=config_class(**{**settings, **options}))


def weights(trainer) -> list[dict[str, torch.Tensor]]:
    return [{name: p.detach().clone() for name, p in agent.named_parameters()} for agent in trainer.agents]


def bitwise_equal(first: list[dict[str, torch.Tensor]], second: list[dict[str, torch.Tensor]]) -> bool:
    return all(torch.equal(a[name], b[name]) for a, b in zip(first, second) for name in a)


# ----- the pure function ---------------------------------------------------------------------------------------
def test_zero_variance_groups_on_hand_made_returns():
    four = torch.tensor([[0.0, 0.0, 0.0, 0.0],     # all zero: the coding task's early groups
                         [0.0, 1.0, 0.0, 0.0],     # one success
                         [0.7, 0.7, 0.7, 0.7],     # all equal, not zero
                         [0.5, 0.5, 0.5, 0.25],
                         [1.0, 1.0, 1.0, 1.0 + 2.0 ** -20]])  # tolerance 0: the least difference is variance
    assert zero_variance_groups(four).tolist() == [True, False, True, False, False]
    two = torch.tensor([[0.0, 0.0], [1.0, 0.0], [-2.0, -2.0], [3.0, 2.0]])
    assert zero_variance_groups(two).tolist() == [True, False, True, False]
    # NaN (a dropped sample) is left out; fewer than two kept samples cannot vary
    nan = float("nan")
    dropped = torch.tensor([[nan, 1.0, 1.0, 1.0], [nan, nan, 1.0, 2.0], [nan, nan, nan, 3.0], [nan] * 4])
    assert zero_variance_groups(dropped).tolist() == [True, False, True, True]
    # exactly the groups whose centred returns are all 0 (normalised, the last group's std is below eps, so
    # MAGRPO's default scales it to 0 too; the other baselines use it)
    flagged, centred = zero_variance_groups(four), group_relative_advantages(four, normalize=False)
    assert (centred[flagged] == 0).all() and (centred[~flagged] != 0).any(dim=1).all()
    with pytest.raises(ValueError, match=r"returns must be \[num_groups, group_size\], got shape \(4,\)"):
        zero_variance_groups(torch.zeros(4))


# ----- the metric ------------------------------------------------------------------------------------------------
def test_the_metric_is_the_share_of_constant_groups_among_the_rewards_returned(tiny_llama, train_dataset):
    """Two prompts per step: 'cat' and 'sun' earn 0 on every sample, the others a length difference (which
    varies or not, as sampled). Per step, the share of groups whose returned rewards are all equal, worked out
    here from what the reward function returned, is the step's metric (in the history and the callbacks')."""
    returned: list[float] = []

    def reward(completions_0, completions_1, batch_items):
        values = [0.0 if any(word in item["prompt"] for word in ("cat", "sun")) else float(len(a) - len(b))
                  for a, b, item in zip(completions_0, completions_1, batch_items)]
        returned.extend(values)
        return values

    recorder = MetricsRecorder()
    trainer = MAGRPOTrainer(agent_model=tiny_llama, reward_func=reward, train_dataset=train_dataset,
                            callbacks=[recorder],
                            args=MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=4, temperature=1.0,
                                              top_p=1.0, top_k=None, per_device_train_batch_size=2,
                                              num_train_epochs=1, seed=3, disable_tqdm=True))
    history = trainer.train()
    per_step = 2 * 2  # prompts x joint samples
    assert len(returned) == len(history) * per_step
    shares = []
    for step in range(len(history)):
        groups = [returned[step * per_step + start:step * per_step + start + 2] for start in (0, 2)]
        shares.append(sum(len(set(group)) == 1 for group in groups) / 2)
    assert [row["reward/zero_variance_groups"] for row in history] == shares
    assert [record["reward/zero_variance_groups"] for record in recorder.records] == shares
    assert 0 < sum(shares) < len(shares), f"the run should mix constant and varying groups: {shares}"
    assert all("reward/skipped_groups" not in row for row in history)  # only with the option on


def test_the_metric_judges_each_turn_on_its_returns(tiny_llama, train_dataset):
    """Two turns, discount 0.5 (docs/algorithms.md): turn 1's joint samples earn 1 and 0, but their returns are
    1 + 0.5 x mean(0, 0) = 1 and 0 + 0.5 x mean(2, 2) = 1: constant. Turn 2's nodes earn (0, 0) and (2, 2):
    constant too; with (0, 1) for the second node, turn 1's returns differ and so does that node."""
    trainer = MAGRPOTrainer(
        agent_model=tiny_llama, num_agents=2, reward_func=lambda c0, c1: [0.0] * len(c0), train_dataset=train_dataset,
        external_transition=lambda prompt, agent_completions, num_agents, **_: ["next"] * num_agents,
        args=MAGRPOConfig(num_agents=2, num_turns=2, num_generations=2, discount=0.5, max_new_tokens=4,
                          skip_zero_variance_groups=True, disable_tqdm=True))
    constant = trainer.zero_variance([torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0], [2.0, 2.0]])])
    assert [flags.tolist() for flags in constant] == [[True], [True, True]]
    assert trainer.group_metrics(constant) == {"reward/zero_variance_groups": 1.0, "reward/skipped_groups": 3.0}
    mixed = trainer.zero_variance([torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0], [0.0, 1.0]])])
    assert [flags.tolist() for flags in mixed] == [[False], [True, False]]
    assert trainer.group_metrics(mixed) == {"reward/zero_variance_groups": pytest.approx(1 / 3),
                                            "reward/skipped_groups": 1.0}


# ----- one update against the maths ------------------------------------------------------------------------------
def token_logprobs(model: torch.nn.Module, generation, rows) -> torch.Tensor:
    """log pi(o_t | prompt, o_<t) of the completion tokens of ``rows`` only, ``[rows, tokens]``."""
    prompt_ids, prompt_mask = generation.prompt_ids[rows], generation.prompt_mask[rows]
    completion_ids, completion_mask = generation.completion_ids[rows], generation.completion_mask[rows]
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1)
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    width = prompt_ids.shape[1]
    before_each = logits[:, width - 1:width + completion_ids.shape[1] - 1].float() / TEMPERATURE
    return torch.log_softmax(before_each, dim=-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


def advantages_by_hand(mode: str) -> torch.Tensor:
    """A = R (raw) or (R - group mean) / (sample std + 1e-6) (mean, normalised; a constant group gets 0),
    flattened to generation rows."""
    out = []
    for group in REWARDS.tolist():
        if mode == "raw":
            out += group
            continue
        mean = sum(group) / len(group)
        std = (sum((r - mean) ** 2 for r in group) / (len(group) - 1)) ** 0.5
        out += [(r - mean) / (std + 1e-6) if std > 1e-6 else 0.0 for r in group]
    return torch.tensor(out)


def gradient_by_hand(initial: torch.nn.Module, generation, rows, advantages: torch.Tensor, normaliser: float,
                     reference: torch.nn.Module | None = None, kl_coef: float = 0.0) -> dict[str, torch.Tensor]:
    """grpo's loss over ``rows``: sum_i mean_t l_it / normaliser, l = -rho A (rho = 1 at the first pass: the
    clip is inactive) plus kl_coef x k3 to the reference; its gradient by parameter name."""
    model = copy.deepcopy(initial).eval()
    logprobs = token_logprobs(model, generation, rows)
    per_token = -torch.exp(logprobs - logprobs.detach()) * advantages[rows].unsqueeze(1)
    if reference is not None:
        with torch.no_grad():
            reference_logprobs = token_logprobs(reference, generation, rows)
        d = reference_logprobs - logprobs  # k3 = exp(d) - d - 1
        per_token = per_token + kl_coef * (torch.exp(d) - d - 1)
    mask = generation.completion_mask[rows].float()
    loss = ((per_token * mask).sum(dim=1) / mask.sum(dim=1)).sum() / normaliser
    names, parameters = zip(*((n, p) for n, p in model.named_parameters() if p.requires_grad))
    return dict(zip(names, torch.autograd.grad(loss, parameters)))


def relative_distance(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    def norm(tensors) -> float:
        return sum(float(t.double().pow(2).sum()) for t in tensors) ** 0.5

    larger = max(norm(actual.values()), norm(expected.values()))
    return norm(actual[name] - expected[name] for name in expected) / larger


def one_update(trainer, zero_variance: bool = True):
    """One step's stages with REWARDS; the update's gradient stays on the parameters (accumulation 2)."""
    rollout = trainer.rollout(ROWS)
    rewards = [REWARDS.clone()]
    flags = trainer.zero_variance(rewards, rollout)
    assert [f.tolist() for f in flags] == [[True, False]]
    reference = trainer.reference(rollout)
    advantages = trainer.advantages(rewards, reference, rollout)
    if zero_variance:
        trainer.update(rollout, advantages, reference, flags)
    else:  # the update as called before the zero_variance stage existed
        trainer.update(rollout, advantages, reference)
    return rollout


@pytest.mark.parametrize("mode, skip, kl", [("mean", False, False), ("mean", True, False), ("raw", False, False),
                                            ("raw", True, False), ("raw", True, True)],
                         ids=["mean-off", "mean-skip", "raw-off", "raw-skip", "raw-skip-kl_loss"])
def test_the_update_is_the_loss_over_the_kept_groups_by_hand(mode, skip, kl, tiny_llama, tiny_llama_b):
    """Group 0 is constant. Off (the default): every row is in the loss and the normaliser counts all 8
    completions (MAGRPO: group 0's advantages are 0, so its rows only dilute the gradient; MAREINFORCE: A = 1
    pushes them up). On: the gradient is that of the loss over group 1's 4 rows alone, normalised by 4, its
    KL term included (with the KL as a loss term) and group 0's left out."""
    options = dict(reference_kl_enabled=True, reference_kl_mode="loss", reference_kl_coef=0.3,
                   reference_model=tiny_llama_b) if kl else {}
    trainer = build(tiny_llama, mode, gradient_accumulation_steps=2, skip_zero_variance_groups=skip, **options)
    initial = [copy.deepcopy(agent) for agent in trainer.agents]
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_b).eval() if kl else None
    rollout = one_update(trainer)
    advantages = advantages_by_hand(mode)
    every_row = slice(0, 2 * NUM_GENERATIONS)
    for agent in range(2):
        generation = rollout.turns[0].generations[agent]
        actual = {name: p.grad for name, p in trainer.agents[agent].named_parameters()}

        def by_hand(rows, normaliser):
            return gradient_by_hand(initial[agent], generation, rows, advantages, normaliser, reference, 0.3)

        kept_only, all_rows = by_hand(KEPT, 4.0), by_hand(every_row, 8.0)
        expected, wrong = (kept_only, all_rows) if skip else (all_rows, kept_only)
        assert relative_distance(actual, expected) < RTOL
        assert relative_distance(wrong, expected) > SEPARATION  # the test tells the two apart


def test_off_the_update_is_bitwise_the_one_without_the_groups(tiny_llama):
    """With the option off, passing the zero_variance stage's flags changes nothing, to the bit: weights after one
    optimizer step equal those of the update called as before (same weights, same rollout)."""
    before, after = (build(tiny_llama) for _ in range(2))
    loaded = weights(before)
    rollout = before.rollout(ROWS)
    for trainer, flags in ((before, None), (after, before.zero_variance([REWARDS.clone()], rollout))):
        advantages = trainer.advantages([REWARDS.clone()], None, rollout)
        trainer.update(rollout, advantages, None, flags)
    assert not bitwise_equal(weights(before), loaded)  # the step moved the weights
    assert bitwise_equal(weights(before), weights(after))


def test_off_by_default_a_run_is_bitwise_the_same(tiny_llama):
    """A run without the option and one with skip_zero_variance_groups=False: the same history (but for the
    timings and the process's memory) and weights."""
    runs = [build(tiny_llama), build(tiny_llama, skip_zero_variance_groups=False)]
    histories = [trainer.train() for trainer in runs]
    timings = {"step_time", "generation_time", "reward_time", "update_time", "tokens_per_second"}

    def deterministic(history):
        return [{k: v for k, v in row.items() if k not in timings and not k.startswith("memory/")} for row in history]

    assert deterministic(histories[0]) == deterministic(histories[1])
    assert bitwise_equal(weights(runs[0]), weights(runs[1]))


# ----- every group constant ----------------------------------------------------------------------------------------
def test_when_every_group_is_constant_no_weight_moves(tiny_llama):
    """MAREINFORCE, reward 1 everywhere (A = 1: off, every completion is pushed up). On: both steps are counted,
    with metrics, but no backward pass and no optimizer step: weights and optimizer states stay as loaded."""
    rows = ROWS * 2
    off, on = build(tiny_llama, rows=rows), build(tiny_llama, rows=rows, skip_zero_variance_groups=True)
    loaded = weights(on)
    off.train()
    assert not bitwise_equal(weights(off), loaded)
    history = on.train()
    assert bitwise_equal(weights(on), loaded)
    assert len(history) == 2 and on.state.global_step == 2
    for row in history:
        assert row["reward/zero_variance_groups"] == 1.0 and row["reward/skipped_groups"] == 2.0
        assert row["agent_0/loss"] == 0.0 and row["agent_1/loss"] == 0.0
    for component in on.model_optimizers.values():
        assert component.steps == 0 and component.pending == 0 and not component.optimizer.state


def test_centralized_magrpo_skips_too(tiny_llama):
    """The centralized trainer's groups are its joint completions per prompt: constant rewards, no update."""
    def build_centralized(skip: bool) -> CentralizedMAGRPOTrainer:
        args = CentralizedMAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=6, temperature=1.0, top_p=1.0,
                                       top_k=None, per_device_train_batch_size=2, num_train_epochs=1,
                                       advantage_mode="raw", normalize_advantages=False, agent_learning_rate=1e-3,
                                       collaboration_format="separated", section_separator="x", seed=0,
                                       disable_tqdm=True, skip_zero_variance_groups=skip)
        return CentralizedMAGRPOTrainer(agent_model=tiny_llama, reward_func=constant_reward,
                                        train_dataset=Dataset.from_list(ROWS), args=args)

    off, on = build_centralized(False), build_centralized(True)
    loaded = weights(on)
    off.train()
    assert not bitwise_equal(weights(off), loaded)
    [row] = on.train()
    assert row["reward/zero_variance_groups"] == 1.0 and row["reward/skipped_groups"] == 2.0
    assert bitwise_equal(weights(on), loaded)


# ----- the option ---------------------------------------------------------------------------------------------------
def test_the_option_is_validated_and_a_run_spec_can_set_it():
    from flows.spec import config_problems

    assert MAGRPOConfig().skip_zero_variance_groups is False
    help_text = {f.name: f.metadata["help"] for f in dataclasses.fields(MAGRPOConfig)}["skip_zero_variance_groups"]
    assert "reward/zero_variance_groups" in help_text
    with pytest.raises(ValueError, match=r"MAREINFORCEConfig\.skip_zero_variance_groups=True needs num_generations "
                                         r">= 2, got num_generations=1 \(a group of one sample is always constant"):
        MAREINFORCEConfig(num_generations=1, skip_zero_variance_groups=True)
    assert config_problems(MAGRPOConfig, {"skip_zero_variance_groups": True}) == []
    [(where, _)] = config_problems(MAREINFORCEConfig, {"num_generations": 1, "skip_zero_variance_groups": True})
    assert where == "config.skip_zero_variance_groups"
