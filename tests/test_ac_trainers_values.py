"""IAC's and MAAC's own parts against values written out here: what each critic reads (IAC: the agent's prompt,
or prompt plus completion; MAAC: the joint text of every agent, in the first actor's tokens, cut to the critic's
context), which critic sources each trainer gets and the exact words of its refusals, the value heads' widths,
the names a checkpoint and a resume check use, and, in two processes (torchrun, gloo), the refusal of early
termination under data parallelism.

The expected side tokenizes and concatenates by hand (the tokenizer's own call, ``torch.cat``), writes the joint
text and every refusal word for word, and never calls comlrl's critic code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl.trainers.actor_critic.critics import joint_text
from test_distributed import ROOT, free_port

PROMPTS = ["the cat", "a dog and the sun", "red road", "one two three"]


def go_on(prompt, agent_completions, num_agents, **_):
    return [f"more {prompt}" for _ in range(num_agents)]


def length_reward(completions_0, completions_1):
    return [float(len(a)) / 10 for a in completions_0]


def settings(**options):
    values = dict(num_agents=2, max_new_tokens=3, temperature=0.8, top_p=1.0, top_k=None, disable_tqdm=True,
                  per_device_train_batch_size=2, num_train_epochs=1, seed=3, normalize_advantages=False)
    values.update(options)
    return values


def common(**options):
    values = dict(num_agents=2, reward_func=length_reward, train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    values.update(options)
    return values


def hand_encode(tokenizer, texts):
    """Left-padded, no special tokens: what a critic's prompt encoding is documented to be."""
    encoded = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    return encoded["input_ids"], encoded["attention_mask"]


# ----- the joint text -----------------------------------------------------------------------------------------
def test_joint_text_lists_every_agents_prompt_and_response_in_order():
    assert joint_text(["p zero", "p one"]) == "agent 0 prompt: p zero\nagent 1 prompt: p one"
    assert joint_text(["p zero", "p one", "p two"], ["r zero", "r one", "r two"]) == (
        "agent 0 prompt: p zero\nagent 0 response: r zero\n"
        "agent 1 prompt: p one\nagent 1 response: r one\n"
        "agent 2 prompt: p two\nagent 2 response: r two")


# ----- what each critic reads ---------------------------------------------------------------------------------
SHAPES = [("v", 1, 2), ("q", 1, 2), ("v", 2, 1)]  # critic type, turns, joint samples per prompt


@pytest.mark.parametrize("critic_type,turns,per_node", SHAPES)
def test_maac_critic_reads_the_joint_text_of_every_sample_in_the_first_actors_tokens(tiny_llama, tiny_gpt2,
                                                                                      critic_type, turns, per_node):
    first, second = AutoTokenizer.from_pretrained(tiny_llama), AutoTokenizer.from_pretrained(tiny_gpt2)
    trainer = MAACTrainer(agents=[tiny_llama, tiny_gpt2], tokenizer=[first, second], critic_model=tiny_llama,
                          external_transition=go_on,
                          args=MAACConfig(**settings(num_turns=turns, num_generations=per_node,
                                                     critic_type=critic_type)),
                          **common())
    rows = [{"prompt": PROMPTS[0]}, {"prompt": PROMPTS[1]}]
    rollout = trainer.rollout(rows)
    inputs = trainer.critic_inputs(rollout)
    assert len(inputs) == 1 and len(inputs[0]) == turns
    for turn, turn_input in zip(rollout.turns, inputs[0]):
        texts = []
        for row in range(2 * per_node):  # two prompts, per_node joint samples of each
            node = row // per_node
            prompts = [turn.prompts[0][node], turn.prompts[1][node]]
            text = f"agent 0 prompt: {prompts[0]}\n"
            if critic_type == "q":
                text += f"agent 0 response: {turn.generations[0].texts[row]}\n"
            text += f"agent 1 prompt: {prompts[1]}"
            if critic_type == "q":
                text += f"\nagent 1 response: {turn.generations[1].texts[row]}"
            texts.append(text)
        ids, mask = hand_encode(first, texts)
        torch.testing.assert_close(turn_input.input_ids, ids, rtol=0, atol=0)
        torch.testing.assert_close(turn_input.attention_mask, mask, rtol=0, atol=0)
    if turns == 2:  # the second turn reads the transition's prompts
        assert rollout.turns[1].prompts[0][0] == f"more {rollout.turns[0].prompts[0][0]}"
    # the critic reads the first actor's tokens for every agent and values every agent's samples
    assert trainer.critic_tokenizers == [first]
    assert trainer.critics[0].value_head.layers[0].in_features == 64


def test_maac_joint_text_longer_than_the_critics_context_keeps_its_last_tokens(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    critic = AutoModelForCausalLM.from_pretrained(tiny_llama)
    critic.config.max_position_embeddings = 12
    trainer = MAACTrainer(agent_model=tiny_llama, critics=[critic], args=MAACConfig(**settings(num_generations=1)),
                          **common())
    rollout = trainer.rollout([{"prompt": "the cat and the dog and the sun and the moon"}])
    inputs = trainer.critic_inputs(rollout)
    texts = [f"agent 0 prompt: {rollout.turns[0].prompts[0][0]}\nagent 1 prompt: {rollout.turns[0].prompts[1][0]}"]
    ids, _ = hand_encode(tokenizer, texts)
    assert ids.shape[1] > 12
    torch.testing.assert_close(inputs[0][0].input_ids, ids[:, -12:], rtol=0, atol=0)
    assert inputs[0][0].attention_mask.tolist() == [[1] * 12]


@pytest.mark.parametrize("critic_type,turns,per_node", SHAPES)
def test_iac_critics_read_their_own_agents_prompt_or_prompt_and_completion(tiny_llama, tiny_gpt2, critic_type,
                                                                           turns, per_node):
    tokenizers = [AutoTokenizer.from_pretrained(tiny_llama), AutoTokenizer.from_pretrained(tiny_gpt2)]
    trainer = IACTrainer(agents=[tiny_llama, tiny_gpt2], tokenizer=tokenizers, critics=[tiny_llama, tiny_gpt2],
                         external_transition=go_on,
                         args=IACConfig(**settings(num_turns=turns, num_generations=per_node,
                                                   critic_type=critic_type)),
                         **common())
    rollout = trainer.rollout([{"prompt": PROMPTS[0]}, {"prompt": PROMPTS[2]}])
    inputs = trainer.critic_inputs(rollout)
    assert len(inputs) == 2 and [len(agent_inputs) for agent_inputs in inputs] == [turns, turns]
    for agent in range(2):
        for turn, turn_input in zip(rollout.turns, inputs[agent]):
            generation = turn.generations[agent]
            # the prompt of each row, encoded by hand with this agent's tokenizer, left-padded
            prompts = [turn.prompts[agent][row // per_node] for row in range(2 * per_node)]
            prompt_ids, prompt_mask = hand_encode(tokenizers[agent], prompts)
            torch.testing.assert_close(generation.prompt_ids, prompt_ids, rtol=0, atol=0)
            if critic_type == "q":
                completion = generation.completion_ids
                expected_ids = torch.cat([prompt_ids, completion], dim=1)
                expected_mask = torch.cat([prompt_mask, generation.completion_mask.long()], dim=1)
            else:
                expected_ids, expected_mask = prompt_ids, prompt_mask
            torch.testing.assert_close(turn_input.input_ids, expected_ids, rtol=0, atol=0)
            torch.testing.assert_close(turn_input.attention_mask, expected_mask, rtol=0, atol=0)
    assert trainer.critic_tokenizers == tokenizers
    assert [c.value_head.layers[0].in_features for c in trainer.critics] == [64, 48]


# ----- the critic sources and their refusals ------------------------------------------------------------------
def refusal(build) -> str:
    with pytest.raises(ValueError) as caught:
        build()
    return str(caught.value)


def test_maac_refuses_anything_but_one_critic_in_these_words(tiny_llama, tiny_llama_b):
    maac = MAACConfig(**settings())
    assert refusal(lambda: MAACTrainer(agent_model=tiny_llama, args=maac, **common())) == (
        "Either critic_model or critics must be provided for MAAC: MAACTrainer needs a centralised critic; pass "
        "critic_model='<model id or directory>' or critics=[<one model>] (both are None)")
    loaded = AutoModelForCausalLM.from_pretrained(tiny_llama_b)
    for critics in ([tiny_llama, loaded], (tiny_llama, loaded)):
        assert refusal(lambda: MAACTrainer(agent_model=tiny_llama, critics=critics, args=maac, **common())) == (
            "critics length (2) must match 1 critic: MAACTrainer uses one centralised critic, so critics must have "
            f"exactly one element; got 2: {[tiny_llama, tiny_llama_b]!r}")
    assert refusal(lambda: MAACTrainer(agent_model=tiny_llama, critics=[], args=maac, **common())) == (
        "critics length (0) must match 1 critic: MAACTrainer uses one centralised critic, so critics must have "
        "exactly one element; got 0: []")
    # both given: the shortcut's name must be the listed critic's
    assert refusal(lambda: MAACTrainer(agent_model=tiny_llama, critic_model=tiny_llama, critics=[tiny_llama_b],
                                       args=maac, **common())) == (
        f"critic_model and critics conflict: {tiny_llama} != {[tiny_llama_b]}; critic_model={tiny_llama!r} does not "
        f"match critics names {[tiny_llama_b]} (entries [0] differ); give only one of them, or make the names match")
    assert refusal(lambda: MAACTrainer(agent_model=tiny_llama, critics=tiny_llama, args=maac, **common())) == (
        f"critics must be a non-empty sequence: a list of models, got str: {tiny_llama!r}")


def test_maac_takes_its_critic_from_either_argument(tiny_llama, tiny_llama_b):
    for arguments in (dict(critic_model=tiny_llama_b), dict(critics=[tiny_llama_b]),
                      dict(critic_model=tiny_llama_b, critics=(tiny_llama_b,))):
        trainer = MAACTrainer(agent_model=tiny_llama, args=MAACConfig(**settings()), **arguments, **common())
        assert trainer.critic_sources == [tiny_llama_b] and trainer.critic_model_name == tiny_llama_b
        assert trainer.critic_model is trainer.critics[0] and trainer.critic_names() == ["critic"]
        expected = AutoModelForCausalLM.from_pretrained(tiny_llama_b).state_dict()
        for name, tensor in trainer.critic_model.state_dict().items():
            if not name.startswith("value_head"):
                torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)


def test_iac_refuses_critics_that_do_not_fit_use_separate_critic_in_these_words(tiny_llama, tiny_llama_b):
    shared = IACConfig(use_separate_critic=False, **settings())
    separate = IACConfig(**settings())
    told = ("critics can only be provided when use_separate_critic=True: IACConfig.use_separate_critic=False shares "
            "each actor's backbone with its value head, so critic_model and critics must stay None; got ")
    tail = ". Set use_separate_critic=True to train separate critics"
    assert refusal(lambda: IACTrainer(agent_model=tiny_llama, critic_model=tiny_llama, args=shared, **common())) == (
        f"{told}critic_model={tiny_llama!r}, critics=None{tail}")
    loaded = AutoModelForCausalLM.from_pretrained(tiny_llama_b)
    assert refusal(lambda: IACTrainer(agent_model=tiny_llama, critics=[tiny_llama, loaded], args=shared,
                                      **common())) == (
        f"{told}critic_model=None, critics={[tiny_llama, tiny_llama_b]!r}{tail}")
    assert refusal(lambda: IACTrainer(agent_model=tiny_llama, critic_model=loaded, critics=[], args=shared,
                                      **common())) == f"{told}critic_model={tiny_llama_b!r}, critics=[]{tail}"
    assert refusal(lambda: IACTrainer(agent_model=tiny_llama, args=separate, **common())) == (
        "Either critic_model or critics must be provided when use_separate_critic=True: "
        "IACConfig.use_separate_critic=True needs the critics: pass critic_model='<model id>' (one copy per agent) "
        "or critics=[...] with 2 entries (both are None)")
    assert refusal(lambda: IACTrainer(agent_model=tiny_llama, critics=[tiny_llama], args=separate, **common())) == (
        "critics length (1) must match num_agents (2): critics has 1 entries but the number of models expected "
        "is 2; give exactly 2")
    assert refusal(lambda: IACTrainer(agent_model=tiny_llama, critic_model=tiny_llama,
                                      critics=[tiny_llama_b, tiny_llama], args=separate, **common())) == (
        f"critic_model and critics conflict: {tiny_llama} != {[tiny_llama_b, tiny_llama]}; "
        f"critic_model={tiny_llama!r} does not match critics names {[tiny_llama_b, tiny_llama]} (entries [0] "
        "differ); give only one of them, or make the names match")


def test_iac_gets_one_critic_per_agent_or_none(tiny_llama, tiny_llama_b):
    separate = IACTrainer(agent_model=tiny_llama, critic_model=tiny_llama_b, args=IACConfig(**settings()),
                          **common())
    assert separate.critic_sources == [tiny_llama_b, tiny_llama_b]
    assert separate.critic_names() == ["critic_0", "critic_1"] and separate.critics[0] is not separate.critics[1]
    assert [c is s for c, s in zip(separate.critic_models, separate.critics)] == [True, True]
    listed = IACTrainer(agent_model=tiny_llama, critics=[tiny_llama_b, tiny_llama], args=IACConfig(**settings()),
                        **common())
    assert listed.critic_sources == [tiny_llama_b, tiny_llama]
    shared = IACTrainer(agent_model=tiny_llama, args=IACConfig(use_separate_critic=False, **settings()), **common())
    assert shared.critics == [] and shared.critic_sources == [] and shared.critic_models == [None, None]


# ----- the value heads' widths and the model config ------------------------------------------------------------
def head_shape(model) -> list[tuple[int, int]]:
    """(inputs, outputs) of each linear layer of the model's value head."""
    return [(layer.in_features, layer.out_features) for layer in model.value_head.layers
            if isinstance(layer, torch.nn.Linear)]


def test_iac_sizes_the_critics_heads_or_the_actors_heads_from_their_own_field(tiny_llama):
    separate = IACTrainer(agent_model=tiny_llama, critic_model=tiny_llama,
                          args=IACConfig(critic_value_head_hidden_dim=8, **settings()), **common())
    assert [head_shape(c) for c in separate.critics] == [[(64, 8), (8, 1)]] * 2
    assert not any(hasattr(agent, "value_head") for agent in separate.agents)
    assert separate.compat_settings()["use_separate_critic"] is True
    assert separate.compat_settings()["value_head_hidden_dim"] == 8
    shared = IACTrainer(agent_model=tiny_llama, args=IACConfig(use_separate_critic=False, value_head_hidden_dim=5,
                                                               **settings()), **common())
    assert [head_shape(a) for a in shared.agents] == [[(64, 5), (5, 1)]] * 2
    assert shared.compat_settings()["use_separate_critic"] is False
    assert shared.compat_settings()["value_head_hidden_dim"] == 5
    linear = IACTrainer(agent_model=tiny_llama, args=IACConfig(use_separate_critic=False, **settings()), **common())
    assert [head_shape(a) for a in linear.agents] == [[(64, 1)]] * 2


def test_maac_sizes_its_critics_head_from_the_model_config_and_refuses_other_widths(tiny_llama):
    for width, expected in ((None, [(64, 1)]), (1, [(64, 1), (1, 1)]), (6, [(64, 6), (6, 1)])):
        model_config = {} if width is None else {"critic_value_head_hidden_dim": width}
        trainer = MAACTrainer(agent_model=tiny_llama, critic_model=tiny_llama, model_config=model_config,
                              args=MAACConfig(**settings()), **common())
        assert head_shape(trainer.critic_model) == expected
        assert trainer.compat_settings()["value_head_hidden_dim"] == width
    for width in (True, 0, -2, "8", 2.5):
        assert refusal(lambda: MAACTrainer(agent_model=tiny_llama, critic_model=tiny_llama,
                                           model_config={"critic_value_head_hidden_dim": width},
                                           args=MAACConfig(**settings()), **common())) == (
            f"model_config['critic_value_head_hidden_dim'] must be a positive integer or None, got {width!r}")


def test_save_model_writes_each_critic_under_its_name(tiny_llama, tmp_path):
    iac = IACTrainer(agent_model=tiny_llama, critic_model=tiny_llama, args=IACConfig(**settings()), **common())
    iac.save_model(str(tmp_path / "iac"))
    maac = MAACTrainer(agent_model=tiny_llama, critic_model=tiny_llama, args=MAACConfig(**settings()), **common())
    maac.save_model(str(tmp_path / "maac"))
    assert sorted(p.name for p in (tmp_path / "iac").iterdir() if p.name.startswith("critic")) == [
        "critic_0", "critic_1"]
    assert sorted(p.name for p in (tmp_path / "maac").iterdir() if p.name.startswith("critic")) == ["critic"]


# ----- early termination under data parallelism: refused in two processes -------------------------------------
WORKER = '''
import json, sys
from datasets import Dataset
from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer

model, out = sys.argv[1], sys.argv[2]
def go_on(prompt, agent_completions, num_agents, **_):
    return ["go on"] * num_agents
def reward(completions_0, completions_1):
    return [1.0] * len(completions_0)
data = Dataset.from_dict({"prompt": ["the cat", "the dog", "the sun", "the moon"]})
settings = dict(num_agents=2, num_generations=1, max_new_tokens=2, per_device_train_batch_size=2, num_train_epochs=1,
                disable_tqdm=True, device="cpu", early_termination_threshold=0.5)
seen = {}
for name, build in [
        ("iac", lambda: IACTrainer(agent_model=model, critic_model=model, num_agents=2, reward_func=reward,
                                   train_dataset=data, external_transition=go_on,
                                   args=IACConfig(num_turns=2, **settings))),
        ("maac", lambda: MAACTrainer(agent_model=model, critic_model=model, num_agents=2, reward_func=reward,
                                     train_dataset=data, external_transition=go_on,
                                     args=MAACConfig(num_turns=2, **settings))),
        ("one_turn", lambda: IACTrainer(agent_model=model, num_agents=2, reward_func=reward, train_dataset=data,
                                        args=IACConfig(num_turns=1, use_separate_critic=False, **settings)))]:
    try:
        trainer = build()
        seen[name] = ["built", trainer.data_parallel.world_size]
    except ValueError as error:
        seen[name] = ["refused", str(error)]
rank = __import__("torch").distributed.get_rank()
(__import__("pathlib").Path(out) / f"seen_{rank}.json").write_text(json.dumps(seen))
'''


def test_two_processes_refuse_early_termination_in_these_words(tiny_llama, tmp_path):
    """Early termination with two turns is refused before loading when two processes train; one turn is not, and
    one process is not. (Built here too, the trainer maps this test to the checks under mutmut, whose mutant the
    workers then run: they inherit ``MUTANT_UNDER_TEST``.)"""
    alone = IACTrainer(agent_model=tiny_llama, critic_model=tiny_llama, external_transition=go_on,
                       args=IACConfig(**settings(num_turns=2, early_termination_threshold=0.5)), **common())
    assert alone.data_parallel.world_size == 1 and alone.args.early_termination_threshold == 0.5
    script = tmp_path / "early_termination_worker.py"
    script.write_text(WORKER)
    # As tests/test_distributed.launch_worker: the tests' root first, so the workers import this tree's comlrl.
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                   "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(script), tiny_llama, str(tmp_path)]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    words = ("early_termination_threshold=0.5 cannot be combined with data parallelism yet (the processes would "
             "weight their episodes unequally); unset it or train in one process")
    for rank in range(2):
        seen = json.loads((tmp_path / f"seen_{rank}.json").read_text())
        assert seen == {"iac": ["refused", f"IACTrainer: {words}"], "maac": ["refused", f"MAACTrainer: {words}"],
                        "one_turn": ["built", 2]}
