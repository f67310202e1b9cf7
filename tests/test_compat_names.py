"""Names that code written for the original comlrl reaches for: the ``model=`` keyword, ``model_name``,
``agent_models``, the ``ac_base`` module path, ``num_agents`` assignment, and the centralized comparator
(``comlrl.trainers.preference.centralized``, ``comparator_generation_mode='centralized'``) (docs/migrating.md)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.rollout.collaboration import CollaborationParseError
from comlrl.tasks.letters import letters_reward
from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl.trainers.preference import (CentralizedComparatorParseError, MADPOIterConfig, MADPOIterTrainer,
                                        MARLHFConfig, MARLHFIterConfig, MARLHFIterTrainer, MARLHFTrainer,
                                        TaggedCentralizedComparatorAdapter)
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

FAST = dict(num_agents=2, num_generations=2, max_new_tokens=4, num_train_epochs=1, disable_tqdm=True)
PROMPTS = Dataset.from_dict({"prompt": ["write about the cat", "write about the sun"]})


def magrpo(**arguments) -> MAGRPOTrainer:
    return MAGRPOTrainer(reward_func=letters_reward, train_dataset=PROMPTS, args=MAGRPOConfig(**FAST), **arguments)


def iterative(**arguments) -> MADPOIterTrainer:
    return MADPOIterTrainer(reward_func=letters_reward, train_dataset=PROMPTS,
                            args=MADPOIterConfig(**FAST, num_iterations=1), **arguments)


# ----- 1. model= ---------------------------------------------------------------------------------
def test_model_keyword_is_agent_model_on_every_trainer(tiny_llama, tiny_llama_b):
    trainer = magrpo(model=tiny_llama, num_agents=2)
    assert trainer.agent_sources == [tiny_llama, tiny_llama]
    assert trainer.agents[0] is not trainer.agents[1]  # two copies, as agent_model= gives
    actor_critic = dict(reward_func=letters_reward, train_dataset=PROMPTS)
    iac = IACTrainer(model=tiny_llama, critic_model=tiny_llama_b, args=IACConfig(**FAST), **actor_critic)
    maac = MAACTrainer(model=tiny_llama, critic_model=tiny_llama_b, args=MAACConfig(**FAST), **actor_critic)
    assert iac.agent_sources == maac.agent_sources == [tiny_llama, tiny_llama]
    # MARLHF reads the first actor before its policy trainer exists (its reward model defaults to it)
    marlhf = MARLHFTrainer(model=tiny_llama_b, reward_func=letters_reward, train_dataset=PROMPTS,
                           args=MARLHFConfig(**FAST, reward_model_device=None))
    assert marlhf.reward_model_source == tiny_llama_b and marlhf.agent_sources == [tiny_llama_b] * 2
    assert iterative(model=tiny_llama).agent_sources == [tiny_llama] * 2


def test_model_and_agent_model_must_agree(tiny_llama, tiny_llama_b):
    with pytest.raises(ValueError, match=r"agent_model='.*tiny-llama' and model='.*tiny-llama-b' disagree: model is "
                                         r"the older name of agent_model"):
        magrpo(agent_model=tiny_llama, model=tiny_llama_b)
    with pytest.raises(ValueError, match="disagree"):
        iterative(agent_model=tiny_llama, model=tiny_llama_b)
    with pytest.raises(ValueError, match="disagree"):
        MARLHFTrainer(agent_model=tiny_llama, model=tiny_llama_b, reward_func=letters_reward,
                      args=MARLHFConfig(**FAST, reward_model_device=None))
    assert magrpo(agent_model=tiny_llama, model=tiny_llama).agent_sources == [tiny_llama] * 2  # the same: fine
    # model= is agent_model, so the agent_model/agents rule holds for it
    with pytest.raises(ValueError, match=r"agent_model and agents conflict"):
        magrpo(model=tiny_llama, agents=[tiny_llama, tiny_llama_b])


# ----- 2. model_name, agent_models ---------------------------------------------------------------
def test_model_name_is_the_first_agents_name_as_the_original_gave_it(tiny_llama, tiny_llama_b):
    assert magrpo(agent_model=tiny_llama).model_name == tiny_llama
    heterogeneous = magrpo(agents=[tiny_llama_b, tiny_llama], tokenizer=AutoTokenizer.from_pretrained(tiny_llama))
    assert heterogeneous.model_name == tiny_llama_b
    # model objects: 1.4.3 named them by their base model's model_type, not their path
    objects = [AutoModelForCausalLM.from_pretrained(path) for path in (tiny_llama, tiny_llama_b)]
    assert magrpo(agents=objects, tokenizer=AutoTokenizer.from_pretrained(tiny_llama)).model_name == "llama"
    assert iterative(agent_model=tiny_llama_b).model_name == tiny_llama_b


def test_agent_models_are_the_agents_and_both_names_are_read_only(tiny_llama):
    for trainer in (magrpo(agent_model=tiny_llama), iterative(agent_model=tiny_llama)):
        models = trainer.agent_models
        assert len(models) == 2 and all(a is b for a, b in zip(models, trainer.agents))
        models.clear()  # a new list: the trainer's agents are untouched
        assert len(trainer.agent_models) == 2
        for name in ("agent_models", "model_name"):
            with pytest.raises(AttributeError):
                setattr(trainer, name, None)


# ----- 3. comlrl.trainers.actor_critic.ac_base ---------------------------------------------------
def test_ac_base_module_path():
    from comlrl.trainers import ActorCriticTrainerBase as from_trainers
    from comlrl.trainers.actor_critic import ActorCriticTrainer
    from comlrl.trainers.actor_critic.ac_base import ActorCriticTrainerBase, __all__

    assert ActorCriticTrainerBase is ActorCriticTrainer is from_trainers
    assert issubclass(IACTrainer, ActorCriticTrainerBase) and issubclass(MAACTrainer, ActorCriticTrainerBase)
    assert __all__ == ["ActorCriticTrainerBase"]


# ----- 4. num_agents ---------------------------------------------------------------------------------
@pytest.mark.parametrize("build", [iterative, magrpo], ids=["MADPOIterTrainer", "MAGRPOTrainer"])
def test_num_agents_takes_its_own_value_only(tiny_llama, build):
    trainer = build(agent_model=tiny_llama)
    trainer.num_agents = 2  # 1.4.3 code may assign it: its own value is accepted
    name = type(trainer).__name__
    for value in (3, 1, 2.0, True):
        with pytest.raises(ValueError, match=rf"{name}.num_agents is 2, fixed at construction with its 2 agents; "
                                             rf"it cannot become {value!r}: construct a new trainer"):
            trainer.num_agents = value
    assert trainer.num_agents == 2 and len(trainer.agents) == 2


# ----- 5. the centralized comparator -------------------------------------------------------------------
CENTRALIZED = dict(num_agents=2, num_generations=3, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=None,
                   num_iterations=1, num_train_epochs=1, dpo_batch_size=4, max_pairs_per_prompt=4,
                   disable_tqdm=True, seed=5, comparator_generation_mode="centralized")
ROWS = Dataset.from_dict({"prompt": ["write about the cat", "write about the sun", "write about the tree"]})


class HalvingAdapter:
    """A 1.4.3-style adapter: records the agents' prompts; agent 0's part is the first half of a joint completion."""

    def __init__(self, fail: bool = False) -> None:
        self.agent_prompts: list[list[str]] = []
        self.parts: set[tuple[str, ...]] = set()
        self.fail = fail

    def build_prompt(self, batch_item, agent_prompts):
        self.agent_prompts.append(list(agent_prompts))
        return "both parts of: " + batch_item["prompt"]

    def parse_completion(self, completion, batch_item, num_agents):
        if self.fail:
            raise CentralizedComparatorParseError("no agent sections")  # 1.4.3's way: a message alone
        half = len(completion) // 2
        parts = (completion[:half], completion[half:])
        self.parts.add(parts)
        return list(parts)


def centralized(model: str, adapter=None, **options) -> MADPOIterTrainer:
    return MADPOIterTrainer(agent_model=model, reward_func=letters_reward, train_dataset=ROWS,
                            args=MADPOIterConfig(**{**CENTRALIZED, **options}), centralized_comparator_adapter=adapter)


def comparator_sides(trainer) -> list[tuple[list[str], list[list[int]]]]:
    """(texts, token IDs) of every comparator-side candidate in the run's pairs."""
    sides = []
    for pair in trainer.preference_pairs.to_list():
        for side in ("chosen", "rejected"):
            if pair[f"{side}_source"] == "comparator":
                sides.append((pair[side], pair[f"{side}_ids"]))
    return sides


def test_an_iterative_trainer_trains_against_one_model_writing_every_part(tiny_llama):
    adapter = HalvingAdapter()
    trainer = centralized(tiny_llama, adapter, comparator_centralized_agent_index=1)
    before = [p.detach().clone() for p in trainer.agents[0].parameters()]
    trainer.train()
    assert trainer.comparator.kind == "centralized_current" and trainer.compat_settings()["comparator"] == \
        "centralized_current"
    assert adapter.agent_prompts == [[p, p] for p in ROWS["prompt"]]  # one joint prompt per row, from both prompts
    sides = comparator_sides(trainer)
    assert sides, "no pair has a comparator-side candidate"
    tokenizer = trainer.tokenizers[0]
    for texts, ids in sides:
        assert tuple(texts) in adapter.parts  # the parts are the adapter's split of one joint completion
        for agent, text in enumerate(texts):  # each tokenized for its agent, ended with its EOS
            assert ids[agent] == tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.agents[0].parameters()))  # DPO ran


@pytest.mark.parametrize("policy", ["partial", "empty"])
def test_unsplittable_joint_completions_give_empty_parts(tiny_llama, policy):
    trainer = centralized(tiny_llama, HalvingAdapter(fail=True), comparator_parse_failure=policy)
    trainer.collect_preferences()
    eos = trainer.tokenizers[0].eos_token_id
    assert all(texts == ["", ""] and ids == [[eos], [eos]] for texts, ids in comparator_sides(trainer))


def test_the_tagged_adapter_and_the_raise_policy(tiny_llama):
    adapter = TaggedCentralizedComparatorAdapter()
    prompt = adapter.build_prompt({"prompt": "x"}, ["say cat", "say dog"])
    assert "say cat" in prompt and "<agent_1>" in prompt
    assert adapter.parse_completion("<agent_1> dog </agent_1> <agent_0>cat</agent_0>", {}, 2) == ["cat", "dog"]
    with pytest.raises(CentralizedComparatorParseError) as error:
        adapter.parse_completion("<agent_0>cat</agent_0>", {}, 2)
    assert error.value.responses == ["cat", ""]
    # the built-in tagged format by default: the tiny model writes no tags, so 'raise' stops the collection
    trainer = centralized(tiny_llama, comparator_parse_failure="raise")
    with pytest.raises(CollaborationParseError, match=r"does not split into the 2 roles \['agent_0', 'agent_1'\]"):
        trainer.collect_preferences()


def test_centralized_comparator_settings(tiny_llama, tiny_llama_b):
    trainer = centralized(tiny_llama, comparator_generation_mode="centralised", comparator_policy="model",
                          comparator_agents=[tiny_llama, tiny_llama_b], comparator_centralized_agent_index=1)
    assert trainer.args.comparator_generation_mode == "centralized"  # 1.4.3's spellings are translated
    assert trainer.comparator.kind == "centralized_model"
    assert trainer.comparator.source.sources == [tiny_llama_b]  # only the writing agent's model is loaded
    marlhf = MARLHFIterTrainer(agent_model=tiny_llama, reward_func=letters_reward, train_dataset=ROWS,
                               args=MARLHFIterConfig(**FAST, reward_model_device=None,
                                                     comparator_generation_mode="centralized"),
                               centralized_comparator_adapter=TaggedCentralizedComparatorAdapter())
    assert marlhf.comparator.kind == "centralized_current"
    with pytest.raises(ValueError, match=r"comparator_centralized_agent_index must be smaller than num_agents: "
                                         r"MADPOIterConfig.comparator_centralized_agent_index=2 with num_agents=2"):
        MADPOIterConfig(**{**CENTRALIZED, "comparator_centralized_agent_index": 2})
    with pytest.raises(ValueError, match="comparator_parse_failure='raise' applies only to "
                                         "comparator_generation_mode='centralized'"):
        MADPOIterConfig(comparator_parse_failure="raise")
    with pytest.raises(ValueError, match="centralized_comparator_adapter is used only with "
                                         "comparator_generation_mode='centralized'"):
        centralized(tiny_llama, HalvingAdapter(), comparator_generation_mode="decentralized")
