"""The preference runs' rounds as a user sees them (docs/mutation.md, "Above the maths: MADPO's stages, the
preference rounds and replay"): the replay of earlier shards and its seeded draws by hand, the reward distribution
at float64, the DPO stage's micro-batches, the stage loop's counters, records and output directory, the preference
stage's reward model, and MADPO's pair selection and rows against values computed in the test."""

from __future__ import annotations

import json
import logging
import math
import time
from fractions import Fraction

import pytest
import torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from comlrl.callbacks import TrainerCallback
from comlrl.models.reward_model import JointRewardModel
from comlrl.rollout import preferences
from comlrl.rollout.reward_calls import RewardCallError
from comlrl.tasks.letters import letters_reward
from comlrl.training.logprobs import completion_logprobs
from comlrl.training.metrics import MetricWindow
from comlrl.training.reward_fit import fit_reward_model
from comlrl.training.signals import StopRequest
from comlrl.trainers.preference import (MADPOConfig, MADPOIterConfig, MADPOIterTrainer, MADPOTrainer, MARLHFConfig,
                                        MARLHFTrainer, replay)
from comlrl.trainers.preference.madpo import sequence_logprobs
from comlrl.trainers.preference.rounds import PreferenceRounds
from test_iterative import PROMPTS, TINY, build

SEED_STRIDE = 1_000_003  # the documented seed of iteration i: seed * 1_000_003 + i
EPOCH_STRIDE = 1_009  # and of its epoch e's shuffle: (seed * 1_000_003 + i) * 1_009 + e


def shard(iteration: int, count: int) -> Dataset:
    return preferences.pairs_dataset([{"iteration": iteration, "row_index": i, "chosen_reward": 1.0,
                                       "rejected_reward": 0.0} for i in range(count)])


def drawn(pairs: Dataset) -> list[tuple[int, int]]:
    return list(zip(pairs["iteration"], pairs["row_index"]))


# ----- which shards an iteration replays ------------------------------------------------------------
def test_replayed_shards_per_mode_by_hand():
    assert replay.replayed_shards("none", 0) == [0]
    assert replay.replayed_shards("all", 0) == [0] and replay.replayed_shards("all", 3) == [0, 1, 2, 3]
    assert replay.replayed_shards("lambda_decay", 2) == [0, 1, 2]
    assert replay.replayed_shards("last_k", 5, k=1) == [5]
    assert replay.replayed_shards("last_k", 5, k=3) == [3, 4, 5]
    assert replay.replayed_shards("last_k", 1, k=3) == [0, 1]  # never a negative iteration


@pytest.mark.parametrize("k", [None, 0, -1])
def test_last_k_without_a_positive_k_is_refused_in_words(k):
    with pytest.raises(ValueError) as info:
        replay.replayed_shards("last_k", 2, k=k)
    assert str(info.value) == f"replay mode 'last_k' needs k >= 1, got {k!r}"


def test_an_unknown_replay_mode_is_refused_in_words():
    with pytest.raises(ValueError) as info:
        replay.replayed_shards("nearest", 1, k=1)
    assert str(info.value) == "unknown replay mode 'nearest'"


# ----- the shards' weights and the seeded draw ------------------------------------------------------
def test_lambda_weights_by_hand_and_the_bounds_of_lambda():
    # lambda 0.25 over 3 shards, oldest first: 1/16, 1/4, 1 over 21/16
    assert replay.lambda_weights(3, 0.25) == pytest.approx([1 / 21, 4 / 21, 16 / 21], rel=1e-12)
    assert replay.lambda_weights(1, 0.0) == [1.0]
    assert replay.lambda_weights(2, 1.0) == [0.5, 0.5]
    for bad in (-0.01, 1.01):
        with pytest.raises(ValueError) as info:
            replay.lambda_weights(2, bad)
        assert str(info.value) == f"lambda must lie in [0, 1], got {bad!r}"


def test_shard_weights_by_hand():
    # pair counts 3, 0, 1: every pair alike; the empty shard gets nothing
    assert replay.shard_weights("all", [3, 0, 1]) == [0.75, 0.0, 0.25]
    assert replay.shard_weights("last_k", [2, 2]) == [0.5, 0.5]
    # lambda_decay without a lambda is lambda 1: uniform over the non-empty shards whatever their size
    assert replay.shard_weights("lambda_decay", [5, 0, 1]) == [0.5, 0.0, 0.5]
    # lambda 0.5 over sizes 1, 1, 4: 1/4, 1/2, 1 normalised, not weighted by size
    assert replay.shard_weights("lambda_decay", [1, 1, 4], 0.5) == pytest.approx([1 / 7, 2 / 7, 4 / 7], rel=1e-12)
    assert replay.shard_weights("all", [0, 0]) == [0.0, 0.0]
    assert replay.shard_weights("lambda_decay", [0, 0], 0.5) == [0.0, 0.0]


def test_shard_counts_draw_with_replacement_from_non_empty_shards_only():
    generator = torch.Generator().manual_seed(0)
    # one usable shard: every draw comes from it (a draw without replacement could not give 5)
    assert replay.shard_counts([0, 2, 3], [0.5, 0.5, 0.0], 5, generator) == [0, 5, 0]
    # a weight on an empty shard is ignored, not drawn
    assert replay.shard_counts([0, 4], [0.9, 0.1], 3, generator) == [0, 3]
    assert replay.shard_counts([2, 2], [0.5, 0.5], 0, generator) == [0, 0]
    assert replay.shard_counts([0, 2], [0.5, 0.5], 1, generator) == [0, 1]  # a sample of one is drawn
    assert replay.shard_counts([0, 0], [0.5, 0.5], 4, generator) == [0, 0]


def test_shard_counts_are_the_seeded_multinomial_over_the_normalised_weights():
    """The counts are the bins of ``torch.multinomial`` over the usable weights divided by their sum."""
    sizes, weights = [3, 1, 2], [0.2, 0.4, 0.2]
    expected_draws = torch.multinomial(torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64), 40, replacement=True,
                                       generator=torch.Generator().manual_seed(11))
    expected = [int((expected_draws == j).sum()) for j in range(3)]
    got = replay.shard_counts(sizes, weights, 40, torch.Generator().manual_seed(11))  # unnormalised: 0.2, 0.4, 0.2
    assert got == expected and sum(got) == 40


def test_draw_indices_is_a_permutation_repeated_while_more_are_asked():
    assert replay.draw_indices(0, 3, torch.Generator().manual_seed(0)) == []
    assert replay.draw_indices(4, 0, torch.Generator().manual_seed(0)) == []
    first = torch.randperm(5, generator=torch.Generator().manual_seed(2)).tolist()
    assert replay.draw_indices(5, 3, torch.Generator().manual_seed(2)) == first[:3]
    assert replay.draw_indices(5, 5, torch.Generator().manual_seed(2)) == first
    generator = torch.Generator().manual_seed(4)
    cycles = [torch.randperm(3, generator=generator).tolist() for _ in range(3)]
    assert replay.draw_indices(3, 7, torch.Generator().manual_seed(4)) == cycles[0] + cycles[1] + cycles[2][:1]


def test_a_sampled_replay_is_the_documented_seeded_draw():
    """``all`` with a sample size, by hand: the generator seeded ``seed * 1_000_003 + iteration``, the counts per
    shard (weights by pair count), then each shard's pairs by a permutation, oldest shard first."""
    shards = [shard(0, 4), shard(1, 2), shard(2, 3)]
    seed, iteration, size = 5, 2, 6
    generator = torch.Generator().manual_seed(seed * SEED_STRIDE + iteration)
    draws = torch.multinomial(torch.tensor([4 / 9, 2 / 9, 3 / 9], dtype=torch.float64), size, replacement=True,
                              generator=generator)
    counts = [int((draws == j).sum()) for j in range(3)]
    expected = []
    for j, count in enumerate(counts):
        order: list[int] = []
        while len(order) < count:
            order += torch.randperm(len(shards[j]), generator=generator).tolist()[: count - len(order)]
        expected += [(j, i) for i in order]
    got = replay.training_pairs(shards, iteration, "all", sample_size=size, seed=seed)
    assert drawn(got) == expected and len(got) == size
    # a lambda_decay replay without a sample size draws as many pairs as the newest shard holds
    newest = replay.training_pairs(shards, 1, "lambda_decay", decay=1.0, seed=seed)
    generator = torch.Generator().manual_seed(seed * SEED_STRIDE + 1)
    draws = torch.multinomial(torch.tensor([0.5, 0.5], dtype=torch.float64), 2, replacement=True, generator=generator)
    counts = [int((draws == j).sum()) for j in range(2)]
    expected = []
    for j, count in enumerate(counts):
        if count:
            expected += [(j, i) for i in torch.randperm(len(shards[j]), generator=generator).tolist()[:count]]
    assert drawn(newest) == expected


def test_replay_without_a_sample_size_pools_the_shards_and_missing_shards_are_refused():
    shards = [shard(0, 2), shard(1, 1)]
    assert drawn(replay.training_pairs(shards, 1, "all")) == [(0, 0), (0, 1), (1, 0)]
    assert drawn(replay.training_pairs(shards, 1, "last_k", k=1)) == [(1, 0)]
    with pytest.raises(ValueError) as info:
        replay.training_pairs(shards, 2, "last_k", k=2)
    assert str(info.value) == "iteration 2 replays shards [1, 2], but only 2 exist"
    with pytest.raises(ValueError) as info:
        replay.training_pairs(shards[:1], 1, "none")
    assert str(info.value) == "iteration 1 replays shards [1], but only 1 exist"


# ----- the reward distribution and the DPO stage's micro-batches ------------------------------------
def test_reward_distribution_is_float64_by_hand():
    values = [1 / 3, 2 / 3, 1.0, float("-inf"), 7]  # an int counts; -inf does not
    finite = [Fraction(1, 3), Fraction(2, 3), Fraction(1), Fraction(7)]
    mean = sum(finite) / 4
    variance = sum((v - mean) ** 2 for v in finite) / 4
    stats = replay.reward_distribution(values)
    assert list(stats) == ["count", "mean", "std", "min", "q25", "median", "q75", "max"]
    # the quantiles interpolate linearly: q25 at position 0.75 between 1/3 and 2/3, q75 at 2.25 between 1 and 7
    expected = {"count": 4.0, "mean": float(mean), "std": math.sqrt(float(variance)), "min": 1 / 3,
                "q25": float(Fraction(1, 3) + Fraction(3, 4) * Fraction(1, 3)), "median": float(Fraction(5, 6)),
                "q75": float(Fraction(1) + Fraction(1, 4) * 6), "max": 7.0}
    assert stats == pytest.approx(expected, rel=1e-12)  # float32 would be off by ~1e-8


def test_reward_distribution_of_nothing_finite_is_nan():
    stats = replay.reward_distribution([float("nan"), float("inf")])
    assert list(stats) == ["count", "mean", "std", "min", "q25", "median", "q75", "max"]
    assert stats["count"] == 0.0 and all(math.isnan(v) for name, v in stats.items() if name != "count")


def test_pair_batches_are_seeded_shuffles_cut_into_batches():
    seed, iteration = 3, 1
    orders = [torch.randperm(5, generator=torch.Generator().manual_seed((seed * SEED_STRIDE + iteration)
                                                                        * EPOCH_STRIDE + epoch)).tolist()
              for epoch in range(2)]
    batches = replay.pair_batches(5, 2, 2, seed, iteration)
    assert batches == [orders[0][:2], orders[0][2:4], orders[0][4:], orders[1][:2], orders[1][2:4], orders[1][4:]]
    assert orders[0] != orders[1]  # each epoch shuffles again
    assert replay.pair_batches(4, 4, 1, 0, 0) == [torch.randperm(4, generator=torch.Generator().manual_seed(0)).tolist()]
    assert replay.pair_batches(0, 2, 3, 0, 0) == []


# ----- MADPO's stages: the pairs, their rows, one counted step --------------------------------------
MADPO_TINY = dict(num_agents=2, num_generations=4, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=None,
                  agent_learning_rate=1e-2, per_device_train_batch_size=2, disable_tqdm=True, seed=3)
ROWS = [{"prompt": p} for p in PROMPTS[:2]]


def madpo(model: str, **options) -> MADPOTrainer:
    return MADPOTrainer(agent_model=model, reward_func=letters_reward, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                        args=MADPOConfig(**{**MADPO_TINY, **options}))


def kept(pairs) -> list[list[tuple[int, int]]]:
    return [[(p.chosen, p.rejected) for p in node] for node in pairs]


def sequence_sums(model, generation) -> torch.Tensor:
    """Each row's completion log-probability, summed over its unmasked tokens here (eval mode, no gradient)."""
    model.eval()
    with torch.no_grad():
        tokens = completion_logprobs(model, generation.prompt_ids, generation.prompt_mask, generation.completion_ids,
                                     generation.completion_mask, 1.0)
    return (tokens * generation.completion_mask).sum(dim=1)


# The first turn decides; a second turn's rewards (here reversed) are not read.
TWO_TURNS = [torch.tensor([[0.0, 1.0, 1.0, 3.0], [2.0, 0.0, 2.0, 5.0]]), torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 2)]


def test_select_pairs_keeps_the_widest_margins_of_the_first_turn(tiny_llama):
    trainer = madpo(tiny_llama, max_pairs_per_prompt=2)
    torch.manual_seed(7)
    pairs = trainer.select_pairs(TWO_TURNS)
    after = torch.rand(3)
    # node 0: (3, 0) margin 3, then (3, 1) and (3, 2) margin 2, by index; node 1: (3, 1) margin 5, then (3, 0), (3, 2)
    assert kept(pairs) == [[(3, 0), (3, 1)], [(3, 1), (3, 0)]]
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(3))  # the widest-margin selection draws nothing from the run's RNG
    # comparator_reward without sides: the pairs whose rejected candidate scored highest first, then widest
    comparator = madpo(tiny_llama, max_pairs_per_prompt=2, pair_selection="comparator_reward")
    assert kept(comparator.select_pairs(TWO_TURNS)) == [[(3, 1), (3, 2)], [(3, 0), (3, 2)]]
    # pairs within preference_tie_margin are ties: only gaps above 1.5 count
    margin = madpo(tiny_llama, max_pairs_per_prompt=None, preference_tie_margin=1.5)
    assert kept(margin.select_pairs(TWO_TURNS)) == [[(3, 0), (3, 1), (3, 2)], [(3, 1), (3, 0), (3, 2), (0, 1), (2, 1)]]


def test_random_selection_is_a_draw_seeded_from_the_runs_rng(tiny_llama):
    trainer = madpo(tiny_llama, pair_selection="random", max_pairs_per_prompt=2)
    torch.manual_seed(11)
    pairs = trainer.select_pairs(TWO_TURNS)
    after = torch.rand(3)
    torch.manual_seed(11)
    generator = torch.Generator().manual_seed(int(torch.randint(2**62, (1,))))
    assert torch.equal(after, torch.rand(3))  # one draw from the run's RNG, then the run goes on from there
    by_index = [[(1, 0), (2, 0), (3, 0), (3, 1), (3, 2)], [(0, 1), (2, 1), (3, 0), (3, 1), (3, 2)]]
    expected = [[node[i] for i in torch.randperm(5, generator=generator).tolist()[:2]] for node in by_index]
    assert kept(pairs) == expected


def test_the_update_takes_each_pairs_rows_and_the_joint_dpo_loss_by_hand(tiny_llama):
    """Node n's candidate k is row ``n * num_generations + k`` of every agent; the loss is
    ``mean_p -log sigmoid(beta * sum_a (log pi_a(chosen_p) - log pi_a(rejected_p)))`` without a reference."""
    trainer = madpo(tiny_llama, dpo_reference="none", dpo_beta=0.5, max_pairs_per_prompt=2)
    rollout = trainer.rollout(ROWS)
    pairs = trainer.select_pairs(TWO_TURNS)
    generations = rollout.turns[0].generations
    chosen, rejected = [3, 3, 7, 7], [0, 1, 5, 4]  # the pairs above, node 1's rows offset by 4
    joint = sum(sequence_sums(model, generation)[chosen] - sequence_sums(model, generation)[rejected]
                for model, generation in zip(trainer.agents, generations))
    before = [{k: v.clone() for k, v in agent.state_dict().items()} for agent in trainer.agents]
    metrics = trainer.update(rollout, pairs)
    assert metrics["dpo/pairs"] == 4.0
    torch.testing.assert_close(torch.tensor(metrics["dpo/loss"]),
                               -torch.nn.functional.logsigmoid(0.5 * joint).mean(), rtol=1e-5, atol=1e-6)
    assert metrics["dpo/margin"] == pytest.approx(float(0.5 * joint.mean()), rel=1e-5, abs=1e-6)  # beta * J
    # one micro-batch of one: every agent stepped
    assert all(not torch.equal(agent.state_dict()[k], old[k]) for agent, old in zip(trainer.agents, before)
               for k in ["lm_head.weight"])


def test_the_reference_halves_are_the_chosen_then_the_rejected_rows(tiny_llama, tiny_llama_b):
    """With another model as the reference, each agent's reference terms are its chosen rows' and its rejected
    rows' sequence log-probabilities under that model, in that order."""
    trainer = madpo(tiny_llama, reference_model=tiny_llama_b)
    generations = [preferences.generation_rows(g, [3, 7, 0, 5]) for g in trainer.rollout(ROWS).turns[0].generations]
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_b)
    for (chosen, rejected), generation in zip(trainer.reference_logprobs(generations), generations):
        expected = sequence_sums(reference, generation)
        torch.testing.assert_close(chosen, expected[:2], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rejected, expected[2:], rtol=1e-5, atol=1e-5)
    assert madpo(tiny_llama, dpo_reference="none").reference_logprobs(generations) == [None, None]
    # the initial weights, placed by reference_devices: the same numbers as the agents before any step
    placed = madpo(tiny_llama, reference_devices="cpu")
    initial = AutoModelForCausalLM.from_pretrained(tiny_llama)
    for (chosen, rejected), generation in zip(placed.reference_logprobs(generations), generations):
        expected = sequence_sums(initial, generation)
        torch.testing.assert_close(torch.cat([chosen, rejected]), expected, rtol=1e-5, atol=1e-5)


def test_sequence_logprobs_score_with_dropout_off_and_at_temperature_one(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, attention_dropout=0.5)
    trainer = madpo(tiny_llama, temperature=2.0)
    generation = trainer.rollout(ROWS).turns[0].generations[0]
    model.train()
    torch.manual_seed(0)
    values = sequence_logprobs(model, generation)
    assert model.training  # left as it was
    torch.testing.assert_close(values.detach(), sequence_sums(model, generation), rtol=1e-6, atol=1e-6)


def test_a_preference_step_is_counted_and_its_end_of_pass_applies_the_window(tiny_llama):
    trainer = madpo(tiny_llama, dpo_reference="none", gradient_accumulation_steps=3)
    rows = [3, 7, 0, 5]
    generations = [preferences.generation_rows(g, rows) for g in trainer.rollout(ROWS).turns[0].generations]
    before = [agent.lm_head.weight.detach().clone() for agent in trainer.agents]
    window = MetricWindow()
    trainer.preference_step(generations, None, window)
    assert [c.pending for c in trainer.model_optimizers.values()] == [1, 1]
    assert all(torch.equal(agent.lm_head.weight, old) for agent, old in zip(trainer.agents, before))
    assert trainer.state.global_step == 1 and len(trainer.state.history) == 1
    assert trainer.state.history[0]["dpo/pairs"] == 2.0
    trainer.preference_step(generations, None, window, end_of_pass=True)
    assert [c.pending for c in trainer.model_optimizers.values()] == [0, 0]  # the partial window was applied
    assert all(not torch.equal(agent.lm_head.weight, old) for agent, old in zip(trainer.agents, before))
    assert trainer.state.global_step == 2 and "agent_0/grad_norm" in trainer.state.history[1]


def test_a_preference_step_that_fails_is_not_taken_for_a_clean_state(tiny_llama):
    """The update starts at once: a step that raises leaves a state no checkpoint may continue from."""
    trainer = madpo(tiny_llama)
    generations = [preferences.generation_rows(g, [3, 7, 0, 5]) for g in trainer.rollout(ROWS).turns[0].generations]
    wrong = [(torch.zeros(3), torch.zeros(3))] * 2  # three reference terms for two pairs
    with pytest.raises(RuntimeError):
        trainer.preference_step(generations, wrong, MetricWindow())
    assert trainer.recover_after_failure() is False
    assert trainer.state.global_step == 0 and trainer.state.history == []


def test_step_metrics_add_the_rollouts_rewards_and_its_rate(tiny_llama):
    trainer = madpo(tiny_llama)
    rollout = trainer.rollout(ROWS)
    rewards = [torch.tensor([[0.0, 1.0, 1.0, 3.0], [2.0, 0.0, 2.0, 5.0]])]
    started = time.perf_counter() - 5.0  # as if the step began 5 s ago
    values = {"step_started": started, "rollout": rollout, "rewards": rewards,
              "update_metrics": {"dpo/pairs": 4.0}, "timings": {"generation_time": 0.25}}
    metrics = trainer.step_metrics(values)
    assert 5.0 <= metrics["step_time"] <= time.perf_counter() - started
    assert metrics["dpo/pairs"] == 4.0 and metrics["reward_mean"] == pytest.approx(14 / 8)
    assert (metrics["generation_time"], metrics["reward_time"], metrics["update_time"]) == (0.25, 0.0, 0.0)
    tokens = sum(int(g.completion_mask.sum()) for g in rollout.turns[0].generations)
    assert metrics["tokens_per_second"] * metrics["step_time"] == pytest.approx(tokens, rel=1e-9)
    quick = trainer.step_metrics({**values, "step_started": time.perf_counter()})  # a step shorter than a second
    assert quick["tokens_per_second"] * quick["step_time"] == pytest.approx(tokens, rel=1e-9)
    assert trainer.compat_settings()["dpo_reference"] == "initial"
    assert madpo(tiny_llama, dpo_reference="none").compat_settings()["dpo_reference"] == "none"


# ----- the stage loop: counters, records, the output directory --------------------------------------
class StageLog(TrainerCallback):
    """Every stage record a run logs (``pbrl/`` metrics) with its step."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []

    def on_log(self, trainer, metrics, step):
        if any(name.startswith("pbrl/") for name in metrics):
            self.logged.append((step, dict(metrics)))


def same_json(a, b) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # NaN equals NaN this way


def test_a_run_counts_its_stages_records_each_and_writes_its_history(tiny_llama, tmp_path):
    trainer = build(tiny_llama, num_iterations=2, dpo_batch_size=3, num_train_epochs=2, output_dir=str(tmp_path / "out"))
    log = StageLog()
    trainer.callbacks.append(log)
    assert (trainer.num_iterations, trainer.total_boundaries(), trainer.steps_left()) == (2, 6, 0)
    assert MADPOIterTrainer.planned_boundaries(trainer.args) == 6
    assert PreferenceRounds.iterations_of(trainer.args) == 1  # a trainer that is not iterative makes one
    trainer.train()
    names = ["collect_preferences", "prepare_pairs", "learn_policy"]
    records = trainer.state.stage_records
    assert [(r["iteration"], r["stage"]) for r in records] == [(i, name) for i in range(2) for name in names]
    # every stage is one boundary; the run ends at the next iteration's start
    assert (trainer.state.iteration, trainer.state.stage, trainer.state.boundaries) == (2, 0, 6)
    # each stage record is logged once, as pbrl/ metrics at its boundary's number, and is a line of history.jsonl
    assert [step for step, _ in log.logged] == [1, 2, 3, 4, 5, 6]
    for (step, metrics), record in zip(log.logged, records):
        expected = {f"pbrl/{k}": v for k, v in record.items() if k not in ("iteration", "stage")}
        assert same_json(metrics, expected)
    lines = (tmp_path / "out" / "history.jsonl").read_text().splitlines()
    assert len(lines) == 6 and all(same_json(json.loads(line), record) for line, record in zip(lines, records))
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"iteration_0", "iteration_1", "history.jsonl"}
    # each policy stage ran all of its micro-batches: two epochs of ceil(pairs / 3), and the run's step is the policy's
    steps = 0
    for prepared, learned in zip(records[1::3], records[2::3]):
        per_epoch = -(-int(prepared["replay/pairs"]) // 3)
        assert learned["policy/steps"] == 2 * per_epoch and per_epoch > 0
        steps += 2 * per_epoch
    assert trainer.state.global_step == trainer.policy_trainer.state.global_step == steps


def test_stages_run_one_by_one_and_a_new_iteration_starts_at_the_next_call(tiny_llama, caplog):
    trainer = build(tiny_llama, num_iterations=2)
    assert trainer.output_path is None
    trainer.state.stage_step = 4  # a mid-stage count is cleared when any stage ends
    with caplog.at_level(logging.INFO, logger="comlrl.trainers.preference.rounds"):
        metrics = trainer.run_next_stage()
    assert [r.getMessage() for r in caplog.records if r.name == "comlrl.trainers.preference.rounds"] == \
        [f"iteration 0, collect_preferences: {metrics}"]
    assert (trainer.state.iteration, trainer.state.stage, trainer.state.stage_step, trainer.state.boundaries) == \
        (0, 1, 0, 1)
    trainer.run_next_stage()
    trainer.close_boundary()
    assert (trainer.state.iteration, trainer.state.stage, trainer.state.boundaries) == (0, 3, 3)
    assert trainer.state.global_step == trainer.policy_trainer.state.global_step > 0
    trainer.run_next_stage()
    assert (trainer.state.iteration, trainer.state.stage, trainer.state.boundaries) == (1, 1, 4)
    assert [r["iteration"] for r in trainer.state.stage_records] == [0, 0, 0, 1]
    with pytest.raises(RuntimeError) as info:
        trainer.take_step(None)
    assert str(info.value) == ("MADPOIterTrainer's boundaries are stages without separate steps; use close_boundary()")


class FailOnce:
    """The letters reward, raising at its first call (a reward server's outage)."""

    def __init__(self) -> None:
        self.failed = False

    def __call__(self, completions_0, completions_1, batch_items=None):
        if not self.failed:
            self.failed = True
            raise ConnectionError("the reward server is down")
        return letters_reward(completions_0, completions_1, batch_items)


def test_a_failed_collection_is_repeated_from_its_start(tiny_llama):
    """A repeatable stage that fails puts the RNGs back: run again, it collects what a run without the failure
    collects."""
    straight = build(tiny_llama)
    straight.run_next_stage()
    failing = MADPOIterTrainer(agent_model=tiny_llama, reward_func=FailOnce(),
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                               args=MADPOIterConfig(**TINY))
    with pytest.raises(RewardCallError, match="raised ConnectionError: the reward server is down"):
        failing.run_next_stage()
    assert failing.recover_after_failure() is True
    assert (failing.state.stage, failing.state.boundaries) == (0, 0)
    failing.run_next_stage()
    assert failing.pairs_by_iteration[0].to_list() == straight.pairs_by_iteration[0].to_list()


def test_a_stage_restorer_puts_the_rngs_and_the_rewards_counters_back(tiny_llama):
    trainer = build(tiny_llama)
    trainer.task_reward.load_state_dict({"dropped": 2, "per_sample": []})
    restore = trainer.stage_restorer()
    expected = torch.rand(3)
    trainer.task_reward.load_state_dict({"dropped": 7, "per_sample": [0]})
    restore()
    assert torch.equal(torch.rand(3), expected)
    assert trainer.task_reward.state_dict() == {"dropped": 2, "per_sample": []}


def test_the_output_directory_is_never_overwritten(tiny_llama, tmp_path):
    root = tmp_path / "deep" / "out"
    trainer = build(tiny_llama, output_dir=str(root))
    trainer.prepare_output_dir(resuming=False)  # missing: made, with its parents
    assert trainer.output_path == root and root.is_dir()
    trainer.prepare_output_dir(resuming=False)  # empty: used as it is
    assert trainer.output_path == root
    (root / "history.jsonl").write_text("")
    with pytest.raises(ValueError) as info:
        trainer.prepare_output_dir(resuming=False)
    assert str(info.value) == (f"MADPOIterConfig.output_dir {str(root)!r} already contains files; give a new "
                               "directory, or resume with train(resume_from_checkpoint=...) to write into a resume-* "
                               "subdirectory")
    trainer.prepare_output_dir(resuming=True)
    assert trainer.output_path == root / "resume-1" and trainer.output_path.is_dir()
    trainer.prepare_output_dir(resuming=True)
    assert trainer.output_path == root / "resume-2" and trainer.output_path.is_dir()
    none = build(tiny_llama)
    none.prepare_output_dir(resuming=True)
    assert none.output_path is None and none._iteration_output() is None


def test_a_run_whose_agents_have_no_room_for_a_prompt_is_refused_before_any_stage(tiny_llama):
    context = AutoConfig.from_pretrained(tiny_llama).max_position_embeddings
    trainer = build(tiny_llama, max_new_tokens=context)
    with pytest.raises(ValueError) as info:
        trainer.train()
    assert str(info.value) == (f"MADPOIterConfig.max_new_tokens={context} leaves no room for a prompt in the "
                               f"{context}-token context of agent 0; lower it")
    assert trainer.state.boundaries == 0 and trainer.pairs_by_iteration == []


def test_a_checkpoint_past_the_runs_iterations_is_refused_in_words(tiny_llama):
    trainer = build(tiny_llama, num_iterations=2)
    trainer.check_resume_progress({"iteration": 2})  # a finished run of the same length resumes
    with pytest.raises(ValueError) as info:
        trainer.check_resume_progress({"iteration": 3})
    assert str(info.value) == ("the checkpoint has completed 3 iterations but num_iterations is 2; num_iterations "
                               "counts the whole run, so raise it")


def test_the_run_shows_its_policy_trainer_read_only(tiny_llama, tiny_llama_b, tmp_path):
    trainer = MADPOIterTrainer(agent_model=tiny_llama, reward_func=letters_reward, args=MADPOIterConfig(**TINY),
                               tokenizer=AutoTokenizer.from_pretrained(tiny_llama),  # one object for both agents
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    policy = trainer.policy_trainer
    for name in ("agents", "tokenizers", "agent_models", "model_name", "device", "agent_sources", "rollout_spec",
                 "dtype", "train_dataset", "eval_dataset", "callbacks", "data_parallel", "history", "evaluations"):
        shown, held = getattr(trainer, name), getattr(policy, name)
        assert shown is held or (isinstance(held, list) and shown == held), name  # agent_models: a new list
    trainer.agents = list(policy.agents)  # the same models: accepted
    trainer.num_agents = 2
    other = AutoModelForCausalLM.from_pretrained(tiny_llama_b)
    with pytest.raises(ValueError, match="^MADPOIterTrainer.agents are the 2 models loaded at construction"):
        trainer.agents = [policy.agents[0], other]
    with pytest.raises(ValueError, match="^MADPOIterTrainer.num_agents is 2, fixed at construction"):
        trainer.num_agents = 3
    assert trainer.planned_training_steps() == policy.planned_training_steps()
    # a user's agent map runs the policy's per-agent work (collection included), with private tokenizers if asked
    mapped = []

    def recording_map(work, devices):
        mapped.append(len(devices))
        return [work(agent) for agent in range(len(devices))]

    assert policy.tokenizers[0] is policy.tokenizers[1]  # one tokenizer for the two agents of one source
    trainer.run_agents_with(recording_map)
    assert policy.tokenizers[0] is policy.tokenizers[1]  # shared unless asked
    trainer.run_agents_with(recording_map, private_tokenizers=True)
    assert policy.tokenizers[0] is not policy.tokenizers[1]
    trainer.run_next_stage()
    assert mapped and set(mapped) == {2}
    assert trainer.checkpoint_modules().keys() == policy.checkpoint_modules().keys() == {"agent_0", "agent_1"}
    out = trainer.save_model(tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(out / "agent_1")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), policy.agents[1].state_dict().values()))


# ----- the preference stage: the reward model's fit and its state -----------------------------------
def marlhf(model: str, reward=letters_reward, **options) -> MARLHFTrainer:
    return MARLHFTrainer(agent_model=model, num_agents=2, reward_func=reward,
                         train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                         args=MARLHFConfig(**{"num_train_epochs": 1, "num_agents": 2, "agent_learning_rate": 1e-2,
                                              "seed": 4, "num_generations": 3, "max_new_tokens": 5, "temperature": 1.0,
                                              "top_p": 1.0, "top_k": None, "reward_model_device": None,
                                              "disable_tqdm": True, "per_device_train_batch_size": 2,
                                              "reward_train_epochs": 2, "reward_batch_size": 2, **options}))


def head_and_backbone(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fresh_reward_model(trainer) -> JointRewardModel:
    """The reward model a fit starts from, loaded here: the first actor's backbone, a head drawn from the seed."""
    torch.manual_seed(trainer.args.seed)
    return JointRewardModel.load(trainer.reward_model_source, torch.device("cpu"), torch.float32,
                                 trainer.args.reward_max_length, False, 2)


def test_each_fit_starts_from_the_seeded_weights_without_touching_the_runs_rng(tiny_llama):
    trainer = marlhf(tiny_llama)
    torch.manual_seed(9)
    loaded = trainer.preference.load_reward_model()
    after = torch.rand(3)
    torch.manual_seed(9)
    assert torch.equal(after, torch.rand(3))
    expected = head_and_backbone(fresh_reward_model(trainer))
    got = head_and_backbone(loaded)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    # the reward model takes the run's precision
    half = marlhf(tiny_llama, precision="bf16").preference.load_reward_model()
    assert {p.dtype for p in half.backbone.parameters()} == {torch.bfloat16}


def test_the_second_fit_is_a_fresh_model_fitted_on_its_iterations_pairs(tiny_llama, tmp_path):
    """Iteration 1's fit, redone here from its parts: a fresh model, the held-out split of whole prompts, the fit
    seeded ``seed + 1``; the run's reward model, its saved copy and its metrics are that fit's."""
    trainer = marlhf(tiny_llama, output_dir=str(tmp_path / "out"), num_train_epochs=2, reward_heldout_fraction=0.25,
                     reward_max_length=20, reward_freeze_backbone=True)  # joint responses cut to 20 tokens
    for _ in range(4):  # iteration 0, then iteration 1's collection
        trainer.run_next_stage()
    pairs = trainer.preference.training_pairs(1)
    assert list(pairs["iteration"]) == [1] * len(pairs) and len(pairs) > 2
    assert preferences.load_pairs(tmp_path / "out" / "iteration_1" / "pairs.parquet").to_list() == pairs.to_list()
    model = fresh_reward_model(trainer)
    train, heldout = preferences.split_heldout(len(pairs), 0.25, 4, groups=list(pairs["row_index"]))
    result = fit_reward_model(model, pairs, train, heldout, 2, 2, trainer.args.reward_learning_rate, 4 + 1,
                              trainer.args.reward_freeze_backbone, trainer.args.reward_early_stopping_patience)
    metrics = trainer.run_next_stage()
    assert same_json(metrics, result.metrics())
    expected, got = head_and_backbone(model), head_and_backbone(trainer.reward_model)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    saved = tmp_path / "out" / "iteration_1" / "reward_model"
    backbone = AutoModelForCausalLM.from_pretrained(saved).state_dict()
    head = torch.load(saved / "value_head.pt", weights_only=True)
    assert all(torch.equal(v, expected[f"backbone.{k}"]) for k, v in backbone.items())
    assert head.keys() and all(torch.equal(v, expected[f"value_head.{k}"]) for k, v in head.items())


def test_a_fit_without_pairs_is_refused_in_words(tiny_llama):
    trainer = marlhf(tiny_llama, reward=lambda completions_0, completions_1: [0.5] * len(completions_0),
                     preference_tie_margin=0.25)
    trainer.run_next_stage()
    assert len(trainer.pairs_by_iteration[0]) == 0
    with pytest.raises(ValueError) as info:
        trainer.run_next_stage()
    assert str(info.value) == ("no preference pairs were collected (every joint sample had the same task reward "
                               "within preference_tie_margin=0.25); raise num_generations or temperature")


class CountingBar:
    """A progress bar that counts the steps it is advanced by."""

    def __init__(self) -> None:
        self.steps = 0

    def update(self, steps: int) -> None:
        self.steps += steps

    def set_postfix(self, **values) -> None:
        pass


def test_the_policy_stage_advances_the_progress_bar_the_run_was_given(tiny_llama):
    trainer = marlhf(tiny_llama)
    bar = CountingBar()
    trainer.watch_stop(StopRequest(), bar)
    for _ in range(3):
        trainer.run_next_stage()
    assert bar.steps == trainer.policy_trainer.state.global_step > 0


def pair_records(iteration: int, count: int) -> list[dict]:
    return [{"iteration": iteration, "row_index": i, "chosen_reward": 1.0, "rejected_reward": 0.0}
            for i in range(count)]


def test_the_stages_state_round_trips_its_pairs_and_reward_model(tiny_llama):
    trainer = marlhf(tiny_llama)
    empty = trainer.preference.state_dict()
    assert empty["reward_model"] is None and empty["collection"]["pairs"] == []
    trainer.run_next_stage()
    trainer.run_next_stage()
    state = trainer.preference.state_dict()
    fitted = head_and_backbone(trainer.reward_model)
    assert state["reward_model"].keys() == fitted.keys()
    assert all(torch.equal(state["reward_model"][k], fitted[k]) and state["reward_model"][k].device.type == "cpu"
               for k in fitted)
    other = marlhf(tiny_llama)
    other.preference.load_state_dict(state)
    assert other.pairs_by_iteration[0].to_list() == trainer.pairs_by_iteration[0].to_list()
    loaded = head_and_backbone(other.reward_model)
    assert all(torch.equal(loaded[k], fitted[k]) for k in fitted)
    other.preference.load_state_dict(empty)  # a state saved before the first fit has no reward model
    assert other.reward_model is None and other.pairs_by_iteration == []


def test_pooled_pairs_replay_every_shard_and_the_candidates_per_prompt(tiny_llama):
    shards = {"collection": {"pairs": [pair_records(0, 2), pair_records(1, 3)], "comparator": {}}, "reward_model": None}
    pooled = marlhf(tiny_llama, pool_preference_pairs=True)
    pooled.preference.load_state_dict(shards)
    assert list(pooled.preference.training_pairs(1)["iteration"]) == [0, 0, 1, 1, 1]
    plain = marlhf(tiny_llama)
    plain.preference.load_state_dict(shards)
    assert list(plain.preference.training_pairs(1)["iteration"]) == [1, 1, 1]
    # preference_num_generations candidates per prompt for the pairs (num_generations otherwise)
    assert marlhf(tiny_llama, preference_num_generations=5).run_next_stage()["distribution/policy_reward_count"] == 20
    assert plain.run_next_stage()["distribution/policy_reward_count"] == 12
