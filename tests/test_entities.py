"""Every consistency rule of the user guide, with the message it raises."""

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.trainers import MAGRPOConfig, MAGRPOTrainer


def make(**kwargs):
    defaults = dict(args=MAGRPOConfig(num_train_epochs=1, num_agents=2, max_new_tokens=4, disable_tqdm=True))
    defaults.update(kwargs)
    return MAGRPOTrainer(**defaults)


def test_homogeneous_agents_are_independent_copies(tiny_llama, reward_func, train_dataset):
    trainer = make(agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset)
    assert len(trainer.agents) == 2 and trainer.agents[0] is not trainer.agents[1]
    first = next(trainer.agents[0].parameters())
    second = next(trainer.agents[1].parameters())
    assert first.data_ptr() != second.data_ptr() and first.equal(second)
    assert trainer.agent_sources == [tiny_llama, tiny_llama]


def test_neither_agent_model_nor_agents(reward_func, train_dataset):
    with pytest.raises(ValueError, match="Either agent_model or agents must be provided"):
        make(reward_func=reward_func, train_dataset=train_dataset)


def test_agent_model_and_agents_names_must_match(tiny_llama, tiny_gpt2, reward_func, train_dataset):
    with pytest.raises(ValueError) as error:
        make(agent_model=tiny_llama, agents=[tiny_llama, tiny_gpt2], reward_func=reward_func, train_dataset=train_dataset)
    message = str(error.value)
    assert "agent_model=" in message and "does not match agents names" in message and "entries [1] differ" in message
    assert tiny_gpt2 in message


def test_agent_model_and_agents_may_agree(tiny_llama, reward_func, train_dataset):
    trainer = make(agent_model=tiny_llama, agents=[tiny_llama, tiny_llama], reward_func=reward_func, train_dataset=train_dataset)
    assert len(trainer.agents) == 2


def test_agents_length_must_equal_num_agents(tiny_llama, reward_func, train_dataset):
    with pytest.raises(ValueError, match="agents has 3 entries but the number of agents is 2"):
        make(agents=[tiny_llama] * 3, reward_func=reward_func, train_dataset=train_dataset)


def test_constructor_and_config_num_agents_must_agree(tiny_llama, reward_func, train_dataset):
    with pytest.raises(ValueError) as error:
        make(agent_model=tiny_llama, num_agents=3, reward_func=reward_func, train_dataset=train_dataset)
    assert "num_agents=3 (constructor) disagrees with MAGRPOConfig.num_agents=2" in str(error.value)


def test_model_objects_need_a_tokenizer(tiny_llama, reward_func, train_dataset):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with pytest.raises(ValueError, match=r"agents\[0\] is a loaded model object .* pass tokenizer="):
        make(agents=[model, model], reward_func=reward_func, train_dataset=train_dataset)


def test_model_objects_with_shared_tokenizer(tiny_llama, reward_func, train_dataset):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    trainer = make(agents=[model, model], tokenizer=tokenizer, reward_func=reward_func, train_dataset=train_dataset)
    assert trainer.agents[0] is model and trainer.agents[1] is not model  # the repeat is copied


def test_tokenizer_list_length(tiny_llama, reward_func, train_dataset):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    with pytest.raises(ValueError, match="tokenizer is a list of 3 but there are 2 agents"):
        make(agent_model=tiny_llama, tokenizer=[tokenizer] * 3, reward_func=reward_func, train_dataset=train_dataset)


def test_incompatible_tokenizer_is_rejected(tiny_llama, tiny_gpt2, reward_func, train_dataset):
    big_vocab = AutoTokenizer.from_pretrained(tiny_gpt2)  # 128 tokens for a 96-row embedding
    with pytest.raises(ValueError, match="has 128 tokens but the model .* embeds only 96"):
        make(agent_model=tiny_llama, tokenizer=big_vocab, reward_func=reward_func, train_dataset=train_dataset)


def test_missing_model_directory_is_named(tmp_path, reward_func, train_dataset):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="could not load a tokenizer from .*nowhere"):
        make(agent_model=missing, reward_func=reward_func, train_dataset=train_dataset)


def test_bad_agent_type(reward_func, train_dataset):
    with pytest.raises(ValueError, match=r"agents\[1\] must be a model identifier"):
        make(agents=["a", 3], reward_func=reward_func, train_dataset=train_dataset)


def test_tokenizer_without_pad_gets_eos(tiny_llama, reward_func, train_dataset, caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.pad_token = None
    trainer = make(agent_model=tiny_llama, tokenizer=tokenizer, reward_func=reward_func, train_dataset=train_dataset)
    assert trainer.tokenizers[0].pad_token == trainer.tokenizers[0].eos_token
    assert "has no pad token" in caplog.text


def test_missing_reward_and_dataset(tiny_llama, reward_func, train_dataset):
    with pytest.raises(ValueError, match="needs reward_func"):
        make(agent_model=tiny_llama, train_dataset=train_dataset)
    trainer = make(agent_model=tiny_llama, reward_func=reward_func)  # the dataset may come later (as in 1.4.3)
    with pytest.raises(ValueError, match="train_dataset"):
        trainer.train()
    with pytest.raises(ValueError, match="train_dataset is empty"):
        make(agent_model=tiny_llama, reward_func=reward_func, train_dataset=[])


def test_multi_turn_needs_transition(tiny_llama, reward_func, train_dataset):
    with pytest.raises(ValueError, match="num_turns=2 needs external_transition"):
        make(agent_model=tiny_llama, reward_func=reward_func, train_dataset=train_dataset,
             args=MAGRPOConfig(max_new_tokens=32, num_train_epochs=1, num_turns=2, num_generations=2))


def test_unknown_model_config_key(tiny_llama, reward_func, train_dataset):
    with pytest.raises(ValueError, match=r"model_config has unknown keys \['hidden'\]"):
        make(agent_model=tiny_llama, reward_func=reward_func, train_dataset=train_dataset, model_config={"hidden": 1})
