"""The rest of MARLHF above the maths, as a user sees it: a collection's pairs worked out by hand from the task
reward's own calls (widest margin, a seeded random draw, a comparator's side), the constructor's refusals word for
word, the settings a resume compares, the evaluation's two rewards, the policy stage's config and critics, the
centralized collaboration and the tagged adapter, and a failure inside a policy stage continued as an uninterrupted
run (docs/mutation.md, "Above the maths: the rest of MARLHF")."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from comlrl.algorithms.kl import TruncatedSamplingKLWarning
from comlrl.rollout import preferences
from comlrl.rollout.collaboration import CollaborationParseError
from comlrl.rollout.reward_calls import RewardCallError
from comlrl.trainers import IACConfig, MAACConfig, MAGRPOConfig
from comlrl.trainers.actor_critic.iac import IACTrainer
from comlrl.trainers.actor_critic.maac import MAACTrainer
from comlrl.trainers.preference import MARLHFConfig, MARLHFIterConfig, MARLHFIterTrainer, MARLHFTrainer
from comlrl.trainers.preference.centralized import TaggedCentralizedComparatorAdapter
from comlrl.trainers.preference.collaboration import CentralizedCollaboration
from comlrl.trainers.preference.policy import critic_arguments, policy_classes, policy_config
from comlrl.trainers.reinforce.magrpo import MAGRPOTrainer
from comlrl.utils.reward_utils import set_reward_range

PROMPTS = [f"write about the {word}" for word in "cat dog sun moon tree river hill road book word".split()]
FAST = dict(num_agents=2, num_generations=4, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=None,
            reward_model_device=None, disable_tqdm=True, per_device_train_batch_size=2, reward_train_epochs=1,
            reward_learning_rate=1e-4, num_train_epochs=1, seed=5, agent_learning_rate=1e-2, policy_guard=False)


class RecordingReward:
    """A joint reward that depends on both agents' texts and remembers every call: its prompts, texts and values."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[str, str, str, float]]] = []

    @staticmethod
    def value(first: str, second: str) -> float:
        return first.count("e") / max(len(first), 1) + 0.5 * second.count("o") / max(len(second), 1) + 0.01 * len(first)

    def __call__(self, completions_0, completions_1, batch_items=None):
        values = [self.value(a, b) for a, b in zip(completions_0, completions_1)]
        self.calls.append([(item["prompt"], a, b, v) for item, a, b, v in zip(batch_items, completions_0,
                                                                               completions_1, values)])
        return values


def as_float32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def marlhf(model: str, reward, rows: int = len(PROMPTS), cls=MARLHFTrainer, config=MARLHFConfig, **options):
    return cls(agent_model=model, reward_func=reward, train_dataset=Dataset.from_dict({"prompt": PROMPTS[:rows]}),
               args=config(**{**FAST, **options}))


def widest_first(candidates, margin, limit, sides=None):
    """``(chosen, rejected)`` candidate pairs of one prompt by hand: reward above the other's by more than
    ``margin`` (across sides when given), widest margin first, ties by index, at most ``limit``."""
    pairs = [(i, j, candidates[i][2] - candidates[j][2]) for i in range(len(candidates)) for j in range(len(candidates))
             if candidates[i][2] - candidates[j][2] > margin and (sides is None or sides[i] != sides[j])]
    pairs.sort(key=lambda p: (-p[2], p[0], p[1]))
    return [(candidates[i], candidates[j]) for i, j, _ in pairs[:limit]]


def by_prompt(calls):
    """The candidates ``(first, second, reward)`` of each prompt, in the order the calls gave them."""
    grouped: dict[str, list[tuple[str, str, float]]] = {}
    for call in calls:
        for prompt, a, b, value in call:
            grouped.setdefault(prompt, []).append((a, b, as_float32(value)))
    return grouped


def pair_texts(pairs: Dataset, prompt: str):
    return [((c[0], c[1], cr), (r[0], r[1], rr)) for p, c, r, cr, rr in
            zip(pairs["prompt"], pairs["chosen"], pairs["rejected"], pairs["chosen_reward"], pairs["rejected_reward"])
            if p == prompt]


# ----- a collection by hand ------------------------------------------------------------------------
def test_a_collection_is_its_candidates_paired_widest_first_by_hand(tiny_llama, tmp_path):
    """10 prompts in chunks of 8 (batches of 2 are smaller), 3 candidates each (not the policy's 4): the task
    reward's calls are the candidates, and every prompt's pairs are its widest margins above the tie margin."""
    reward = RecordingReward()
    trainer = marlhf(tiny_llama, reward, preference_num_generations=3, max_pairs_per_prompt=2,
                     preference_tie_margin=0.02, output_dir=str(tmp_path / "out"))
    trainer.prepare_output_dir(resuming=False)  # as a run begins
    metrics = trainer.collect_preferences()
    assert [len(call) for call in reward.calls] == [8 * 3, 2 * 3]
    candidates = by_prompt(reward.calls)
    assert list(candidates) == PROMPTS and all(len(c) == 3 for c in candidates.values())
    pairs = trainer.pairs_by_iteration[0]
    expected = {prompt: widest_first(c, 0.02, 2) for prompt, c in candidates.items()}
    for prompt in PROMPTS:
        assert pair_texts(pairs, prompt) == expected[prompt], prompt
    assert len(pairs) == sum(len(p) for p in expected.values()) > 0
    rows = {prompt: index for index, prompt in enumerate(PROMPTS)}
    tokenizer = trainer.tokenizers[0]
    for record in pairs.to_list():
        assert record["row_index"] == rows[record["prompt"]] and record["iteration"] == 0
        assert record["chosen_source"] == record["rejected_source"] == "policy"
        assert record["chosen_reward"] == as_float32(RecordingReward.value(*record["chosen"]))
        for agent in range(2):
            assert tokenizer.decode(record["chosen_ids"][agent], skip_special_tokens=True) == record["chosen"][agent]
            assert tokenizer.decode(record["rejected_ids"][agent], skip_special_tokens=True) == \
                record["rejected"][agent]
    policy_rewards = [v for c in candidates.values() for _, _, v in c]
    assert {k: v for k, v in metrics.items() if k.startswith("preferences/")} == {
        "preferences/pairs": float(len(pairs)), "preferences/prompts": 10.0,
        "preferences/task_reward_mean": pytest.approx(sum(policy_rewards) / 30)}
    assert not any(agent.training for agent in trainer.agents)  # sampled as evaluated: dropout off
    saved = tmp_path / "out" / "iteration_0" / "pairs.parquet"
    assert preferences.load_pairs(saved).to_list() == pairs.to_list()
    assert (tmp_path / "out" / "iteration_0" / "reward_distribution.json").is_file()
    # collected again in the same iteration: the iteration's shard is replaced, not added to
    trainer.collect_preferences()
    assert len(trainer.pairs_by_iteration) == 1
    again = by_prompt(reward.calls[2:])[PROMPTS[0]]
    assert pair_texts(trainer.pairs_by_iteration[0], PROMPTS[0]) == widest_first(again, 0.02, 2)


def test_a_collection_without_an_output_directory_writes_nothing(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = marlhf(tiny_llama, RecordingReward(), rows=2)
    trainer.collect_preferences()
    assert trainer.output_path is None and list(tmp_path.iterdir()) == []


def test_a_random_selection_draws_from_one_number_of_the_runs_rng(tiny_llama):
    """pair_selection='random': one 62-bit number of the run's RNG seeds the draw; each prompt with pairs then
    takes a permutation of its pairs (in index order) from it, in prompt order."""
    reward = RecordingReward()
    trainer = marlhf(tiny_llama, reward, rows=4, pair_selection="random", max_pairs_per_prompt=None,
                     preference_num_generations=4, num_preference_prompts=3)
    start = torch.get_rng_state()
    metrics = trainer.collect_preferences()
    rows = sorted(torch.randperm(4, generator=torch.Generator().manual_seed(5 * 7919 + 0))[:3].tolist())
    assert list(by_prompt(reward.calls)) == [PROMPTS[i] for i in rows] and metrics["preferences/prompts"] == 3.0
    torch.set_rng_state(start)
    generator = torch.Generator().manual_seed(int(torch.randint(2**62, (1,))))
    pairs = trainer.pairs_by_iteration[0]
    drawn = 0
    for prompt, candidates in by_prompt(reward.calls).items():
        ordered = [(i, j) for i in range(4) for j in range(4) if candidates[i][2] - candidates[j][2] > 0]
        expected = []
        if ordered:  # every pair, in the drawn order
            expected = [(candidates[ordered[k][0]], candidates[ordered[k][1]])
                        for k in torch.randperm(len(ordered), generator=generator).tolist()]
            drawn += len(ordered) > 1
        assert pair_texts(pairs, prompt) == expected, prompt
    assert drawn >= 2  # the draw was used more than once


def test_a_comparators_candidates_pair_only_with_the_policys(tiny_llama, tmp_path):
    """The history comparator (iteration 0: the initial policy, loaded at the collection's start and dropped at
    its end) samples 2 candidates per prompt beside the policy's 3; every pair has one of each side, and the
    reported task reward is the policy's alone."""
    reward = RecordingReward()
    trainer = marlhf(tiny_llama, reward, cls=MARLHFIterTrainer, config=MARLHFIterConfig, num_iterations=1,
                     comparator_policy="history", comparator_num_candidates=2, preference_num_generations=3,
                     max_pairs_per_prompt=3, output_dir=str(tmp_path / "out"))  # comparator_reward: the default
    trainer.on_run_begin(resuming=False)
    metrics = trainer.collect_preferences()
    # per chunk of 8 prompts, the policy's candidates, then the comparator's
    assert [len(call) for call in reward.calls] == [8 * 3, 8 * 2, 2 * 3, 2 * 2]
    assert trainer.comparator.loaded_from == [(0, str(tmp_path / "out" / "policies" / "iteration_0000"))]
    assert trainer.comparator.models is None  # freed at the end of the collection
    mine, theirs = by_prompt(reward.calls[0::2]), by_prompt(reward.calls[1::2])
    pairs = trainer.pairs_by_iteration[0]
    for prompt in PROMPTS:
        candidates = mine[prompt] + theirs[prompt]
        sides = [0, 0, 0, 1, 1]
        # the pairs whose comparator-side candidate scored highest first, then widest margin, then by index
        ordered = [(i, j) for i in range(5) for j in range(5)
                   if candidates[i][2] - candidates[j][2] > 0 and sides[i] != sides[j]]
        ordered.sort(key=lambda p: (-candidates[p[0] if sides[p[0]] == 1 else p[1]][2],
                                    -(candidates[p[0]][2] - candidates[p[1]][2]), p[0], p[1]))
        expected = [(candidates[i], candidates[j]) for i, j in ordered[:3]]
        assert pair_texts(pairs, prompt) == expected, prompt
        sources = [(c, r) for p, c, r in zip(pairs["prompt"], pairs["chosen_source"], pairs["rejected_source"])
                   if p == prompt]
        assert sources == [("policy" if chosen in mine[prompt] else "comparator",
                            "policy" if rejected in mine[prompt] else "comparator") for chosen, rejected in expected]
        assert all(pair[0] != pair[1] for pair in sources)
    policy_rewards = [v for c in mine.values() for _, _, v in c]
    assert metrics["preferences/task_reward_mean"] == pytest.approx(sum(policy_rewards) / 30)
    comparator_rewards = [v for c in theirs.values() for _, _, v in c]  # both chunks' comparator candidates
    assert metrics["distribution/comparator_reward_count"] == 20
    assert metrics["distribution/comparator_reward_mean"] == pytest.approx(sum(comparator_rewards) / 20)


def test_the_pairs_an_iteration_trains_on_follow_the_replay_options(tiny_llama):
    """The replay options reach the replay: last_k=1 trains on the iteration's own shard, pooling on every one."""
    trainer = marlhf(tiny_llama, RecordingReward(), rows=2, cls=MARLHFIterTrainer, config=MARLHFIterConfig,
                     num_iterations=2, preference_replay_mode="last_k", preference_replay_k=1)
    shards = [preferences.pairs_dataset([{"iteration": i, "row_index": r, "chosen_reward": 1.0, "rejected_reward": 0.0}
                                         for r in range(3 + i)]) for i in range(2)]
    trainer.preference.collection.pairs_by_iteration = shards
    assert trainer.preference.collection.training_pairs(1).to_list() == shards[1].to_list()
    assert trainer.preference.collection.training_pairs(0).to_list() == shards[0].to_list()
    weighted = marlhf(tiny_llama, RecordingReward(), rows=2, cls=MARLHFIterTrainer, config=MARLHFIterConfig,
                      num_iterations=2, preference_replay_mode="lambda_decay", preference_replay_lambda=0.5,
                      preference_replay_sample_size=5, seed=11)
    weighted.preference.collection.pairs_by_iteration = shards
    drawn = [(r["iteration"], r["row_index"]) for r in weighted.preference.collection.training_pairs(1).to_list()]
    # the draw by hand: seed * 1_000_003 + iteration, a multinomial over the shards' weights (0.5 : 1), then each
    # shard's own permutations, as many as its count needs
    generator = torch.Generator().manual_seed(11 * 1_000_003 + 1)
    counts = torch.bincount(torch.multinomial(torch.tensor([1 / 3, 2 / 3], dtype=torch.float64), 5, replacement=True,
                                              generator=generator), minlength=2).tolist()
    expected = []
    for iteration, count in enumerate(counts):
        rows = []
        while len(rows) < count:
            rows += torch.randperm(3 + iteration, generator=generator).tolist()[:count - len(rows)]
        expected += [(iteration, row) for row in rows]
    assert drawn == expected and len(drawn) == 5


# ----- the constructor ----------------------------------------------------------------------------
def test_a_trainer_without_args_takes_the_configs_defaults(tiny_llama):
    """MARLHFConfig's default reward_model_device is 'cuda:0': on a machine without it the default is what refuses."""
    def build():
        return MARLHFTrainer(agent_model=tiny_llama, reward_func=RecordingReward(),
                             train_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}))

    if torch.cuda.is_available():
        trainer = build()
        assert trainer.args == MARLHFConfig() and trainer.reward_device == torch.device("cuda:0")
        return
    with pytest.raises(ValueError, match=r"^reward_model_device='cuda:0' is not available \("):
        build()


def test_the_constructors_refusals_in_words_and_in_order(tiny_llama, tmp_path):
    dataset = Dataset.from_dict({"prompt": PROMPTS[:4]})
    with pytest.raises(ValueError) as error:
        MARLHFTrainer(agent_model=tiny_llama, reward_func=RecordingReward(), train_dataset=dataset, args=MAGRPOConfig())
    assert str(error.value) == "args must be a MARLHFConfig, got MAGRPOConfig"
    with pytest.raises(ValueError) as error:
        MARLHFTrainer(agent_model=tiny_llama, num_agents=3, reward_func=RecordingReward(), train_dataset=dataset,
                      args=MARLHFConfig(**FAST))
    assert "num_agents=3 (constructor) disagrees with MARLHFConfig.num_agents=2" in str(error.value)
    with pytest.raises(ValueError) as error:  # no agents and no reward: the agents are named first
        MARLHFTrainer(train_dataset=dataset, args=MARLHFConfig(**FAST))
    assert str(error.value) == "Either agent_model or agents must be provided (both are None)"
    with pytest.raises(ValueError) as error:
        MARLHFTrainer(agent_model=tiny_llama, train_dataset=dataset, args=MARLHFConfig(**FAST))
    assert str(error.value).startswith("reward_func must be a callable: MARLHFTrainer needs reward_func")
    # a missing reward-model device is named before any model loads: the agents' directory does not even exist
    with pytest.raises(ValueError) as error:
        MARLHFTrainer(agent_model=str(tmp_path / "no-model"), reward_func=RecordingReward(), train_dataset=dataset,
                      args=MARLHFConfig(**{**FAST, "reward_model_device": "cuda:7"}))
    message = str(error.value)
    assert message.startswith("reward_model_device='cuda:7' is not available (") and message.endswith(
        "); set reward_model_device=None (the trainer's device) or 'cpu', or reward_model_device_fallback=True to "
        "fall back to the trainer's device with a warning")
    # actors given as model objects without an identifier: no reward model source to default to
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl.tiny import tiny_llama_config

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    models = [AutoModelForCausalLM.from_config(tiny_llama_config(tokenizer)) for _ in range(2)]
    with pytest.raises(ValueError) as error:
        MARLHFTrainer(agents=models, tokenizer=tokenizer, reward_func=RecordingReward(), train_dataset=dataset,
                      args=MARLHFConfig(**FAST))
    assert str(error.value) == (
        "MARLHFConfig.reward_model_name is required when the actors are model objects without a model identifier "
        "(agents[0] has no name_or_path); set it to a hub identifier or local directory")
    fallback = marlhf(tiny_llama, RecordingReward(), rows=4, reward_model_device="cuda:7",
                      reward_model_device_fallback=True)  # opted in: the trainer's device, with a warning
    assert fallback.reward_device == fallback.policy_trainer.device
    # the joint budget is checked with the reward model's own tokenizer at construction
    with pytest.raises(ValueError) as error:
        marlhf(tiny_llama, RecordingReward(), rows=4, reward_max_length=2)
    assert str(error.value).startswith("reward_max_length=2 leaves no room for content: the 2 agent tags take ")


def test_what_the_constructor_builds(tiny_llama, tiny_llama_b, tmp_path):
    trainer = MARLHFTrainer(model=tiny_llama, reward_func=RecordingReward(),  # 'model': the older name
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}),
                            args=MARLHFConfig(**{**FAST, "reward_model_device": "cpu", "output_dir": str(tmp_path)}))
    assert isinstance(trainer.args, MARLHFConfig) and trainer.args.seed == 5
    assert trainer.reward_model_source == tiny_llama and trainer.reward_device == torch.device("cpu")
    assert type(trainer.policy_trainer) is MAGRPOTrainer and trainer.policy_trainer.args.disable_tqdm is True
    assert trainer.output_path == Path(str(tmp_path)) and trainer.guard is None and trainer.comparator is None
    assert trainer.state.history is trainer.policy_trainer.history and trainer.state.iteration == 0
    assert trainer.reward_model is None and len(trainer.preference_pairs) == 0
    assert trainer.policy_trainer.evaluator == trainer.evaluate
    # the policy's schedules are planned over every iteration: 3 iterations x 1 epoch x 2 batches of 2 rows
    iterative = marlhf(tiny_llama, RecordingReward(), rows=4, cls=MARLHFIterTrainer, config=MARLHFIterConfig,
                       num_iterations=3, reward_model_name=tiny_llama_b, comparator_policy="history",
                       policy_checkpoint_dir=str(tmp_path / "snapshots"))
    assert iterative.planned_training_steps() == iterative.policy_trainer.planned_training_steps() == 6
    assert iterative.reward_model_source == tiny_llama_b
    assert iterative.comparator.kind == "history" and iterative.output_path is None
    assert iterative.reward_device == iterative.policy_trainer.device  # reward_model_device=None
    mixed = MARLHFTrainer(agents=[tiny_llama, tiny_llama_b], reward_func=RecordingReward(),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}), args=MARLHFConfig(**FAST))
    assert mixed.reward_model_source == tiny_llama  # the first actor's
    assert [agent.name_or_path for agent in mixed.agents] == [tiny_llama, tiny_llama_b]


def test_the_settings_a_resume_compares(tiny_llama, tiny_llama_b):
    trainer = marlhf(tiny_llama, RecordingReward(), rows=4)
    assert trainer.compat_settings() == {"num_agents": 2, "tokenizer_sizes": [96, 96], "train_dataset_rows": 4,
                                         "train_batch_size": 2, "gradient_accumulation_steps": 1, "seed": 5,
                                         "rl_algorithm": "magrpo", "reward_model_source": tiny_llama,
                                         "comparator": "current"}
    other = marlhf(tiny_llama, RecordingReward(), rows=4, cls=MARLHFIterTrainer, config=MARLHFIterConfig,
                   num_iterations=1, comparator_policy="model", comparator_model_name=tiny_llama_b,
                   reward_model_name=tiny_llama_b)
    settings = other.compat_settings()
    assert (settings["comparator"], settings["reward_model_source"], settings["rl_algorithm"]) == (
        "model", tiny_llama_b, "magrpo")


def test_the_evaluation_reports_the_task_reward_then_the_learned_one(tiny_llama, tmp_path):
    """Scored by the task reward (its own calls give the mean); once a reward model exists, the learned reward of
    the same samples (the evaluation's fixed seed) beside it."""
    from comlrl.models.reward_model import learned_reward

    reward = RecordingReward()
    trainer = marlhf(tiny_llama, reward, rows=4, output_dir=str(tmp_path))
    trainer.prepare_output_dir(resuming=False)
    evaluation = Dataset.from_dict({"prompt": PROMPTS[4:7]})
    metrics = trainer.evaluate(evaluation, 2)
    (call,) = reward.calls
    prompts = [prompt for prompt, *_ in call]
    assert prompts == [PROMPTS[4]] * (len(call) // 2) + [PROMPTS[5]] * (len(call) // 2)  # the first 2 rows
    assert metrics["eval/task_reward_mean"] == pytest.approx(sum(as_float32(v) for *_, v in call) / len(call))
    assert "eval/reward_mean" not in metrics and "eval/learned_reward_mean" not in metrics
    reward.calls.clear()
    assert trainer.evaluate(evaluation, num_eval_samples=1)["eval/task_reward_mean"] == pytest.approx(
        sum(as_float32(v) for *_, v in reward.calls[0]) / len(reward.calls[0]))
    assert {prompt for prompt, *_ in reward.calls[0]} == {PROMPTS[4]}
    trainer.run_next_stage()  # collect
    trainer.run_next_stage()  # fit
    assert (tmp_path / "iteration_0" / "reward_model").is_dir()  # the fit's copy, in its iteration's folder
    reward.calls.clear()
    metrics = trainer.evaluate(evaluation, 2)
    (call,) = reward.calls
    learned = learned_reward(trainer.reward_model)([a for _, a, _, _ in call], [b for _, _, b, _ in call],
                                                   batch_items=[{"prompt": p} for p, *_ in call])
    assert metrics["eval/learned_reward_mean"] == pytest.approx(sum(learned) / len(learned), rel=1e-5)
    assert metrics["eval/task_reward_mean"] == pytest.approx(sum(as_float32(v) for *_, v in call) / len(call))


# ----- the policy stage's trainer -------------------------------------------------------------------
def test_the_policy_config_copies_the_shared_fields_and_only_the_users_choices_count():
    args = MARLHFConfig(num_generations=3, per_device_train_batch_size=2, policy_overrides={"logging_steps": 3})
    config = policy_config(args, MAGRPOConfig)
    assert type(config) is MAGRPOConfig
    assert (config.num_generations, config.per_device_train_batch_size, config.logging_steps) == (3, 2, 3)
    assert config.disable_tqdm is True and config.max_new_tokens == args.max_new_tokens
    assert [config.was_given(name) for name in ("num_generations", "per_device_train_batch_size", "logging_steps",
                                                "max_new_tokens", "disable_tqdm")] == [True, True, True, False, False]
    with pytest.raises(ValueError) as error:
        policy_config(MARLHFConfig(policy_overrides={"zeta_field": 1, "alpha_field": 2}), MAGRPOConfig)
    assert str(error.value) == ("MARLHFConfig.policy_overrides has fields ['alpha_field', 'zeta_field'] that "
                                "MAGRPOConfig does not define")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        truncated = MARLHFConfig(reference_kl_enabled=True, top_k=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = policy_config(truncated, MAGRPOConfig)  # the preference config has warned already
    assert config.top_k == 10 and not [w for w in caught if issubclass(w.category, TruncatedSamplingKLWarning)]
    with warnings.catch_warnings(record=True) as caught:  # and the filter is the caller's again afterwards
        warnings.simplefilter("always")
        MAGRPOConfig(reference_kl_enabled=True, top_k=10)
    assert [w for w in caught if issubclass(w.category, TruncatedSamplingKLWarning)]


def test_the_policy_classes_by_algorithm():
    assert policy_classes("magrpo") == (MAGRPOTrainer, MAGRPOConfig)
    assert policy_classes("maac") == (MAACTrainer, MAACConfig)
    assert policy_classes("iac") == (IACTrainer, IACConfig)


def test_the_critic_arguments_by_algorithm():
    def args(algorithm, name=None):
        return SimpleNamespace(rl_algorithm=algorithm, critic_model_name=name)

    message = ("critic_model, critics and MARLHFConfig.critic_model_name apply only to rl_algorithm 'maac' or 'iac', "
               "not 'magrpo'")
    for given in (dict(critic_model="c"), dict(critics=["c"]), dict(name="c")):
        with pytest.raises(ValueError) as error:
            critic_arguments(args("magrpo", given.get("name")), None, given.get("critic_model"), given.get("critics"),
                             "actor")
        assert str(error.value) == message
    assert critic_arguments(args("magrpo"), None, None, None, "actor") == {}
    assert critic_arguments(args("maac", "named"), None, "given", None, "actor") == {"critic_model": "given",
                                                                                      "critics": None}
    assert critic_arguments(args("iac"), None, None, ["one", "two"], "actor") == {"critic_model": None,
                                                                                 "critics": ["one", "two"]}
    assert critic_arguments(args("maac", "named"), None, None, None, "actor") == {"critic_model": "named"}
    assert critic_arguments(args("maac"), None, None, None, "actor") == {"critic_model": "actor"}
    heads = SimpleNamespace(use_separate_critic=False)
    assert critic_arguments(args("iac", "named"), heads, None, None, "actor") == {}  # the actors carry the heads
    assert critic_arguments(args("maac"), heads, None, None, "actor") == {"critic_model": "actor"}
    assert critic_arguments(args("iac"), SimpleNamespace(), None, None, "actor") == {"critic_model": "actor"}
    with pytest.raises(ValueError) as error:
        critic_arguments(args("iac"), SimpleNamespace(use_separate_critic=True), None, None, None)
    assert str(error.value) == ("rl_algorithm 'maac'/'iac' needs a critic: pass critic_model/critics or set "
                                "MARLHFConfig.critic_model_name (the actors are model objects without an identifier)")


# ----- the centralized collaboration and the tagged adapter ---------------------------------------
class Halves:
    """A 1.4.3 adapter: the roles' prompts joined, a completion split at the item's separator ('||' by default);
    without one, what precedes a '|' is the first role's (read as far as it goes), the rest unreadable."""

    def build_prompt(self, batch_item, agent_prompts):
        return f"task {batch_item['id']}: " + " | ".join(agent_prompts)

    def parse_completion(self, completion, batch_item, num_agents):
        separator = batch_item.get("separator", "||")
        if separator not in completion:
            raise CollaborationParseError("no separator", responses=[completion.split("|")[0], ""])
        return completion.split(separator)


def test_the_centralized_collaboration_scores_each_completion_with_its_item_and_the_first_prompt():
    seen = []

    def reward(prompts, left, right, batch_items=None):
        seen.append((list(prompts), list(left), list(right), list(batch_items)))
        return len(left[0]) + 10 * len(right[0])  # a number, not a list: one joint reward

    set_reward_range(reward, -1, 5)
    formatters = [lambda item: f"first {item['id']}", lambda item: f"second {item['id']}"]
    collaboration = CentralizedCollaboration(Halves(), formatters, reward, 2)
    assert collaboration.reward_range == (-1.0, 5.0) and collaboration.num_roles == 2
    assert collaboration.build_prompt({"id": 4}) == "task 4: first 4 | second 4"
    items = [{"id": 1}, {"id": 2}]
    assert collaboration(["ab||c", "x||yz"], batch_items=items) == [2.0 + 10.0, 1.0 + 20.0]
    assert seen == [(["first 1"], ["ab"], ["c"], [items[0]]), (["first 2"], ["x"], ["yz"], [items[1]])]
    seen.clear()
    assert collaboration(["ab||c", "nothing"], batch_items=[items[1]]) == [12.0, 0.0]  # one item for all
    assert seen[1] == (["first 2"], [""], [""], [items[1]])
    assert collaboration.split("left||right", items[0]) == ["left", "right"]
    assert collaboration.split("left|right", items[0]) == ["", ""]  # unparsed: every role empty, not the part read
    assert collaboration.split("left;right", {"id": 3, "separator": ";"}) == ["left", "right"]
    assert collaboration(["ab;c"], batch_items=[{"id": 3, "separator": ";"}]) == [12.0]
    for completions, batch_items, words in (
            (["a||b"], None, "Centralized task rewards require batch_items: one item, or one per completion"),
            (["a||b"], [], "Centralized task rewards require batch_items: one item, or one per completion"),
            (["a||b", "c||d", "e||f"], items,
             "Centralized completions must align with batch_items: 3 completions, 2 items")):
        with pytest.raises(ValueError) as error:
            collaboration(completions, batch_items=batch_items)
        assert str(error.value) == words
    two = CentralizedCollaboration(Halves(), formatters, lambda shown, left, right: [1.0, 2.0], 2)  # prompts first
    with pytest.raises(ValueError) as error:
        two(["a||b"], batch_items=[items[0]])
    assert str(error.value) == "Centralized task reward must return one joint reward, got 2"


def test_the_centralized_collaboration_splits_evaluations_and_metric_samples():
    collaboration = CentralizedCollaboration(Halves(), None, lambda prompts, a, b: [0.0], 2)
    items = [{"id": 1}, {"id": 2}]
    assert collaboration.split_eval([[["a||b", "c||d"], ["e||f", "bad|x"]]], items) == [
        [["a", "c"], ["e", ""]], [["b", "d"], ["f", ""]]]
    assert collaboration.split_eval([[["a;b"]]], [{"id": 3, "separator": ";"}]) == [[["a"]], [["b"]]]
    for outputs, words in (([[["a||b"]], [["c||d"]]], "2 policies (1 expected) for 2 items"),
                           ([[["a||b"]]], "1 policies (1 expected) for 2 items")):
        with pytest.raises(ValueError) as error:
            collaboration.split_eval(outputs, items)
        assert str(error.value) == f"Centralized evaluation outputs must align with items: {words}"
    items[1]["separator"] = ";"
    samples = [SimpleNamespace(agent_idx=0, completion="a||b", metadata={"batch_item": items[0]}),
               SimpleNamespace(agent_idx=0, completion="c;d", metadata={"batch_item": items[1]})]
    originals = copy.deepcopy(samples)
    seen = collaboration.wrap_metrics_callback(lambda role_samples: role_samples)(samples)
    assert [(s.agent_idx, s.completion) for s in seen] == [(0, "a"), (1, "b"), (0, "c"), (1, "d")]
    assert seen[1].metadata is samples[0].metadata and seen[3].metadata is samples[1].metadata
    assert [(s.agent_idx, s.completion) for s in samples] == [(s.agent_idx, s.completion) for s in originals]


def test_the_tagged_centralized_adapter_in_its_words():
    from comlrl.rollout.collaboration import TaggedCollaboration

    adapter = TaggedCentralizedComparatorAdapter()
    assert adapter.build_prompt({"ignored": True}, ["say cat", "say dog"]) == (
        "Write the separate outputs of 2 agents in one reply: each output answers its agent's original prompt.\n\n"
        "Agent 0 original prompt:\nsay cat\n\nAgent 1 original prompt:\nsay dog\n\n"
        f"{TaggedCollaboration(2).answer_instructions()}\n")
    assert "<agent_2>" in adapter.build_prompt(None, ["a", "b", "c"])
    assert adapter.parse_completion("<agent_1>dog</agent_1><agent_0>cat</agent_0>", None, 2) == ["cat", "dog"]


# ----- a failure inside a policy stage ------------------------------------------------------------
class FailingReward(RecordingReward):
    """Raises once, at its ``fail_at``-th call after being armed (a reward server down for one call)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed_calls: int | None = None
        self.fail_at = 3

    def __call__(self, completions_0, completions_1, batch_items=None):
        if self.armed_calls is not None:
            self.armed_calls += 1
            if self.armed_calls == self.fail_at:
                raise ConnectionError("the reward server is down")
        return super().__call__(completions_0, completions_1, batch_items)


def test_a_failure_inside_the_policy_stage_continues_as_a_run_that_never_failed(tiny_llama):
    """The policy stage is not repeated from its start: after a failed third step the run's RNGs and counters are
    the step's (the policy trainer puts them back), not the stage's, so the stage ends as an uninterrupted one."""
    options = dict(rows=4, num_train_epochs=2)
    straight = marlhf(tiny_llama, RecordingReward(), **options)
    for _ in range(3):
        straight.run_next_stage()
    reward = FailingReward()
    failing = marlhf(tiny_llama, reward, **options)
    failing.run_next_stage()  # collect
    failing.run_next_stage()  # fit
    reward.armed_calls = 0
    with pytest.raises(RewardCallError, match="raised ConnectionError: the reward server is down"):
        failing.run_next_stage()
    assert failing.policy_trainer.state.global_step == 2 and failing.state.stage == 2
    assert failing.recover_after_failure() is True
    failing.run_next_stage()  # the policy stage goes on from its third step
    assert failing.state.global_step == straight.state.global_step == 4
    assert [s["reward_mean"] for s in failing.history] == [s["reward_mean"] for s in straight.history]
    for a, b in zip(straight.agents, failing.agents):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    # every step's monitor is the task reward's mean over that step's samples (its calls after the fit)
    steps = reward.calls[-4:]
    assert [s["monitor/task_reward"] for s in failing.history] == pytest.approx(
        [sum(as_float32(v) for *_, v in call) / len(call) for call in steps])


def server_down(completions_0, completions_1, batch_items=None):
    raise ConnectionError("the reward server is down")


def test_a_stop_request_reaches_the_run_the_policy_and_the_task_reward(tiny_llama):
    """The user's reward labels pairs and judges the policy: a stop request ends its retry wait too."""
    from comlrl.rollout.reward_calls import RewardWaitInterrupted
    from comlrl.training.signals import StopRequest

    trainer = marlhf(tiny_llama, server_down, rows=2, reward_retries=1, reward_retry_backoff=30.0)
    request, progress = StopRequest(), object()
    trainer.watch_stop(request, progress)
    assert trainer.stop_request is request and trainer.policy_trainer.stop_request is request
    assert trainer.policy_trainer.progress is progress
    request.signal_name = "SIGTERM"
    with pytest.raises(RewardWaitInterrupted) as error:
        trainer.task_reward([["a"], ["b"]], [{"prompt": "p"}])
    assert str(error.value) == ("SIGTERM received while waiting for a retry of reward function server_down: the step "
                                "was not finished")


def test_a_collection_is_one_aligned_turn_whatever_the_policy_samples(tiny_llama):
    """A two-turn policy with cross joint samples still collects one turn of aligned candidates: 3 per prompt."""
    reward = RecordingReward()
    trainer = MARLHFTrainer(agent_model=tiny_llama, reward_func=reward, external_transition=go_on,
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}),
                            args=MARLHFConfig(**{**FAST, "num_turns": 2, "joint_mode": "cross",
                                                 "preference_num_generations": 3}))
    trainer.collect_preferences()
    assert [len(call) for call in reward.calls] == [2 * 3]
    assert [prompt for prompt, *_ in reward.calls[0]] == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3


def go_on(prompt, agent_completions, num_agents, **_):
    return [f"more {prompt}" for _ in range(num_agents)]


def test_a_collection_samples_through_the_users_agent_map_and_names_the_datasets_rows(tiny_llama):
    """The policy's agent map runs the collection's generation; a formatter that fails on a prompt of the second
    chunk (row 9 of the dataset, the second of its chunk) names the dataset's row."""
    mapped = []

    def recording_map(work, devices):
        mapped.append(len(devices))
        return [work(agent) for agent in range(len(devices))]

    trainer = marlhf(tiny_llama, RecordingReward(), rows=2)
    trainer.run_agents_with(recording_map)
    trainer.collect_preferences()
    assert mapped and set(mapped) == {2}

    def second_agent(row):
        return row["prompt"] if not row["prompt"].endswith("word") else row["missing"]

    failing = MARLHFTrainer(agent_model=tiny_llama, reward_func=RecordingReward(),
                            formatters=[lambda row: row["prompt"], second_agent],
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS}), args=MARLHFConfig(**FAST))
    with pytest.raises(ValueError) as error:
        failing.collect_preferences()
    assert str(error.value) == ("row 9 has no field 'missing' needed by the formatter of agent 1 "
                                "(fields present: ['prompt'])")


def test_rows_without_a_prompt_field_store_an_empty_prompt(tiny_llama):
    trainer = MARLHFTrainer(agent_model=tiny_llama, reward_func=lambda a, b: [float(len(x)) for x in a],
                            formatters=[lambda row: row["task"]] * 2,
                            train_dataset=Dataset.from_dict({"task": PROMPTS[:2]}), args=MARLHFConfig(**FAST))
    trainer.collect_preferences()
    pairs = trainer.pairs_by_iteration[0]
    assert len(pairs) > 0 and set(pairs["prompt"]) == {""}
    assert [prompts[0] for prompts in pairs["agent_prompts"]] == [PROMPTS[i] for i in pairs["row_index"]]


def test_the_policy_stage_gets_the_critics_given(tiny_llama, tiny_llama_b):
    trainer = MARLHFTrainer(agent_model=tiny_llama, reward_func=RecordingReward(), critics=[tiny_llama_b],
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}),
                            args=MARLHFConfig(**{**FAST, "rl_algorithm": "maac"}))
    assert type(trainer.policy_trainer) is MAACTrainer and trainer.policy_trainer.critic_sources == [tiny_llama_b]


def test_the_reward_model_is_fitted_in_the_runs_precision_and_the_comparator_uses_the_adapter_given(tiny_llama):
    trainer = marlhf(tiny_llama, RecordingReward(), rows=2, precision="bf16")
    trainer.run_next_stage()  # collect
    trainer.run_next_stage()  # fit
    assert torch.bfloat16 in {p.dtype for p in trainer.reward_model.parameters()}  # the backbone (the head: fp32)
    centralized = MARLHFIterTrainer(agent_model=tiny_llama, reward_func=RecordingReward(),
                                    train_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}),
                                    args=MARLHFIterConfig(**{**FAST, "num_iterations": 1,
                                                             "comparator_generation_mode": "centralized"}),
                                    centralized_comparator_adapter=Halves())
    assert centralized.comparator.adapter.build_prompt({"id": 1}, ["a", "b"]) == "task 1: a | b"


def test_an_fsdp_launch_is_refused_in_words_before_any_model_loads(tmp_path, monkeypatch):
    """The joint reward model is not sharded: under an accelerate FSDP launch the trainer refuses at once (the
    agents' directory does not even exist)."""
    for name, value in {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true",
                        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_OFFLOAD_PARAMS": "false",
                        "FSDP_CPU_RAM_EFFICIENT_LOADING": "false"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as error:
        MARLHFIterTrainer(agent_model=str(tmp_path / "no-model"), reward_func=RecordingReward(),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}),
                          args=MARLHFIterConfig(**{**FAST, "lora_rank": 4}))
    assert str(error.value) == (
        "MARLHFIterTrainer cannot shard its models with FSDP: the joint reward model is not sharded yet; launch with "
        "infra/accelerate/multi_gpu.yaml (DDP) instead; or launch with infra/accelerate/multi_gpu.yaml (every "
        "process holds whole agents)")


def test_a_collection_of_one_sample_reports_that_samples_reward(tiny_llama):
    """A policy without a group baseline may sample once per prompt: one prompt, one candidate, no pair, and its
    reward as the mean."""
    reward = RecordingReward()
    trainer = marlhf(tiny_llama, reward, rows=1, advantage_mode="raw", num_generations=1, per_device_train_batch_size=1)
    metrics = trainer.collect_preferences()
    (call,) = reward.calls
    assert len(call) == 1 and metrics["preferences/pairs"] == 0.0
    assert metrics["preferences/task_reward_mean"] == pytest.approx(as_float32(call[0][3]))
