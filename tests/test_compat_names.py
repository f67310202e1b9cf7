"""Names that code written for the original comlrl reaches for: the ``model=`` keyword, ``model_name``,
``agent_models``, the ``ac_base`` module path, ``num_agents`` assignment (docs/migrating.md)."""

from __future__ import annotations

import pytest
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.tasks.letters import letters_reward
from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl.trainers.preference import MADPOIterConfig, MADPOIterTrainer, MARLHFConfig, MARLHFTrainer
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
