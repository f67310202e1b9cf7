"""Bounded work outside training: registration, the registered models and the gate's evaluation feed a
model no more of a prompt than training does (``comlrl.rollout.generation``: the last tokens that fit).

A 2,000,000-character first eval row; tiny real models, a temporary MLflow SQLite registry. The work is
measured as the token ids that reach a model's embedding (a torch forward pre-hook on every module),
never as time: a forward of more than :data:`REFUSED_WIDTH` tokens is stopped there, so an unbounded
path fails at once instead of running for minutes.
"""

from __future__ import annotations

import contextlib

import mlflow
import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer

from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from flows import registry
from flows.spec import RunSpec
from letters_spec import letters_spec

MAX_PROMPT_LENGTH = 24
MAX_NEW_TOKENS = 5
CONTEXT = 256  # the tiny Llama's max_position_embeddings
ENDING = " and then the dog ran to the red hill by the river"
REFUSED_WIDTH = 1000


def long_prompt(characters: int) -> str:
    """Tiny-vocabulary words, ``characters`` long, ending in :data:`ENDING` (what a left cut keeps)."""
    filler = "tell me a long story about the green tree and the moon " * (characters // 50 + 1)
    return filler[: characters - len(ENDING)] + ENDING


HUGE = long_prompt(2_000_000)
LONG = long_prompt(50_000)  # served and evaluated: the same rule, a tenth of the tokenizing


def letters_reward(completions_0, completions_1):
    return [float(len(a) + len(b)) for a, b in zip(completions_0, completions_1)]


def make_trainer(model: str, eval_prompts: list[str], max_prompt_length: int | None) -> MAGRPOTrainer:
    args = MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=0,
                        per_device_train_batch_size=2, disable_tqdm=True, max_prompt_length=max_prompt_length)
    return MAGRPOTrainer(agent_model=model, num_agents=2, reward_func=letters_reward, args=args,
                         train_dataset=Dataset.from_dict({"prompt": ["write a story about the cat"] * 2}),
                         eval_dataset=Dataset.from_dict({"prompt": eval_prompts}))


@contextlib.contextmanager
def fed_ids():
    """Every row of token ids an embedding receives while open (prefill and decode steps); a forward wider
    than :data:`REFUSED_WIDTH` is recorded, then refused."""
    seen: list[list[int]] = []

    def record(module, args):
        if not (isinstance(module, torch.nn.Embedding) and args and torch.is_tensor(args[0])):
            return
        ids = args[0].reshape(-1, args[0].shape[-1])
        if ids.shape[-1] > REFUSED_WIDTH:
            seen.append([-1] * ids.shape[-1])  # its width, for widest()
            raise RuntimeError(f"an unbounded prompt of {ids.shape[-1]} tokens reached the model")
        seen.extend(ids.tolist())

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        yield seen
    finally:
        handle.remove()


def widest(seen: list[list[int]]) -> int:
    return max(len(row) for row in seen)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def kept_tail(tokenizer, prompt: str, limit: int) -> list[int]:
    """What training feeds, worked out here with the tokenizer alone: the prompt's last ``limit`` token ids."""
    return tokenizer(prompt, add_special_tokens=False)["input_ids"][-limit:]


@pytest.fixture(scope="module")
def registered(tiny_llama, tmp_path_factory):
    """A finished run's registration (agents, then team) with :data:`HUGE` as the first eval row, and the ids
    its models were fed meanwhile."""
    directory = tmp_path_factory.mktemp("registry")
    trainer = make_trainer(tiny_llama, [HUGE, "tell me about the moon"], MAX_PROMPT_LENGTH)
    spec = RunSpec.model_validate(letters_spec("bounded", max_prompt_length=MAX_PROMPT_LENGTH))
    tracking_uri = f"sqlite:///{directory / 'mlflow.db'}"
    mlflow.set_tracking_uri(tracking_uri)
    experiment = mlflow.create_experiment("bounded", artifact_location=(directory / "artifacts").as_uri())
    with mlflow.start_run(experiment_id=experiment) as run:
        pass
    identity = {"tracking_uri": tracking_uri, "run_id": run.info.run_id}
    with fed_ids() as seen:
        agents = registry.register_agents(identity, trainer, spec, {"comlrl.run_id": "bounded"}, "candidate")
        team = registry.register_team(identity, trainer, spec, {"comlrl.run_id": "bounded"}, "candidate",
                                      directory / "team", agents)
    registry.point_alias(tracking_uri, team, agents, "candidate")  # as the flow does once all are registered
    return {"agents": agents, "team": team, "seen": seen}


def test_the_registered_input_examples_keep_the_last_tokens_training_keeps(registered, tokenizer):
    expected = tokenizer.decode(kept_tail(tokenizer, HUGE, MAX_PROMPT_LENGTH))
    assert ENDING.endswith(expected) and len(expected) < len(ENDING)  # cut in tokens, on the left
    team = mlflow.pyfunc.load_model(registered["team"]["uri"])
    assert team.input_example.to_dict(orient="records") == [{"prompt": expected}, {"prompt": "tell me about the moon"}]
    for entry in registered["agents"]:
        assert mlflow.models.Model.load(entry["uri"]).load_input_example(entry["uri"]) == expected


def test_registering_feeds_the_models_no_more_than_training_does(registered):
    # MLflow ran every model on its example while logging it: each agent's pipeline and the team's rollout.
    assert registered["seen"], "MLflow no longer runs the models on their input examples: nothing was measured"
    assert widest(registered["seen"]) <= MAX_PROMPT_LENGTH


def test_a_registered_model_served_a_huge_prompt_keeps_the_last_tokens_training_keeps(registered, tokenizer):
    expected = kept_tail(tokenizer, LONG, MAX_PROMPT_LENGTH)
    team = mlflow.pyfunc.load_model(registered["team"]["uri"])
    with fed_ids() as seen:
        answers = team.predict([{"prompt": LONG}], params={"max_new_tokens": 2})
    assert list(answers.columns) == ["agent_0", "agent_1"]
    assert [row for row in seen if len(row) > 1] == [expected, expected]  # each agent's prefill: the tail
    for entry in registered["agents"]:
        agent = mlflow.pyfunc.load_model(entry["uri"])
        with fed_ids() as seen:
            agent.predict(LONG, params={"max_new_tokens": 2, "do_sample": False})
        assert [row for row in seen if len(row) > 1] == [expected]


def test_the_gates_evaluation_keeps_the_bound(tiny_llama, tokenizer):
    # The gate scores the champion with trainer.evaluate() (flows/gate.py), the run's own evaluation.
    trainer = make_trainer(tiny_llama, [LONG], MAX_PROMPT_LENGTH)
    with fed_ids() as seen:
        metrics = trainer.evaluate(num_samples=1)
    assert "eval/reward_mean" in metrics
    expected = kept_tail(tokenizer, LONG, MAX_PROMPT_LENGTH)
    assert [row for row in seen if len(row) > 1] == [expected, expected]


def test_without_max_prompt_length_the_bound_is_the_context_left_for_the_completion(tiny_llama, tokenizer):
    trainer = make_trainer(tiny_llama, [LONG], None)
    assert registry.prompt_limits(trainer) == [CONTEXT - MAX_NEW_TOKENS] * 2
    [row] = registry.example_rows(trainer, 1)
    assert row["prompt"] == tokenizer.decode(kept_tail(tokenizer, LONG, CONTEXT - MAX_NEW_TOKENS))
    assert registry.example_rows(make_trainer(tiny_llama, ["tell me about the moon"], None)) == [
        {"prompt": "tell me about the moon"}]  # a prompt that fits is kept as it is
