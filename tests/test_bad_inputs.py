"""Bad trainer inputs get clear errors before any work: empty prompts name their rows before
generation, a reward function returning a string says so."""

from __future__ import annotations

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from comlrl.rollout.generation import encode_prompts
from comlrl.rollout.rewards import JointReward
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

SMALL = dict(num_agents=2, num_generations=2, max_new_tokens=4, num_train_epochs=1, per_device_train_batch_size=4,
             shuffle=False, disable_tqdm=True)


def constant_reward(completions_0, completions_1):
    return [0.0] * len(completions_0)


def test_all_empty_prompts_are_refused_before_any_model_loads(tiny_llama):
    with pytest.raises(ValueError) as caught:
        MAGRPOTrainer(agent_model=tiny_llama, reward_func=constant_reward,
                      train_dataset=Dataset.from_dict({"prompt": [""] * 4}), args=MAGRPOConfig(**SMALL))
    assert str(caught.value).startswith("row 0 gives agent 0 an empty prompt"), caught.value


def test_an_empty_prompt_stops_the_step_before_generation(tiny_llama):
    trainer = MAGRPOTrainer(agent_model=tiny_llama, reward_func=constant_reward,
                            train_dataset=Dataset.from_dict({"prompt": ["a cat", "", "a dog", ""]}),
                            args=MAGRPOConfig(**SMALL))
    forwards = []
    for agent in trainer.agents:
        agent.register_forward_hook(lambda *_: forwards.append(1))
    with pytest.raises(ValueError, match="row 1 gives agent 0 an empty prompt"):
        trainer.train()
    assert forwards == [] and trainer.state.global_step == 0


def test_prompts_that_encode_to_no_tokens_are_named_by_position(tiny_llama):
    """What no formatter sees (a transition's prompts passed through): refused before the model runs."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    with pytest.raises(ValueError, match=r"prompts \[0, 2\] of this batch \(of 3\) encode to no tokens"):
        encode_prompts(tokenizer, ["", "a cat", ""], device="cpu")


@pytest.mark.parametrize("returned", ["abc", b"0.5"])
def test_a_reward_returning_a_string_says_so(returned):
    def string_reward(completions_0, completions_1):
        return returned

    with pytest.raises(ValueError) as caught:
        JointReward(string_reward, num_agents=2)([["a", "b", "c", "d"], ["e", "f", "g", "h"]], [{}] * 4)
    kind = type(returned).__name__
    assert f"reward function {string_reward.__qualname__} returned a {kind} ({returned!r})" in str(caught.value)
    assert "joint samples" not in str(caught.value)
