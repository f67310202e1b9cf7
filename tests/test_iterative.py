"""Iterative preference training: replay and reward distributions by hand, the comparators (history snapshots, a
real HTTP endpoint on loopback serving a tiny model), resume, MARLHFIter's options, and learning."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import zlib

import pytest
from loopback_http import JSONEndpoint, Reply
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.callbacks import TrainerCallback
from comlrl.checkpointing.io import latest_checkpoint
from comlrl.errors import TrainingInterrupted
from comlrl.rollout import preferences
from comlrl.rollout.generation import generate_completions
from comlrl.rollout.sampling import SamplingParams
from comlrl.tasks.letters import letters_reward, rows
from comlrl.trainers.preference import (MADPOIterConfig, MADPOIterTrainer, MARLHFIterConfig, MARLHFIterTrainer)
from comlrl.trainers.preference import replay
from comlrl.trainers.preference.comparators import APISettings, ComparatorAPIError, post_json, sampled_ids

PROMPTS = ["write about the cat", "write about the sun", "write about the tree", "write about the road"]
TINY = dict(num_agents=2, num_generations=3, max_new_tokens=5, temperature=1.0, top_p=1.0, top_k=None,
            num_iterations=2, pair_selection="reward_gap", agent_learning_rate=1e-2,
            dpo_batch_size=4, disable_tqdm=True, seed=3, max_pairs_per_prompt=2)


def shard(iteration: int, count: int) -> Dataset:
    return preferences.pairs_dataset([{"iteration": iteration, "row_index": i, "chosen_reward": 1.0,
                                       "rejected_reward": 0.0} for i in range(count)])


def weights(trainer) -> list[dict[str, torch.Tensor]]:
    return [{k: v.detach().clone() for k, v in agent.state_dict().items()} for agent in trainer.agents]


def same_weights(a, b) -> bool:
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


# ----- replay and distributions by hand --------------------------------------------------------
def test_replayed_shards_and_lambda_weights_by_hand():
    assert replay.replayed_shards("none", 3) == [3]
    assert replay.replayed_shards("all", 2) == [0, 1, 2]
    assert replay.replayed_shards("last_k", 3, k=2) == [2, 3]
    assert replay.replayed_shards("last_k", 0, k=2) == [0]
    # lambda 0.5 over 3 shards, oldest first: 0.25, 0.5, 1 normalised by 1.75
    assert replay.lambda_weights(3, 0.5) == pytest.approx([1 / 7, 2 / 7, 4 / 7])
    assert replay.lambda_weights(3, 1.0) == pytest.approx([1 / 3] * 3)
    assert replay.lambda_weights(3, 0.0) == [0.0, 0.0, 1.0]


def test_training_pairs_per_replay_mode():
    shards = [shard(0, 4), shard(1, 2), shard(2, 3)]
    assert replay.training_pairs(shards, 2, "none")["iteration"] == [2, 2, 2]
    assert replay.training_pairs(shards, 2, "all")["iteration"] == [0] * 4 + [1] * 2 + [2] * 3
    assert replay.training_pairs(shards, 2, "last_k", k=2)["iteration"] == [1, 1, 2, 2, 2]
    sampled = replay.training_pairs(shards, 2, "all", sample_size=5, seed=7)
    assert len(sampled) == 5 and sampled.to_list() == replay.training_pairs(shards, 2, "all", sample_size=5,
                                                                             seed=7).to_list()  # seeded
    # lambda 0: only the newest shard; its size is the default sample size
    newest = replay.training_pairs(shards, 2, "lambda_decay", decay=0.0, seed=1)
    assert newest["iteration"] == [2, 2, 2] and sorted(newest["row_index"]) == [0, 1, 2]
    # asking for more than a shard holds cycles through it (every pair once before any twice)
    cycled = replay.training_pairs([shard(0, 2)], 0, "all", sample_size=5, seed=0)
    assert sorted(cycled["row_index"]) == [0, 0, 0, 1, 1]


def test_reward_distribution_by_hand():
    stats = replay.reward_distribution([4.0, 1.0, float("nan"), 3.0, 2.0, float("inf")])
    assert stats == pytest.approx({"count": 4.0, "mean": 2.5, "std": math.sqrt(1.25), "min": 1.0, "q25": 1.75,
                                   "median": 2.5, "q75": 3.25, "max": 4.0})
    assert math.isnan(replay.reward_distribution([])["mean"])


def test_config_translates_the_originals_values_and_validates():
    config = MADPOIterConfig(preference_replay_mode="nearest_k", preference_replay_k=2, comparator_policy="previous",
                             output_dir="/tmp/x", preference_num_candidates=4, preference_pairs_per_sample=2)
    assert (config.preference_replay_mode, config.comparator_policy) == ("last_k", "history")
    assert MARLHFIterConfig(preference_replay_mode="all_history").preference_replay_mode == "all"
    for bad, message in [
        (dict(comparator_policy="history"), "keeps per-iteration policy snapshots on disk: set output_dir"),
        (dict(comparator_policy="api"), "comparator_api_url is required when comparator_policy='api'"),
        (dict(comparator_policy="model"), "comparator_model_name or comparator_agents is required when comparator_policy='model'"),
        (dict(preference_replay_mode="last_k"), "preference_replay_k is required when preference_replay_mode='nearest_k'"),
        (dict(lr_scheduler_type="linear"), "a decaying schedule has no length to plan over"),
        (dict(comparator_policy="api", comparator_api_url="http://127.0.0.1:1/v1", comparator_api_format="generic"),
         "comparator_api_format='generic' is not supported yet"),
    ]:
        with pytest.raises(ValueError, match=message):
            MADPOIterConfig(**bad)
    with pytest.raises(ValueError, match="pool_preference_pairs=True is replay mode 'all'"):
        MARLHFIterConfig(pool_preference_pairs=True, preference_replay_mode="last_k", preference_replay_k=1)


def test_stored_pairs_rebuild_exactly_the_sampled_tokens(tiny_llama):
    """A shard keeps each completion's sampled token IDs; the DPO step's tensors rebuilt from them are the
    sampled ones (prompt encoded as sampling encodes it, EOS included, padding masked)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    prompts = ["write about the cat", "a short note on the moon tree"]
    sampled = generate_completions(model, tokenizer, prompts, 2, SamplingParams(max_new_tokens=6),
                                   generator=torch.Generator().manual_seed(0))
    ids = sampled_ids(sampled)
    rows = [0, 3]  # prompt 0 sample 0 and prompt 1 sample 1, as chosen; their partners as rejected
    rebuilt = preferences.pair_generation(tokenizer, [prompts[0], prompts[1]], [ids[0], ids[3]], [ids[1], ids[2]],
                                          torch.device("cpu"))
    original = preferences.generation_rows(sampled, rows + [1, 2])
    for row in range(4):
        assert rebuilt.completion_ids[row][rebuilt.completion_mask[row].bool()].tolist() == \
            original.completion_ids[row][original.completion_mask[row].bool()].tolist()
        assert rebuilt.prompt_ids[row][rebuilt.prompt_mask[row].bool()].tolist() == \
            original.prompt_ids[row][original.prompt_mask[row].bool()].tolist()


# ----- the trainer -------------------------------------------------------------------------------
def build(model: str, **options) -> MADPOIterTrainer:
    return MADPOIterTrainer(agent_model=model, reward_func=letters_reward,
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                            args=MADPOIterConfig(**{**TINY, **options}))


class StageWatcher(TrainerCallback):
    """Calls ``action(trainer, iteration)`` after each iteration's DPO stage."""

    def __init__(self, action) -> None:
        self.action = action

    def on_log(self, trainer, metrics, step):
        if "pbrl/policy/steps" in metrics:
            self.action(trainer, trainer.state.iteration)


def test_history_comparator_loads_the_right_snapshot_and_last_k_replays(tiny_llama, tmp_path):
    trainer = build(tiny_llama, num_iterations=3, comparator_policy="history", comparator_history_k=1,
                    preference_replay_mode="last_k", preference_replay_k=2, output_dir=str(tmp_path / "out"))
    initial = weights(trainer)
    after_iteration = {}
    trainer.callbacks.append(StageWatcher(lambda t, i: after_iteration.__setitem__(i, weights(t))))
    trainer.train()
    root = tmp_path / "out" / "policies"
    # iteration i compares against the policy at the start of iteration i - 1 (the initial one for i = 0)
    assert trainer.comparator.loaded_from == [(0, str(root / "iteration_0000")), (1, str(root / "iteration_0000")),
                                              (2, str(root / "iteration_0001"))]
    snapshot = [AutoModelForCausalLM.from_pretrained(root / "iteration_0001" / f"agent_{i}") for i in range(2)]
    assert same_weights(after_iteration[0], [m.state_dict() for m in snapshot])
    assert not same_weights(initial, after_iteration[0])  # the policy did move in iteration 0
    first = [AutoModelForCausalLM.from_pretrained(root / "iteration_0000" / f"agent_{i}") for i in range(2)]
    assert same_weights(initial, [m.state_dict() for m in first])
    # every pair has one policy and one comparator candidate; last_k=2 trains on this and the previous shard
    for pairs in trainer.pairs_by_iteration:
        assert all({c, r} == {"policy", "comparator"} for c, r in zip(pairs["chosen_source"], pairs["rejected_source"]))
    prepared = [r for r in trainer.state.stage_records if r["stage"] == "prepare_pairs"]
    sizes = [len(p) for p in trainer.pairs_by_iteration]
    assert [r["replay/pairs"] for r in prepared] == [sizes[0], sizes[0] + sizes[1], sizes[1] + sizes[2]]
    # the shards are Parquet files in the run directory, equal to what the run holds
    for i, pairs in enumerate(trainer.pairs_by_iteration):
        assert preferences.load_pairs(tmp_path / "out" / f"iteration_{i}" / "pairs.parquet").to_list() == pairs.to_list()
    distribution = json.loads((tmp_path / "out" / "iteration_2" / "reward_distribution.json").read_text())
    assert distribution["comparator"]["count"] == len(PROMPTS) * 3 and "median" in distribution["policy"]
    collected = [r for r in trainer.state.stage_records if r["stage"] == "collect_preferences"]
    assert all("distribution/comparator_reward_q75" in r for r in collected)


class StopAt(TrainerCallback):
    """A real SIGTERM after the given step (the trainer finishes the step and checkpoints)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_log(self, trainer, metrics, step):
        if step == self.step and "dpo/loss" in metrics:
            os.kill(os.getpid(), signal.SIGTERM)


def test_resume_mid_dpo_stage_equals_uninterrupted(tiny_llama, tmp_path):
    options = dict(num_iterations=2, num_train_epochs=2, preference_replay_mode="all", pair_selection="random",
                   gradient_accumulation_steps=3)
    straight = build(tiny_llama, **options)
    straight.train()
    interrupted = build(tiny_llama, **options)
    steps_first_iteration = len([s for s in straight.state.history if s["iteration"] == 0])
    interrupted.callbacks.append(StopAt(steps_first_iteration + 1))  # one step into iteration 1's DPO stage
    with pytest.raises(TrainingInterrupted) as info:
        interrupted.train(checkpoint_dir=tmp_path, checkpoint_interval=1)
    assert interrupted.state.stage_step == 1 and interrupted.state.iteration == 1
    resumed = build(tiny_llama, **options)
    resumed.train(resume_from_checkpoint=info.value.checkpoint)
    assert same_weights(weights(straight), weights(resumed))
    assert [s["dpo/loss"] for s in straight.state.history] == [s["dpo/loss"] for s in resumed.state.history]
    assert [r["replay/pairs"] for r in resumed.state.stage_records if r["stage"] == "prepare_pairs"] == \
        [r["replay/pairs"] for r in straight.state.stage_records if r["stage"] == "prepare_pairs"]
    # The stage's record covers its steps before the stop too (issue 42: the record equals an uninterrupted run's).
    policy = [(r["policy/steps"], r["policy/dpo_loss_mean"]) for r in resumed.state.stage_records
              if r["stage"] == "learn_policy"]
    assert policy == [(r["policy/steps"], r["policy/dpo_loss_mean"]) for r in straight.state.stage_records
                      if r["stage"] == "learn_policy"] and len(policy) == 2


# ----- the API comparator against a real local endpoint ------------------------------------------
class CompletionServer(JSONEndpoint):
    """An OpenAI-compatible endpoint on 127.0.0.1 serving a tiny model; ``mode`` makes it fail on purpose.

    Its sampling is seeded by the prompt, so the same request always gets the same completions."""

    def __init__(self, model_dir: str) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.mode = "ok"
        self.requests: list[tuple[str, dict]] = []
        self.served: list[str] = []
        self.start()

    def answer(self, path: str, headers: dict[str, str], body: dict) -> Reply:
        self.requests.append((path, body))
        if self.mode == "error":
            return Reply.json({"error": "the model crashed"}, 500)
        if self.mode == "bad_request":
            return Reply.json({"error": "unknown model"}, 400)
        if self.mode == "fail_once":
            self.mode = "ok"
            return Reply.json({"error": "busy"}, 503)
        chat = path.endswith("/chat/completions")
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        sampling = SamplingParams(temperature=body["temperature"], top_p=body["top_p"],
                                  max_new_tokens=body["max_tokens"])
        generator = torch.Generator().manual_seed(zlib.crc32(prompt.encode()))
        with torch.no_grad():
            texts = generate_completions(self.model, self.tokenizer, [prompt], body["n"], sampling,
                                         generator=generator).texts
        self.served += texts
        choices = [{"index": i, "message": {"role": "assistant", "content": t}} if chat
                   else {"index": i, "text": t} for i, t in enumerate(texts)]
        reply = Reply.json({"object": "chat.completion" if chat else "text_completion", "choices": choices})
        return Reply(reply.status, reply.data, delay=1.5) if self.mode == "slow" else reply


@pytest.fixture(scope="module")
def server(tiny_llama_b):
    serving = CompletionServer(tiny_llama_b)
    yield serving
    serving.close()


@pytest.fixture
def endpoint(server):
    server.mode = "ok"
    server.requests.clear()
    server.served.clear()
    return server


def api_options(url: str, **options) -> dict:
    return {"comparator_policy": "api", "comparator_api_url": url, "comparator_api_model": "tiny-b",
            "comparator_api_retries": 0, "comparator_api_timeout": 30.0, **options}


def test_api_comparator_pairs_and_a_failing_endpoint_loses_nothing(tiny_llama, endpoint, tmp_path):
    options = api_options(endpoint.url, num_iterations=2)
    straight = build(tiny_llama, **options)
    straight.train()
    # one chat request per agent and prompt, every candidate at once (n); the comparator's texts are the server's
    assert len(endpoint.requests) == 2 * 2 * len(PROMPTS)
    path, body = endpoint.requests[0]
    assert path == "/v1/chat/completions" and body["model"] == "tiny-b" and body["n"] == 3 and body["max_tokens"] == 5
    tokenizer = straight.tokenizers[0]
    for pairs in straight.pairs_by_iteration:
        for record in pairs.to_list():
            assert {record["chosen_source"], record["rejected_source"]} == {"policy", "comparator"}
            side = "chosen" if record["chosen_source"] == "comparator" else "rejected"
            assert all(text in endpoint.served for text in record[side])
            assert record[f"{side}_ids"][0] == tokenizer(record[side][0], add_special_tokens=False)["input_ids"]
    # the endpoint fails in iteration 1: a clear error naming it, and the checkpoint of iteration 0 is intact
    failing = build(tiny_llama, **options)
    failing.callbacks.append(StageWatcher(lambda t, i: setattr(endpoint, "mode", "error")))
    message = rf"comparator API {re.escape(endpoint.url)}/chat/completions failed after 1 attempt\(s\): HTTP 500"
    with pytest.raises(ComparatorAPIError, match=message):
        failing.train(checkpoint_dir=tmp_path, checkpoint_interval=1)
    assert latest_checkpoint(tmp_path).name == "checkpoint-3"  # the three stages of iteration 0
    endpoint.mode = "ok"
    resumed = build(tiny_llama, **options)
    resumed.train(resume_from_checkpoint=tmp_path / "checkpoint-3", checkpoint_dir=tmp_path)
    assert same_weights(weights(straight), weights(resumed))


def test_api_timeout_is_a_clear_error_before_the_stage_counts(tiny_llama, endpoint):
    trainer = build(tiny_llama, **api_options(endpoint.url, comparator_api_timeout=0.3))
    endpoint.mode = "slow"
    with pytest.raises(ComparatorAPIError, match=rf"{re.escape(endpoint.url)}/chat/completions failed after 1 "
                                                 r"attempt\(s\): no answer within comparator_api_timeout=0.3 s"):
        trainer.run_next_stage()
    assert trainer.state.boundaries == 0 and trainer.pairs_by_iteration == []


def test_api_retries_transient_failures_only(endpoint):
    config = MADPOIterConfig(**api_options(endpoint.url, comparator_api_format="completions", comparator_api_retries=1,
                                           comparator_api_retry_backoff=0.0))
    settings = APISettings.from_config(config)
    body = {"prompt": "write about the cat", "n": 2, "max_tokens": 3, "temperature": 1.0, "top_p": 1.0}
    endpoint.mode = "fail_once"  # 503, then fine: the retry answers
    answer = post_json(settings, body)
    assert [p for p, _ in endpoint.requests] == ["/v1/completions"] * 2 and len(answer["choices"]) == 2
    endpoint.mode = "bad_request"  # a 400 is not retried
    with pytest.raises(ComparatorAPIError, match="refused the request with HTTP 400"):
        post_json(settings, body)
    assert len(endpoint.requests) == 3


# ----- MARLHFIter takes the same options ------------------------------------------------------------
def test_marlhf_iter_with_a_model_comparator_and_replay(tiny_llama, tiny_llama_b):
    trainer = MARLHFIterTrainer(
        agent_model=tiny_llama, reward_func=letters_reward, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        args=MARLHFIterConfig(num_agents=2, num_generations=3, max_new_tokens=5, temperature=1.0, top_p=1.0,
                              top_k=None, num_train_epochs=1, pair_selection="reward_gap", reward_model_device=None, disable_tqdm=True, per_device_train_batch_size=2,
                              reward_train_epochs=1, num_iterations=2, comparator_policy="model",
                              comparator_model_name=tiny_llama_b, preference_replay_mode="all"))
    trainer.train()
    for pairs in trainer.pairs_by_iteration:
        assert len(pairs) and all({c, r} == {"policy", "comparator"}
                                  for c, r in zip(pairs["chosen_source"], pairs["rejected_source"]))
    # the second fit trained on both iterations' pairs
    assert len(trainer.preference.training_pairs(1)) == sum(len(p) for p in trainer.pairs_by_iteration)
    assert trainer.comparator.sources == [tiny_llama_b] * 2
    assert "distribution/comparator_reward_mean" in trainer.state.stage_records[0]


def test_madpo_iter_learns_letters(tiny_llama):
    """Letters, seed 0: 2 iterations, each collecting 4 pairs for each of 32 prompts (4 candidates, the widest
    margins) and one DPO pass in micro-batches of 8; the held-out reward (8 unseen prompts x 4 samples) rises by
    at least 0.15 (measured: 0.097 -> 0.44)."""
    data = rows(48)
    trainer = MADPOIterTrainer(
        agent_model=tiny_llama, reward_func=letters_reward, train_dataset=Dataset.from_list(data[:32]),
        eval_dataset=Dataset.from_list(data[40:48]),
        args=MADPOIterConfig(num_agents=2, num_generations=4, max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=None,
                             pair_selection="reward_gap", agent_learning_rate=1e-2, num_iterations=2, dpo_batch_size=8, max_pairs_per_prompt=4,
                             eval_num_samples=8, disable_tqdm=True, seed=0))
    before = trainer.evaluate()["eval/reward_mean"]
    trainer.train()
    after = trainer.evaluate()["eval/reward_mean"]
    assert after >= before + 0.15, f"held-out reward {before:.3f} -> {after:.3f}"
