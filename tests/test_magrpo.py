"""MAGRPOTrainer end to end on tiny local models."""


import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.callbacks import MetricsRecorder
from comlrl.trainers import MAGRPOConfig as ReexportedConfig
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

FAST = dict(max_new_tokens=8, num_generations=2, disable_tqdm=True)


def test_reexported_from_trainers():
    assert ReexportedConfig is MAGRPOConfig


def test_spec_homogeneous_example(tiny_llama, reward_func, train_dataset):
    # The guide's example with "Qwen/Qwen2.5-1.5B" replaced by a tiny local model directory.
    trainer = MAGRPOTrainer(
        agent_model=tiny_llama,
        agents=None,
        num_agents=3,
        reward_func=lambda c0, c1, c2: [0.0] * len(c0),
        train_dataset=train_dataset,
        args=MAGRPOConfig(num_train_epochs=1, num_agents=3, num_turns=1, temperature=0.7, top_p=0.9, top_k=None, **FAST),
    )
    assert len(trainer.agents) == 3
    history = trainer.train()
    assert len(history) == len(train_dataset) // 2  # two prompts per step at the defaults


def test_spec_heterogeneous_example(tiny_llama, tiny_gpt2, reward_func, train_dataset):
    trainer = MAGRPOTrainer(
        agent_model=None,
        agents=[tiny_llama, tiny_gpt2],
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=MAGRPOConfig(num_train_epochs=1, num_agents=2, num_turns=1, temperature=0.7, top_p=0.9, top_k=None, **FAST),
    )
    assert [len(t) for t in trainer.tokenizers] == [96, 128]  # different vocabularies
    assert type(trainer.agents[0]).__name__ == "LlamaForCausalLM"
    assert type(trainer.agents[1]).__name__ == "GPT2LMHeadModel"
    before = [p.detach().clone() for p in trainer.agents[1].parameters()]
    trainer.train()
    after = list(trainer.agents[1].parameters())
    assert any(not torch.equal(b, a) for b, a in zip(before, after)), "the GPT-2 agent was never updated"


def test_learning_rises_on_a_joint_reward(tiny_llama, reward_func, train_dataset):
    """Agent 0 is paid for 'e', agent 1 for 'o'; the joint reward must clearly rise."""
    recorder = MetricsRecorder()
    trainer = MAGRPOTrainer(
        agent_model=tiny_llama,
        num_agents=2,
        reward_func=reward_func,
        train_dataset=train_dataset,
        callbacks=[recorder],
        args=MAGRPOConfig(
            num_agents=2, num_generations=4, max_new_tokens=12, temperature=1.0, agent_learning_rate=3e-3,
            num_train_epochs=6, per_device_train_batch_size=2, seed=0, disable_tqdm=True,
        ),
    )
    history = trainer.train()
    rewards = [step["reward_mean"] for step in history]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.05, f"reward did not rise: first steps {first:.3f}, last steps {last:.3f}"
    # the callback hook saw every step with the documented metrics
    assert len(recorder.records) == len(history)
    for name in ("reward_mean", "reward_std", "agent_0/loss", "agent_1/completion_length", "step_time", "tokens_per_second"):
        assert name in recorder.records[-1]


def test_save_model_layout_and_continue_from_saved(tiny_llama, reward_func, train_dataset, tmp_path, monkeypatch):
    trainer = MAGRPOTrainer(
        agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
        args=MAGRPOConfig(num_train_epochs=1, num_agents=2, agent_learning_rate=1e-3, **FAST),
    )
    trainer.train()
    monkeypatch.chdir(tmp_path)
    trainer.save_model("./saved-models/run-1")
    for i in range(2):
        agent_dir = tmp_path / "saved-models" / "run-1" / f"agent_{i}"
        assert (agent_dir / "model.safetensors").is_file() and (agent_dir / "config.json").is_file()
        reloaded = AutoModelForCausalLM.from_pretrained(agent_dir)
        assert len(AutoTokenizer.from_pretrained(agent_dir)) == 96
        for saved, trained in zip(reloaded.state_dict().values(), trainer.agents[i].state_dict().values()):
            assert torch.equal(saved, trained)

    # The guide's "Training from Saved Models" example, as written.
    continued_trainer = MAGRPOTrainer(
        agents=[
            "./saved-models/run-1/agent_0",
            "./saved-models/run-1/agent_1",
        ],
        num_agents=2,
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=MAGRPOConfig(
            num_agents=2,
            num_turns=1,
            num_train_epochs=3,
            agent_learning_rate=5e-6,
            temperature=0.7,
            top_p=0.9,
            top_k=None,
            **FAST,
        ),
    )
    start = [p.detach().clone() for p in continued_trainer.agents[0].parameters()]
    assert all(torch.equal(a, b) for a, b in zip(start, trainer.agents[0].parameters()))
    history = continued_trainer.train()
    assert len(history) == 3 * len(train_dataset) // 2  # three epochs of two prompts per step in the new run
    continued_trainer.save_model("./saved-models/run-2")
    assert (tmp_path / "saved-models/run-2/agent_1/model.safetensors").is_file()


def test_multi_turn_uses_the_transition_prompts(tiny_llama, train_dataset):
    calls = []
    second_turn_rows = []

    def transition(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
        calls.append((prompt, list(agent_completions), [list(h) for h in response_history_per_agent]))
        return [f"revise {i}: {agent_completions[i][:5]}" for i in range(num_agents)]

    def reward(c0, c1, batch_items):
        second_turn_rows.append(list(batch_items))
        return [float(len(a) - len(b)) for a, b in zip(c0, c1)]

    trainer = MAGRPOTrainer(
        agent_model=tiny_llama, num_agents=2, reward_func=reward, external_transition=transition,
        train_dataset=train_dataset.select(range(2)),
        args=MAGRPOConfig(num_agents=2, num_turns=2, num_generations=2, max_new_tokens=6, disable_tqdm=True),
    )
    rollout = trainer.rollout([train_dataset[0]])
    second = rollout.turns[1]
    assert second.num_nodes == 2  # aligned: 2 joint samples spawn 2 nodes
    completions = rollout.joint_completions(0)
    for node in range(2):
        for agent in range(2):
            assert second.prompts[agent][node] == f"revise {agent}: {completions[agent][node][:5]}"
            assert second.prompt_history[node][agent][-1] == second.prompts[agent][node]
    assert calls[0][0] == train_dataset[0]["prompt"]
    assert calls[0][2] == [[completions[0][0]], [completions[1][0]]]
    rewards = trainer.score(rollout)
    assert [tuple(r.shape) for r in rewards] == [(1, 2), (2, 2)]
    advantages = trainer.advantages(rewards)
    assert [tuple(a.shape) for a in advantages[0]] == [(2,), (4,)]
    history = trainer.train()
    assert "turn_1/reward_mean" in history[-1] and "return_mean" in history[-1]


def test_cross_mode_scores_every_combination(tiny_llama, train_dataset):
    seen = []

    def reward(c0, c1):
        seen.append(list(zip(c0, c1)))
        return [0.0] * len(c0)

    trainer = MAGRPOTrainer(
        agent_model=tiny_llama, num_agents=2, reward_func=reward, train_dataset=train_dataset,
        args=MAGRPOConfig(num_agents=2, num_generations=3, joint_mode="cross", max_new_tokens=4, disable_tqdm=True),
    )
    rollout = trainer.rollout([train_dataset[0]])
    trainer.score(rollout)
    pairs = seen[-1]
    assert len(pairs) == 9
    a = rollout.turns[0].generations[0].texts
    b = rollout.turns[0].generations[1].texts
    assert pairs == [(a[i], b[j]) for i in range(3) for j in range(3)]


def test_cross_mode_credits_each_completion_with_the_mean_of_its_joint_samples(tiny_llama, train_dataset):
    trainer = MAGRPOTrainer(
        agent_model=tiny_llama, num_agents=2, reward_func=lambda c0, c1: [0.0] * len(c0), train_dataset=train_dataset,
        args=MAGRPOConfig(num_agents=2, num_generations=2, joint_mode="cross", normalize_advantages=False,
                          max_new_tokens=4, disable_tqdm=True),
    )
    # Joint samples (a0, b0), (a0, b1), (a1, b0), (a1, b1) earn 1, 2, 3, 6: mean 3, advantages -2, -1, 0, 3.
    advantages = trainer.advantages([torch.tensor([[1.0, 2.0, 3.0, 6.0]])])
    assert advantages[0][0].tolist() == [-1.5, 1.5]  # a0: (-2 - 1) / 2; a1: (0 + 3) / 2
    assert advantages[1][0].tolist() == [-1.0, 1.0]  # b0: (-2 + 0) / 2; b1: (-1 + 3) / 2


def test_multi_turn_advantages_use_the_discounted_returns(tiny_llama, train_dataset):
    trainer = MAGRPOTrainer(
        agent_model=tiny_llama, num_agents=2, reward_func=lambda c0, c1: [0.0] * len(c0),
        external_transition=lambda prompt, agent_completions, num_agents, **_: ["next"] * num_agents,
        train_dataset=train_dataset,
        args=MAGRPOConfig(num_agents=2, num_turns=2, num_generations=2, discount=0.5, normalize_advantages=False,
                          max_new_tokens=4, disable_tqdm=True),
    )
    # Turn 1: joint samples 0 and 1 earn 1 and 0; each spawns a node of turn 2, earning (2, 4) and (0, 6).
    rewards = [torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 4.0], [0.0, 6.0]])]
    advantages = trainer.advantages(rewards)
    # Returns of turn 1: 1 + 0.5 * mean(2, 4) = 2.5 and 0 + 0.5 * mean(0, 6) = 1.5; mean 2 -> 0.5, -0.5.
    # Turn 2 (the last): its rewards less each node's mean, 3 and 3.
    for agent in range(2):
        assert advantages[agent][0].tolist() == [0.5, -0.5]
        assert advantages[agent][1].tolist() == [-1.0, 1.0, -3.0, 3.0]


def test_formatters_and_missing_fields(tiny_llama, train_dataset):
    def reward(c0, c1):
        return [0.0] * len(c0)

    trainer = MAGRPOTrainer(
        agent_model=tiny_llama, num_agents=2, reward_func=reward, train_dataset=train_dataset,
        formatters=[lambda row: "plan: " + row["prompt"], lambda row: "write: " + row["prompt"]],
        args=MAGRPOConfig(num_train_epochs=1, num_agents=2, **FAST),
    )
    rollout = trainer.rollout([train_dataset[0]])
    assert rollout.turns[0].prompts == [["plan: " + train_dataset[0]["prompt"]], ["write: " + train_dataset[0]["prompt"]]]
    # a formatter that needs a missing field fails at construction, before any model loads
    with pytest.raises(ValueError, match="row 0 has no field 'question' needed by the formatter of agent 0"):
        MAGRPOTrainer(
            agent_model=tiny_llama, num_agents=2, reward_func=reward, train_dataset=train_dataset,
            formatters=lambda row: row["question"], args=MAGRPOConfig(num_train_epochs=1, num_agents=2, **FAST),
        )


def test_evaluate_does_not_disturb_training_randomness(tiny_llama, reward_func, train_dataset):
    def build():
        return MAGRPOTrainer(
            agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
            eval_dataset=train_dataset, args=MAGRPOConfig(num_train_epochs=1, num_agents=2, seed=3, **FAST),
        )

    plain, evaluated = build(), build()
    metrics = evaluated.evaluate()
    assert "eval/reward_mean" in metrics
    assert [s["reward_mean"] for s in plain.train()] == [s["reward_mean"] for s in evaluated.train()]


def test_single_agent_is_grpo(tiny_llama, train_dataset):
    trainer = MAGRPOTrainer(
        agent_model=tiny_llama, num_agents=1, reward_func=lambda c: [len(x) for x in c], train_dataset=train_dataset,
        args=MAGRPOConfig(num_train_epochs=1, num_agents=1, **FAST),
    )
    assert len(trainer.train()) == len(train_dataset) // 2  # two prompts per step at the defaults


def _sequential_map(function, devices):
    """A user-supplied agent map that runs the agents in turn, like the default (a real AgentMap, not a mock)."""
    return [function(index) for index in range(len(devices))]


def test_each_agent_steps_right_after_its_backward_with_the_same_result(tiny_llama):
    """On one device an agent's optimizer steps before the next agent's backward pass, so its gradients are
    freed first (memory); the weights end bit-identical to stepping all agents after all passes."""
    from datasets import Dataset

    from comlrl.tasks.letters import letters_reward, rows

    def build():
        config = MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=6, temperature=1.0, top_p=1.0,
                              top_k=None, agent_learning_rate=1e-3, per_device_train_batch_size=2,
                              num_train_epochs=1, seed=4, disable_tqdm=True)
        return MAGRPOTrainer(agent_model=tiny_llama, args=config, reward_func=letters_reward,
                             train_dataset=Dataset.from_list(rows(4)))

    in_turn = build()
    assert in_turn.agents_run_in_turn()
    held: list[bool] = []  # while agent 1 backpropagates: does agent 0 still hold gradients?
    next(in_turn.agents[1].parameters()).register_hook(
        lambda grad: held.append(any(p.grad is not None for p in in_turn.agents[0].parameters())))
    in_turn.train()
    assert held and not any(held)

    all_then_step = build()
    all_then_step.agent_map = _sequential_map
    assert not all_then_step.agents_run_in_turn()
    held.clear()
    next(all_then_step.agents[1].parameters()).register_hook(
        lambda grad: held.append(any(p.grad is not None for p in all_then_step.agents[0].parameters())))
    all_then_step.train()
    assert held and all(held)  # the other path: agent 0's gradients wait for the joint step
    for a, b in zip(in_turn.agents, all_then_step.agents):
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(x, y), name
