"""comlrl.team_model: a team of agents saved as plain files, generating jointly as the trainer rolls out.

Tiny real models, a temporary MLflow SQLite registry for the pyfunc round trip. The test against
the real servers (registry load by alias, ``mlflow models serve`` over HTTP) is in
tests/test_pipeline_ux.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from comlrl.rollout.episodes import rollout_episodes
from comlrl.team_model import SETTINGS_FILE, TeamModel, TeamSettings, save_team
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

ROWS = [{"prompt": "write a story about the cat", "passage": "The cat sat."},
        {"prompt": "tell me about the moon", "passage": "The moon rose."}]


def echo_transition(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
    """Turn 2's prompts: each agent sees the other agent's first answer (allowed by the test through
    COMLRL_SPEC_ALLOWED_MODULES)."""
    return [f"{prompt} / {agent_completions[1 - agent]}" for agent in range(num_agents)]


def make_trainer(model: str, train_dataset, reward_func, **config) -> MAGRPOTrainer:
    args = MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=5, temperature=1.0, seed=0,
                        per_device_train_batch_size=2, disable_tqdm=True, **config)
    transition = echo_transition if config.get("num_turns", 1) > 1 else None
    return MAGRPOTrainer(agent_model=model, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
                         external_transition=transition, args=args)


def trainer_completions(trainer: MAGRPOTrainer, rows: list[dict], seed: int) -> list[list[list[str]]]:
    """What the trainer's own rollout samples for ``rows``, one joint sample per row: [turn][agent][row]."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        rollout = rollout_episodes(trainer.agents, trainer.tokenizers, trainer.rollout_spec.replace(num_generations=1),
                                   rows)
    return [rollout.joint_completions(turn) for turn in range(len(rollout.turns))]


def test_the_team_generates_what_the_trainers_rollout_generates(tiny_llama, train_dataset, reward_func, tmp_path):
    trainer = make_trainer(tiny_llama, train_dataset, reward_func)
    settings = TeamSettings.from_rollout(trainer.rollout_spec, 2, trainer.dtype, None, None)
    directory = save_team(trainer, tmp_path / "team", settings)
    assert sorted(p.name for p in directory.iterdir()) == ["agent_0", "agent_1", SETTINGS_FILE]
    assert not list(directory.rglob("*.pkl")) and not list(directory.rglob("*.py"))  # plain files only
    team = TeamModel.load(directory, device="cpu")
    answers = team.generate(ROWS, seed=3)
    expected = trainer_completions(trainer, ROWS, seed=3)[-1]
    assert answers == [{"agent_0": expected[0][row], "agent_1": expected[1][row]} for row in range(len(ROWS))]
    assert team.generate(ROWS, seed=3) == answers  # the seed decides
    greedy = team.predict([{"prompt": ROWS[0]["prompt"]}], params={"do_sample": False, "max_new_tokens": 3})
    assert list(greedy.columns) == ["agent_0", "agent_1"] and len(greedy) == 1


def test_a_multi_turn_team_chains_its_turns_through_the_transition(tiny_llama, train_dataset, reward_func, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setenv("COMLRL_SPEC_ALLOWED_MODULES", __name__)
    trainer = make_trainer(tiny_llama, train_dataset, reward_func, num_turns=2)
    formatters = ["comlrl.tasks.writing:summary_prompt", "comlrl.tasks.writing:expansion_prompt"]
    from comlrl.tasks import writing

    trainer.rollout_spec = trainer.rollout_spec.replace(formatters=(writing.summary_prompt, writing.expansion_prompt))
    settings = TeamSettings.from_rollout(trainer.rollout_spec, 2, trainer.dtype, formatters,
                                         f"{__name__}:echo_transition")
    team = TeamModel.load(save_team(trainer, tmp_path / "team", settings), device="cpu")
    answers = team.generate(ROWS, seed=5)
    expected = trainer_completions(trainer, ROWS, seed=5)
    assert set(answers[0]) == {"agent_0", "agent_1", "agent_0_turn_1", "agent_0_turn_2", "agent_1_turn_1",
                               "agent_1_turn_2"}
    for row, answer in enumerate(answers):
        for agent in range(2):
            assert answer[f"agent_{agent}_turn_1"] == expected[0][agent][row]
            assert answer[f"agent_{agent}_turn_2"] == answer[f"agent_{agent}"] == expected[1][agent][row]


def test_a_team_model_names_code_only_through_the_allow_list(tiny_llama, train_dataset, reward_func, tmp_path):
    trainer = make_trainer(tiny_llama, train_dataset, reward_func)
    settings = TeamSettings.from_rollout(trainer.rollout_spec, 2, trainer.dtype, None, None)
    directory = save_team(trainer, tmp_path / "team", settings)
    data = json.loads((directory / SETTINGS_FILE).read_text())
    (directory / SETTINGS_FILE).write_text(json.dumps({**data, "formatters": ["os:system", "os:system"]}))
    with pytest.raises(ValueError, match="'os:system' is refused|module 'os'"):
        TeamModel.load(directory, device="cpu")
    (directory / SETTINGS_FILE).write_text(json.dumps({**data, "format": "something-else/1"}))
    with pytest.raises(ValueError, match="not a team model settings file"):
        TeamModel.load(directory, device="cpu")
    with pytest.raises(ValueError, match="no 'prompt'"):
        from comlrl.team_model import input_rows

        input_rows([{"text": "no prompt here"}])


def test_the_pyfunc_loads_through_the_comlrl_loader_module_with_its_signature(tiny_llama, train_dataset, reward_func,
                                                                              tmp_path):
    import mlflow
    import pandas

    from comlrl.team_model import log_team_model

    trainer = make_trainer(tiny_llama, train_dataset, reward_func)
    settings = TeamSettings.from_rollout(trainer.rollout_spec, 2, trainer.dtype, None, None)
    directory = save_team(trainer, tmp_path / "team", settings)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = mlflow.create_experiment("team", artifact_location=(tmp_path / "artifacts").as_uri())
    with mlflow.start_run(experiment_id=experiment):
        info = log_team_model(directory, settings, [ROWS[0]["prompt"]])
    assert info.flavors["python_function"]["loader_module"] == "comlrl.team_model"
    assert "python_model" not in info.flavors["python_function"]  # nothing cloudpickled
    assert [c.name for c in info.signature.inputs.inputs] == ["prompt"]
    assert [c.name for c in info.signature.outputs.inputs] == ["agent_0", "agent_1"]
    assert {p.name for p in info.signature.params.params} == {"seed", "temperature", "max_new_tokens", "do_sample"}
    assert info.saved_input_example_info is not None
    loaded = mlflow.pyfunc.load_model(info.model_uri)
    frame = loaded.predict(pandas.DataFrame({"prompt": [row["prompt"] for row in ROWS]}), params={"seed": 3})
    direct = TeamModel.load(directory, device="cpu").generate([{"prompt": row["prompt"]} for row in ROWS], seed=3)
    assert frame.to_dict(orient="records") == direct
