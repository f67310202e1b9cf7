"""IACTrainer and MAACTrainer end to end on tiny local models: the guide's examples, every
entity rule, learning, save/continue with value heads, and bit-exact resume."""

import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.algorithms.advantages import td_targets
from comlrl.training.policy_update import backpropagate, policy_losses
from comlrl.rollout.generation import SamplingParams, generate_completions
from comlrl.tasks.letters import letters_reward, rows
from comlrl.trainers import IACConfig as ReexportedIAC
from comlrl.trainers import MAACTrainer as ReexportedMAAC
from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl.models.value_heads import sequence_values

FAST = dict(max_new_tokens=8, disable_tqdm=True)


def tokenizers(*paths):
    return [AutoTokenizer.from_pretrained(path) for path in paths]


def snapshot(module):
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def changed(before, module):
    return any(not torch.equal(before[name], tensor) for name, tensor in module.state_dict().items())


def fixed_input(tokenizer):
    encoded = tokenizer(["agent 0 prompt: the cat", "a story about the sun"], return_tensors="pt", padding=True,
                        padding_side="left", add_special_tokens=False)
    return encoded["input_ids"], encoded["attention_mask"]


def test_reexported_from_trainers():
    assert ReexportedIAC is IACConfig and ReexportedMAAC is MAACTrainer


# ----- the guide's examples ------------------------------------------------------------------------
def test_spec_centralized_critic_example(tiny_llama, tiny_gpt2, tiny_llama_b, reward_func, train_dataset):
    # Qwen coder 3B / 1.5B actors and a 7B critic, replaced by heterogeneous tiny models.
    trainer = MAACTrainer(
        agent_model=None,
        agents=[tiny_llama, tiny_gpt2],
        tokenizer=[
            AutoTokenizer.from_pretrained(tiny_llama),
            AutoTokenizer.from_pretrained(tiny_gpt2),
        ],
        critic_model=tiny_llama_b,
        critics=None,
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=MAACConfig(num_train_epochs=1, num_agents=2, num_turns=1, temperature=0.7, top_p=0.9, top_k=None, **FAST),
    )
    assert [len(t) for t in trainer.tokenizers] == [96, 128]
    assert len(trainer.critics) == 1 and type(trainer.critics[0]).__name__ == "LlamaForCausalLM"
    assert trainer.critics[0].value_head.layers[0].in_features == 64
    critic, head, gpt2 = snapshot(trainer.critics[0]), snapshot(trainer.critics[0].value_head), snapshot(trainer.agents[1])
    history = trainer.train()
    assert len(history) == len(train_dataset)
    assert changed(critic, trainer.critics[0]) and changed(head, trainer.critics[0].value_head)
    assert changed(gpt2, trainer.agents[1])
    assert {"critic/value_loss", "critic/value_error", "agent_1/policy_loss", "reward_mean"} <= set(history[-1])


def test_spec_independent_separate_critics_example(tiny_llama, tiny_gpt2, reward_func, train_dataset):
    trainer = IACTrainer(
        agent_model=None,
        agents=[tiny_llama, tiny_gpt2],
        tokenizer=[
            AutoTokenizer.from_pretrained(tiny_llama),
            AutoTokenizer.from_pretrained(tiny_gpt2),
        ],
        critic_model=None,
        critics=[tiny_llama, tiny_gpt2],
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=IACConfig(num_train_epochs=1, 
            num_agents=2,
            num_turns=1,
            use_separate_critic=True,
            temperature=0.7,
            top_p=0.9,
            top_k=None,
            **FAST,
        ),
    )
    assert [type(c).__name__ for c in trainer.critics] == ["LlamaForCausalLM", "GPT2LMHeadModel"]
    assert all(critic is not agent for critic, agent in zip(trainer.critics, trainer.agents))
    assert [len(t) for t in trainer.critic_tokenizers] == [96, 128]  # each critic reads its actor's token IDs
    heads = [snapshot(c.value_head) for c in trainer.critics]
    trainer.train()
    assert all(changed(h, c.value_head) for h, c in zip(heads, trainer.critics))
    assert not hasattr(trainer.agents[0], "value_head")


def test_spec_independent_shared_critic_example(tiny_llama, tiny_gpt2, reward_func, train_dataset):
    trainer = IACTrainer(
        agent_model=None,
        agents=[tiny_llama, tiny_gpt2],
        tokenizer=[
            AutoTokenizer.from_pretrained(tiny_llama),
            AutoTokenizer.from_pretrained(tiny_gpt2),
        ],
        critic_model=None,
        critics=None,
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=IACConfig(num_train_epochs=1, 
            num_agents=2,
            num_turns=1,
            use_separate_critic=False,
            temperature=0.7,
            top_p=0.9,
            top_k=None,
            **FAST,
        ),
    )
    assert trainer.critics == []
    assert [trainer.agents[i].value_head.layers[0].in_features for i in range(2)] == [64, 48]
    # the head trains at the value heads' learning rate, inside the actor's optimizer
    assert [g["lr"] for g in trainer.optimizers[0].param_groups] == [5e-6, 1e-3]
    heads = [snapshot(a.value_head) for a in trainer.agents]
    trainer.train()
    assert all(changed(h, a.value_head) for h, a in zip(heads, trainer.agents))


def test_homogeneous_shortcuts_load_independent_copies(tiny_llama, reward_func, train_dataset):
    trainer = IACTrainer(agent_model=tiny_llama, num_agents=2, critic_model=tiny_llama, reward_func=reward_func,
                         train_dataset=train_dataset, args=IACConfig(num_train_epochs=1, num_agents=2, **FAST))
    models = trainer.agents + trainer.critics
    assert len({id(m) for m in models}) == 4
    assert len({id(p) for m in models for p in m.parameters()}) == sum(len(list(m.parameters())) for m in models)


# ----- entity and config rules ---------------------------------------------------------------------
def test_critic_model_and_critics_must_agree(tiny_llama, tiny_llama_b, reward_func, train_dataset):
    common = dict(agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
                  args=IACConfig(num_train_epochs=1, num_agents=2, **FAST))
    with pytest.raises(ValueError, match=rf"critic_model='{tiny_llama}' does not match critics names .* \(entries \[1\] differ\)"):
        IACTrainer(critic_model=tiny_llama, critics=[tiny_llama, tiny_llama_b], **common)
    with pytest.raises(ValueError, match="critics has 1 entries but the number of models expected is 2; give exactly 2"):
        IACTrainer(critics=[tiny_llama], **common)
    with pytest.raises(ValueError, match="use_separate_critic=True needs the critics: pass critic_model"):
        IACTrainer(**common)


def test_shared_iac_refuses_critic_arguments(tiny_llama, reward_func, train_dataset):
    common = dict(agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
                  args=IACConfig(num_train_epochs=1, num_agents=2, use_separate_critic=False, **FAST))
    with pytest.raises(ValueError, match=r"use_separate_critic=False .* critic_model and critics must stay None; "
                                         rf"got critic_model='{tiny_llama}', critics=None"):
        IACTrainer(critic_model=tiny_llama, **common)
    with pytest.raises(ValueError, match=r"must stay None; got critic_model=None, critics=\["):
        IACTrainer(critics=[tiny_llama, tiny_llama], **common)


def test_maac_needs_exactly_one_critic(tiny_llama, tiny_llama_b, reward_func, train_dataset):
    common = dict(agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
                  args=MAACConfig(num_train_epochs=1, num_agents=2, **FAST))
    with pytest.raises(ValueError, match=r"critics must have exactly one element; got 2: \["):
        MAACTrainer(critics=[tiny_llama, tiny_llama_b], **common)
    with pytest.raises(ValueError, match="MAACTrainer needs a centralised critic"):
        MAACTrainer(**common)
    with pytest.raises(ValueError, match=rf"critic_model='{tiny_llama_b}' does not match critics names"):
        MAACTrainer(critic_model=tiny_llama_b, critics=[tiny_llama], **common)
    # a one-element list is the same as the shortcut
    assert len(MAACTrainer(critics=[tiny_llama_b], **common).critics) == 1


@pytest.mark.parametrize("trainer_class, config_class, critic", [
    (MAACTrainer, MAACConfig, {"critic_model": "x"}), (IACTrainer, IACConfig, {"critics": ["x", "y"]}),
])
def test_explicit_tokenizer_when_agents_given(tiny_llama, reward_func, train_dataset, trainer_class, config_class, critic):
    critic = {key: ([tiny_llama] * 2 if isinstance(value, list) else tiny_llama) for key, value in critic.items()}
    with pytest.raises(ValueError, match=f"{trainer_class.__name__} requires an explicit tokenizer when agents is supplied"):
        trainer_class(agents=[tiny_llama, tiny_llama], reward_func=reward_func, train_dataset=train_dataset,
                      args=config_class(num_agents=2, **FAST), **critic)
    # agent_model loads the tokenizer automatically
    assert trainer_class(agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
                         args=config_class(num_agents=2, **FAST), **critic).tokenizers


def test_agent_model_and_agents_must_agree(tiny_llama, tiny_llama_b, reward_func, train_dataset):
    with pytest.raises(ValueError, match=rf"agent_model='{tiny_llama}' does not match agents names"):
        MAACTrainer(agent_model=tiny_llama, agents=[tiny_llama, tiny_llama_b], tokenizer=tokenizers(tiny_llama)[0],
                    critic_model=tiny_llama, reward_func=reward_func, train_dataset=train_dataset,
                    args=MAACConfig(num_train_epochs=1, num_agents=2, **FAST))
    with pytest.raises(ValueError, match="agents has 3 entries but the number of agents is 2"):
        MAACTrainer(agents=[tiny_llama] * 3, tokenizer=tokenizers(tiny_llama)[0], critic_model=tiny_llama,
                    reward_func=reward_func, train_dataset=train_dataset, args=MAACConfig(num_train_epochs=1, num_agents=2, **FAST))


def test_separate_critic_must_accept_its_actors_token_ids(tiny_llama, tiny_gpt2, reward_func, train_dataset):
    with pytest.raises(ValueError, match="the tokenizer given for critic_1 has 128 tokens but the model .* embeds only 96"):
        IACTrainer(agents=[tiny_llama, tiny_gpt2], tokenizer=tokenizers(tiny_llama, tiny_gpt2),
                   critics=[tiny_llama, tiny_llama], reward_func=reward_func, train_dataset=train_dataset,
                   args=IACConfig(num_train_epochs=1, num_agents=2, **FAST))


def test_maac_critic_reads_the_first_actors_token_ids(tiny_llama, tiny_gpt2, reward_func, train_dataset):
    with pytest.raises(ValueError, match="the tokenizer given for critic_0 has 128 tokens but the model .* embeds only 96"):
        MAACTrainer(agents=[tiny_gpt2, tiny_llama], tokenizer=tokenizers(tiny_gpt2, tiny_llama), critic_model=tiny_llama,
                    reward_func=reward_func, train_dataset=train_dataset, args=MAACConfig(num_train_epochs=1, num_agents=2, **FAST))


@pytest.mark.parametrize("config_class, settings, message", [
    (MAACConfig, dict(num_turns=2, num_generations=2),
     r"MAACConfig.num_generations must be 1 when num_turns > 1 \(got num_generations=2, num_turns=2\)"),
    (IACConfig, dict(critic_type="x"), "IACConfig.critic_type must be one of: 'v', 'q', got 'x'"),
    (IACConfig, dict(value_head_hidden_dim=8), "IACConfig.value_head_hidden_dim=8 sizes the shared actor head, but "
                                               "use_separate_critic=True"),
    (IACConfig, dict(use_separate_critic=False, critic_value_head_hidden_dim=8),
     "IACConfig.critic_value_head_hidden_dim=8 sizes separate critics, but use_separate_critic=False"),
    (IACConfig, dict(use_separate_critic=False, critic_update_epochs=2),
     "IACConfig.critic_update_epochs=2 needs use_separate_critic=True"),
    (MAACConfig, dict(gae_lambda=1.5), "MAACConfig.gae_lambda must be <= 1, got 1.5"),
    (MAACConfig, dict(value_clip_range=0.0), r"MAACConfig.value_clip_range must be > 0 or null \(None\), got 0.0"),
    (MAACConfig, dict(critic_learning_rate=-1.0), r"MAACConfig.critic_learning_rate must be > 0 or null \(None\), got -1.0"),
    (IACConfig, dict(critic_value_head_hidden_dim=0), r"IACConfig.critic_value_head_hidden_dim must be >= 1 or null \(None\), got 0"),
])
def test_config_rules(config_class, settings, message):
    with pytest.raises(ValueError, match=message):
        config_class(**settings)


def test_config_fields_carry_help():
    help_texts = IACConfig.help()
    for name in ("critic_type", "use_separate_critic", "value_head_hidden_dim", "critic_value_head_hidden_dim",
                 "critic_learning_rate", "value_clip_range", "entropy_coef", "gae_lambda", "value_loss_coef"):
        assert help_texts[name], name


def test_maac_model_config_head(tiny_llama, reward_func, train_dataset):
    common = dict(agent_model=tiny_llama, num_agents=2, critic_model=tiny_llama, reward_func=reward_func,
                  train_dataset=train_dataset)
    trainer = MAACTrainer(model_config={"critic_value_head_hidden_dim": 8}, args=MAACConfig(num_train_epochs=1, num_agents=2, **FAST), **common)
    assert [type(m).__name__ for m in trainer.critics[0].value_head.layers] == ["Linear", "GELU", "Linear"]
    with pytest.raises(ValueError, match=r"model_config\['critic_value_head_hidden_dim'\] must be a positive integer or None, got -3"):
        MAACTrainer(model_config={"critic_value_head_hidden_dim": -3}, args=MAACConfig(num_train_epochs=1, num_agents=2, **FAST), **common)
    with pytest.raises(ValueError, match=r"model_config has unknown keys \['critic_value_head_hidden_dim'\]"):
        IACTrainer(agent_model=tiny_llama, num_agents=2, critic_model=tiny_llama, reward_func=reward_func,
                   train_dataset=train_dataset, model_config={"critic_value_head_hidden_dim": 8},
                   args=IACConfig(num_train_epochs=1, num_agents=2, **FAST))


# ----- stages ------------------------------------------------------------------------------------
def test_multi_turn_td_targets_and_stage_shapes(tiny_llama, train_dataset):
    def transition(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
        return [f"revise {agent_completions[i][:4]}" for i in range(num_agents)]

    trainer = MAACTrainer(
        agent_model=tiny_llama, num_agents=2, critic_model=tiny_llama, external_transition=transition,
        reward_func=lambda c0, c1: [float(len(a)) / 10 for a in c0], train_dataset=train_dataset.select(range(4)),
        args=MAACConfig(num_train_epochs=1, num_agents=2, num_turns=2, discount=0.5, per_device_train_batch_size=2, critic_type="v",
                        normalize_advantages=False, **FAST),
    )
    rollout = trainer.rollout([train_dataset[0], train_dataset[1]])
    rewards = trainer.score(rollout)
    inputs = trainer.critic_inputs(rollout)
    assert len(inputs) == 1 and [i.input_ids.shape[0] for i in inputs[0]] == [2, 2]
    # the joint V input holds every agent's (second-turn) prompt, in the first actor's tokens
    decoded = trainer.tokenizers[0].decode(inputs[0][1].input_ids[0], skip_special_tokens=True)
    assert "revise" in decoded and "response" not in decoded
    values = trainer.values(inputs)
    assert values[0].shape == (2, 2)
    estimates = trainer.advantages(rewards, values)
    rewards_matrix = torch.stack([r.reshape(-1) for r in rewards], dim=1)
    assert torch.allclose(estimates.returns[0], td_targets(rewards_matrix, values[0], 0.5), atol=0, rtol=0)
    assert torch.allclose(estimates.advantages[0], estimates.returns[0] - values[0], atol=1e-7, rtol=0)
    history = trainer.train()
    assert "turn_1/reward_mean" in history[-1] and "return_mean" in history[-1]


def test_q_critic_reads_responses_and_uses_the_other_samples_as_baseline(tiny_llama, train_dataset):
    trainer = MAACTrainer(
        agent_model=tiny_llama, num_agents=2, critic_model=tiny_llama, train_dataset=train_dataset.select(range(4)),
        reward_func=lambda c0, c1: [float(len(a)) / 10 for a in c0],
        args=MAACConfig(num_train_epochs=1, num_agents=2, num_generations=2, per_device_train_batch_size=2, critic_type="q",
                        normalize_advantages=False, **FAST),
    )
    rollout = trainer.rollout([train_dataset[0], train_dataset[1]])
    rewards = trainer.score(rollout)
    inputs = trainer.critic_inputs(rollout)
    decoded = trainer.tokenizers[0].decode(inputs[0][0].input_ids[0], skip_special_tokens=True)
    assert "response" in decoded  # the joint Q input holds every agent's prompt and response
    values = [torch.tensor([[0.5], [1.5], [2.0], [3.0]])]  # Q of each joint sample (two prompts x two)
    estimates = trainer.advantages(rewards, values)
    r = rewards[0].reshape(-1)
    other = torch.tensor([1.5, 0.5, 3.0, 2.0])
    assert torch.allclose(estimates.advantages[0][:, 0], r - other)
    assert torch.equal(estimates.returns[0][:, 0], r)
    history = trainer.train()
    assert "critic/value_loss" in history[-1]


def test_stages_can_be_driven_with_another_reward(tiny_llama, reward_func, train_dataset):
    """What a preference trainer does: run the actor-critic stages on its own (learned) reward."""
    trainer = IACTrainer(agent_model=tiny_llama, num_agents=2, critic_model=tiny_llama, reward_func=reward_func,
                         train_dataset=train_dataset, args=IACConfig(num_train_epochs=1, num_agents=2, num_generations=2,
                                                                            normalize_advantages=False, **FAST))
    rollout = trainer.rollout([train_dataset[0]])
    rewards = trainer.score(rollout, reward=lambda c0, c1: [2.0] * len(c0))
    assert torch.equal(rewards[0], torch.full((1, 2), 2.0))
    inputs = trainer.critic_inputs(rollout)
    values = trainer.values(inputs)
    assert torch.equal(values[0], torch.zeros(2, 1))  # new heads predict 0
    estimates = trainer.advantages(rewards, values)
    assert torch.equal(estimates.advantages[1], torch.full((2, 1), 2.0))  # one step: r - V
    heads = snapshot(trainer.critics[0].value_head)
    metrics = trainer.update(rollout, inputs, estimates, values)
    assert changed(heads, trainer.critics[0].value_head) and metrics["critic_0/value_loss"] == 4.0


def test_dropped_rewards_get_no_advantage_and_no_critic_target(tiny_llama, train_dataset):
    trainer = MAACTrainer(
        agent_model=tiny_llama, num_agents=2, critic_model=tiny_llama, train_dataset=train_dataset,
        reward_func=lambda c0, c1: [math.nan] + [1.0] * (len(c0) - 1),
        args=MAACConfig(num_train_epochs=1, num_agents=2, num_generations=2, invalid_reward="drop", normalize_advantages=False,
                        **FAST),
    )
    rollout = trainer.rollout([train_dataset[0]])
    rewards = trainer.score(rollout)
    inputs = trainer.critic_inputs(rollout)
    values = trainer.values(inputs)
    estimates = trainer.advantages(rewards, values)
    assert estimates.advantages[0].tolist() == [[0.0], [1.0]]
    metrics = trainer.update(rollout, inputs, estimates, values)
    assert metrics["critic/value_loss"] == 1.0  # only the kept sample: (1 - 0)^2
    assert all(torch.isfinite(p).all() for p in trainer.critics[0].value_head.parameters())


def test_entropy_bonus_raises_entropy(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    torch.manual_seed(0)
    generation = generate_completions(model, tokenizer, ["the cat", "a dog"], 1, SamplingParams(max_new_tokens=6))

    def entropy():
        from comlrl.algorithms.losses import masked_sequence_mean, token_entropy
        from comlrl.training.logprobs import completion_logits

        with torch.no_grad():
            logits = completion_logits(model, generation.prompt_ids, generation.prompt_mask, generation.completion_ids,
                                       generation.completion_mask)
            return float(masked_sequence_mean(token_entropy(logits), generation.completion_mask).mean())

    before = entropy()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    for _ in range(3):  # zero advantages: only the entropy term has a gradient
        backpropagate(policy_losses(model, [generation], [torch.zeros(2)], 0.2, 1.0, entropy_coef=1.0))
        optimizer.step()
        optimizer.zero_grad()
    assert entropy() > before + 1e-3


# ----- learning ----------------------------------------------------------------------------------
def test_critic_value_error_falls_on_a_fixed_reward(tiny_llama):
    """The reward depends only on the prompt (0 or 1); the critic must learn to predict it."""
    words = "cat dog sun moon tree river hill road".split()
    dataset = Dataset.from_dict({"prompt": [f"write a story about the {w}" for w in words],
                                 "target": [float(i % 2) for i in range(8)]})
    trainer = IACTrainer(
        agent_model=tiny_llama, num_agents=2, critic_model=tiny_llama, train_dataset=dataset,
        reward_func=lambda c0, c1, batch_items: [row["target"] for row in batch_items],
        args=IACConfig(num_agents=2, max_new_tokens=6, agent_learning_rate=1e-6, critic_learning_rate=3e-3,
                       critic_update_epochs=4, num_train_epochs=4, per_device_train_batch_size=4, seed=0,
                       disable_tqdm=True),
    )
    history = trainer.train()
    errors = [step["critic_0/value_error"] for step in history]
    # V starts at 0 (error 0.5); a constant predictor cannot beat 0.5, so falling far below it means learning
    assert errors[0] == pytest.approx(0.5)
    assert sum(errors[-2:]) / 2 < 0.15, f"critic value error did not fall: {[round(e, 3) for e in errors]}"


def test_maac_mean_reward_rises_on_the_letters_task(tiny_llama):
    trainer = MAACTrainer(
        agent_model=tiny_llama, num_agents=2, critic_model=tiny_llama, reward_func=letters_reward,
        train_dataset=Dataset.from_list(rows(8)),
        args=MAACConfig(num_agents=2, num_generations=4, max_new_tokens=12, temperature=1.0, agent_learning_rate=3e-3,
                        critic_learning_rate=1e-3, normalize_advantages=True, num_train_epochs=6,
                        per_device_train_batch_size=2, seed=0, disable_tqdm=True),
    )
    rewards = [step["reward_mean"] for step in trainer.train()]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.05, f"reward did not rise: first steps {first:.3f}, last steps {last:.3f}"


# ----- save_model and continuing ---------------------------------------------------------------------
def test_maac_save_and_the_guides_continue_example(tiny_llama, reward_func, train_dataset, tmp_path, monkeypatch):
    trainer = MAACTrainer(agent_model=tiny_llama, num_agents=2, critic_model=tiny_llama, reward_func=reward_func,
                          train_dataset=train_dataset,
                          args=MAACConfig(num_train_epochs=1, num_agents=2, critic_learning_rate=1e-2, **FAST))
    trainer.train()
    monkeypatch.chdir(tmp_path)
    trainer.save_model("./saved-models/maac-run-1")
    saved = tmp_path / "saved-models" / "maac-run-1"
    assert sorted(p.name for p in saved.iterdir()) == ["agent_0", "agent_1", "critic"]
    for directory in ("agent_0", "agent_1", "critic"):
        assert (saved / directory / "model.safetensors").is_file() and (saved / directory / "tokenizer.json").is_file()
    assert not (saved / "agent_0" / "value_head.pt").exists()
    head_state = torch.load(saved / "critic" / "value_head.pt", weights_only=True)
    assert set(head_state) == {"layers.0.weight", "layers.0.bias"}
    ids, mask = fixed_input(trainer.tokenizers[0])
    with torch.no_grad():
        saved_values = sequence_values(trainer.critics[0], ids, mask)
    assert saved_values.abs().max() > 0  # the head learned something

    # The guide's example, as written (tiny-model speed settings added to the config).
    from pathlib import Path
    import torch as torch_  # noqa: F401  (the example's imports)
    from transformers import AutoTokenizer
    from comlrl.trainers.actor_critic import MAACConfig as Config, MAACTrainer as Trainer

    saved_dir = Path("./saved-models/maac-run-1")
    actor_dirs = [str(saved_dir / f"agent_{i}") for i in range(2)]

    continued_maac = Trainer(
        agents=actor_dirs,
        tokenizer=[AutoTokenizer.from_pretrained(path) for path in actor_dirs],
        critic_model=str(saved_dir / "critic"),
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=Config(num_agents=2, num_turns=1, num_train_epochs=3, **FAST),
    )
    with torch.no_grad():  # before restoring: the backbone is back, the head is new
        assert torch.equal(sequence_values(continued_maac.critics[0], ids, mask), torch.zeros(2))
    continued_maac.critics[0].value_head.load_state_dict(
        torch.load(
            saved_dir / "critic" / "value_head.pt",
            map_location="cpu",
            weights_only=True,
        )
    )
    with torch.no_grad():
        assert torch.equal(sequence_values(continued_maac.critics[0], ids, mask), saved_values)
    history = continued_maac.train()
    continued_maac.save_model("./saved-models/maac-run-2")
    assert len(history) == 3 * len(train_dataset)
    assert (tmp_path / "saved-models/maac-run-2/critic/value_head.pt").is_file()


def test_maac_custom_head_needs_the_same_model_config(tiny_llama, reward_func, train_dataset, tmp_path):
    config = {"critic_value_head_hidden_dim": 8}
    common = dict(num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
                  args=MAACConfig(num_train_epochs=1, num_agents=2, critic_learning_rate=1e-2, **FAST))
    trainer = MAACTrainer(agent_model=tiny_llama, critic_model=tiny_llama, model_config=config, **common)
    trainer.train()
    trainer.save_model(tmp_path)
    state = torch.load(tmp_path / "critic" / "value_head.pt", map_location="cpu", weights_only=True)
    same = MAACTrainer(agent_model=str(tmp_path / "agent_0"), critic_model=str(tmp_path / "critic"), model_config=config,
                       **common)
    same.critics[0].value_head.load_state_dict(state)
    ids, mask = fixed_input(trainer.tokenizers[0])
    with torch.no_grad():
        assert torch.equal(sequence_values(same.critics[0], ids, mask), sequence_values(trainer.critics[0], ids, mask))
    linear = MAACTrainer(agent_model=str(tmp_path / "agent_0"), critic_model=str(tmp_path / "critic"), **common)
    with pytest.raises(RuntimeError, match="value_head|Missing key|Unexpected key"):
        linear.critics[0].value_head.load_state_dict(state)


@pytest.mark.parametrize("separate", [True, False])
def test_iac_save_and_restore_value_heads(tiny_llama, tiny_gpt2, reward_func, train_dataset, tmp_path, separate):
    heads = dict(critic_value_head_hidden_dim=8) if separate else dict(value_head_hidden_dim=8)
    settings = dict(num_agents=2, use_separate_critic=separate, critic_learning_rate=1e-2, num_train_epochs=1, **heads,
                    **FAST)
    critics = dict(critics=[tiny_llama, tiny_gpt2]) if separate else {}
    trainer = IACTrainer(agents=[tiny_llama, tiny_gpt2], tokenizer=tokenizers(tiny_llama, tiny_gpt2),
                         reward_func=reward_func, train_dataset=train_dataset, args=IACConfig(**settings), **critics)
    trainer.train()
    trainer.save_model(tmp_path)
    names = ["critic_0", "critic_1"] if separate else ["agent_0", "agent_1"]
    expected = ["agent_0", "agent_1"] + (names if separate else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == expected
    assert all((tmp_path / name / "value_head.pt").is_file() for name in names)

    actor_dirs = [str(tmp_path / f"agent_{i}") for i in range(2)]
    continued_critics = dict(critics=[str(tmp_path / name) for name in names]) if separate else {}
    continued_iac = IACTrainer(agents=actor_dirs, tokenizer=[AutoTokenizer.from_pretrained(p) for p in actor_dirs],
                               reward_func=reward_func, train_dataset=train_dataset, args=IACConfig(**settings),
                               **continued_critics)
    value_models = continued_iac.critics if separate else continued_iac.agents
    original_models = trainer.critics if separate else trainer.agents
    for i in range(2):
        value_models[i].value_head.load_state_dict(
            torch.load(tmp_path / names[i] / "value_head.pt", map_location="cpu", weights_only=True)
        )
        ids, mask = fixed_input(continued_iac.tokenizers[i])
        with torch.no_grad():
            restored = sequence_values(value_models[i], ids, mask)
            assert restored.abs().max() > 0
            assert torch.equal(restored, sequence_values(original_models[i], ids, mask))
    continued_iac.train()


# ----- training checkpoints ------------------------------------------------------------------------
def build(kind, models, dataset, reward_func, epochs, **config):
    llama, gpt2 = models
    settings = dict(num_agents=2, num_generations=2, max_new_tokens=6, agent_learning_rate=1e-3,
                    critic_learning_rate=1e-2, num_train_epochs=epochs, per_device_train_batch_size=2, seed=7,
                    disable_tqdm=True)
    settings.update(config)
    common = dict(agents=[llama, gpt2], tokenizer=tokenizers(llama, gpt2), reward_func=reward_func, train_dataset=dataset)
    if kind == "maac":
        return MAACTrainer(critic_model=llama, args=MAACConfig(**settings), **common)
    if kind == "iac-separate":
        return IACTrainer(critics=[llama, gpt2], args=IACConfig(**settings), **common)
    return IACTrainer(args=IACConfig(use_separate_critic=False, **settings), **common)


@pytest.mark.parametrize("kind", ["maac", "iac-separate", "iac-shared"])
def test_bit_exact_resume(kind, tiny_llama, tiny_gpt2, train_dataset, reward_func, tmp_path):
    models = (tiny_llama, tiny_gpt2)
    straight = build(kind, models, train_dataset, reward_func, 2)
    history_a = straight.train()

    first_half = build(kind, models, train_dataset, reward_func, 1)
    first_half.train(checkpoint_dir=tmp_path / "ckpt", checkpoint_interval=1)
    del first_half

    resumed = build(kind, models, train_dataset, reward_func, 2)
    history_b = resumed.train(resume_from_checkpoint=tmp_path / "ckpt" / "checkpoint-1",
                              checkpoint_dir=tmp_path / "ckpt", checkpoint_interval=1)
    modules_a, modules_b = straight.checkpoint_modules(), resumed.checkpoint_modules()
    heads = [name for name in modules_a if name.endswith("_value_head")]
    assert len(heads) == (1 if kind == "maac" else 2)
    assert set(modules_a) == set(modules_b)
    for name in modules_a:
        state_a, state_b = modules_a[name].state_dict(), modules_b[name].state_dict()
        for key in state_a:
            assert torch.equal(state_a[key], state_b[key]), f"{name}.{key}"
    for metric in ("reward_mean", heads[0].replace("_value_head", "/value_error")):
        assert [s[metric] for s in history_a] == [s[metric] for s in history_b], metric
    assert set(straight.model_optimizers) == set(resumed.model_optimizers)
    for name, component in straight.model_optimizers.items():
        assert component.steps == resumed.model_optimizers[name].steps > 0, name


def test_incompatible_actor_critic_resumes(tiny_llama, tiny_gpt2, train_dataset, reward_func, tmp_path):
    models = (tiny_llama, tiny_gpt2)
    build("iac-separate", models, train_dataset, reward_func, 1).train(checkpoint_dir=tmp_path)
    checkpoint = tmp_path / "checkpoint-1"
    with pytest.raises(ValueError, match="critic_type is 'q' here but 'v' in the checkpoint"):
        build("iac-separate", models, train_dataset, reward_func, 2, critic_type="q").train(resume_from_checkpoint=checkpoint)
    with pytest.raises(ValueError, match="use_separate_critic is False here but True in the checkpoint"):
        build("iac-shared", models, train_dataset, reward_func, 2).train(resume_from_checkpoint=checkpoint)
    with pytest.raises(ValueError, match="value_head_hidden_dim is 4 here but None in the checkpoint"):
        build("iac-separate", models, train_dataset, reward_func, 2, critic_value_head_hidden_dim=4).train(
            resume_from_checkpoint=checkpoint)
    with pytest.raises(ValueError, match="written by IACTrainer, not MAACTrainer"):
        build("maac", models, train_dataset, reward_func, 2).train(resume_from_checkpoint=checkpoint)
