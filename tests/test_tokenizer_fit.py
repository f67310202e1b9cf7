"""The tokenizer-compatibility rule: every ID the trainer feeds a model must have an embedding row;
added tokens past the embeddings that are never fed only warn; a prompt holding one is refused clearly.

transformers 5.24 reloads the tiny Qwen2-style tokenizer with exactly as many tokens as it was saved
with, so ``qwen2_reloaded`` reproduces the mechanism by which a reload grows it: the saved
tokenizer_config names a special token the vocabulary lacks, and the reload appends it as an added token.
"""

import json
import logging

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.models.entities import check_tokenizer_fits, used_special_tokens
from comlrl.rollout.generation import check_ids_in_range
from comlrl.rollout.generation import SamplingParams, encode_prompts, generate_completions
from comlrl.tiny import save_tiny_model
from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

ROWS = 323  # 320 byte-level BPE tokens + <|endoftext|>, <|im_start|>, <|im_end|>
EXTRA = "<unk>"  # what the reload appends, as id 323
TINY = dict(num_agents=2, num_generations=2, max_new_tokens=4, num_train_epochs=1, per_device_train_batch_size=1,
            disable_tqdm=True)


@pytest.fixture(scope="module")
def qwen2_reloaded(tmp_path_factory) -> str:
    """A tiny Qwen2 (323 embedding rows) whose tokenizer reloads with a 324th, unused added token."""
    directory = save_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", "qwen2", seed=3)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["unk_token"] = EXTRA  # a default special token the vocabulary lacks
    config_path.write_text(json.dumps(config))
    return str(directory)


@pytest.fixture
def two_prompts() -> Dataset:
    return Dataset.from_dict({"prompt": ["write a story about the cat", "a short plan for the team"]})


def reward(completions_0, completions_1):
    return [float(len(a) - len(b)) for a, b in zip(completions_0, completions_1)]


def reloaded(directory):
    return AutoTokenizer.from_pretrained(directory)


def fit_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "comlrl.models.entities" and "beyond the" in r.getMessage()]


def test_the_reload_really_outgrows_the_embeddings(qwen2_reloaded):
    tokenizer = reloaded(qwen2_reloaded)
    model = AutoModelForCausalLM.from_pretrained(qwen2_reloaded)
    assert model.get_input_embeddings().num_embeddings == ROWS
    assert len(tokenizer) == ROWS + 1 and tokenizer.convert_tokens_to_ids(EXTRA) == ROWS
    # in use: pad <|endoftext|>, eos <|im_end|>, and the chat template's <|im_start|>/<|im_end|>
    assert used_special_tokens(tokenizer) == {320: "pad token", 322: "eos token", 321: "chat template token"}


def test_magrpo_trains_and_warns_about_the_unused_token(qwen2_reloaded, two_prompts, caplog):
    caplog.set_level(logging.WARNING, logger="comlrl.models.entities")
    trainer = MAGRPOTrainer(agent_model=qwen2_reloaded, num_agents=2, reward_func=reward, train_dataset=two_prompts,
                            args=MAGRPOConfig(**TINY))
    warnings = fit_warnings(caplog)
    assert len(warnings) == 2  # one per model
    assert all(f"'{EXTRA}' (id {ROWS})" in w and f"the {ROWS} embedding rows" in w for w in warnings)
    assert "agent_0" in warnings[0] and "agent_1" in warnings[1]
    before = [p.detach().clone() for p in trainer.agents[0].parameters()]
    history = trainer.train()
    assert len(history) == 2 and all("reward_mean" in entry for entry in history)
    assert any(not torch.equal(b, a) for b, a in zip(before, trainer.agents[0].parameters()))


def test_own_tokenizer_that_fits_logs_nothing(tiny_llama, caplog):
    caplog.set_level(logging.WARNING, logger="comlrl.models.entities")
    check_tokenizer_fits(AutoModelForCausalLM.from_pretrained(tiny_llama), reloaded(tiny_llama), "agent_0")
    assert fit_warnings(caplog) == []


# ----- the guide's examples with such tokenizers -----------------------------------------------------
def test_heterogeneous_magrpo_agents(qwen2_reloaded, two_prompts):
    trainer = MAGRPOTrainer(agents=[qwen2_reloaded, qwen2_reloaded], reward_func=reward, train_dataset=two_prompts,
                            args=MAGRPOConfig(**TINY))
    assert [len(t) for t in trainer.tokenizers] == [ROWS + 1] * 2
    assert len(trainer.train()) == 2


def test_maac_with_explicit_tokenizers_and_critic(qwen2_reloaded, two_prompts):
    trainer = MAACTrainer(
        agents=[qwen2_reloaded, qwen2_reloaded],
        tokenizer=[reloaded(d) for d in (qwen2_reloaded, qwen2_reloaded)],
        critic_model=qwen2_reloaded,
        reward_func=reward,
        train_dataset=two_prompts,
        args=MAACConfig(**TINY),
    )
    assert len(trainer.critics) == 1
    assert len(trainer.train()) == 2


def test_iac_with_separate_critics(qwen2_reloaded, two_prompts):
    trainer = IACTrainer(
        agents=[qwen2_reloaded, qwen2_reloaded],
        tokenizer=[reloaded(d) for d in (qwen2_reloaded, qwen2_reloaded)],
        critics=[qwen2_reloaded, qwen2_reloaded],
        reward_func=reward,
        train_dataset=two_prompts,
        args=IACConfig(use_separate_critic=True, **TINY),
    )
    assert len(trainer.critics) == 2
    assert len(trainer.train()) == 2


def test_save_model_then_continue(qwen2_reloaded, two_prompts, tmp_path):
    trainer = MAGRPOTrainer(agent_model=qwen2_reloaded, num_agents=2, reward_func=reward, train_dataset=two_prompts,
                            args=MAGRPOConfig(**TINY))
    trainer.train()
    out = trainer.save_model(tmp_path / "out")
    assert len(reloaded(out / "agent_0")) == ROWS + 1  # the export carries the grown tokenizer on
    continued = MAGRPOTrainer(agents=[str(out / "agent_0"), str(out / "agent_1")], reward_func=reward,
                              train_dataset=two_prompts, args=MAGRPOConfig(**TINY))
    assert len(continued.train()) == 2


# ----- refusals before training ----------------------------------------------------------------------
@pytest.mark.parametrize("role", ["pad", "eos"])
def test_special_token_without_embedding_row_is_refused(qwen2_reloaded, two_prompts, role):
    tokenizer = reloaded(qwen2_reloaded)
    setattr(tokenizer, f"{role}_token", EXTRA)
    with pytest.raises(ValueError) as error:
        MAGRPOTrainer(agent_model=qwen2_reloaded, num_agents=2, tokenizer=tokenizer, reward_func=reward,
                      train_dataset=two_prompts, args=MAGRPOConfig(**TINY))
    message = str(error.value)
    assert f"the {role} token '{EXTRA}' (id {ROWS})" in message and "given for agent_0" in message
    assert f"embeds only {ROWS} tokens" in message and "resize_token_embeddings" in message


def test_chat_template_token_without_embedding_row_is_refused(qwen2_reloaded):
    tokenizer = reloaded(qwen2_reloaded)
    tokenizer.chat_template = tokenizer.chat_template + EXTRA
    with pytest.raises(ValueError, match=rf"the chat template token '{EXTRA}' \(id {ROWS}\) .* given for critic_0"):
        check_tokenizer_fits(AutoModelForCausalLM.from_pretrained(qwen2_reloaded), tokenizer, "critic_0")


def test_base_vocabulary_beyond_the_embeddings_is_refused(tiny_llama, tiny_gpt2):
    with pytest.raises(ValueError, match=r"agent_1 has 128 tokens but the model .* embeds only 96: its base-vocab"):
        check_tokenizer_fits(AutoModelForCausalLM.from_pretrained(tiny_llama), reloaded(tiny_gpt2), "agent_1")


# ----- encode time ------------------------------------------------------------------------------------
def test_prompt_with_an_unembedded_token_is_refused_when_encoded(qwen2_reloaded):
    model = AutoModelForCausalLM.from_pretrained(qwen2_reloaded)
    tokenizer = reloaded(qwen2_reloaded)
    prompts = ["the cat", f"the dog {EXTRA} ran"]
    ids, _ = encode_prompts(tokenizer, prompts, torch.device("cpu"))
    assert int(ids.max()) == ROWS  # unchecked, torch would index past the embedding table
    with pytest.raises(ValueError, match=rf"prompt row 1 contains token id {ROWS} '{EXTRA}' .* embeds only {ROWS}"):
        encode_prompts(tokenizer, prompts, torch.device("cpu"), num_embeddings=ROWS)
    with pytest.raises(ValueError, match=rf"prompt row 1 contains token id {ROWS} '{EXTRA}'"):
        generate_completions(model, tokenizer, prompts, 2, SamplingParams(max_new_tokens=2))


def test_check_ids_in_range_on_hand_made_ids():
    check_ids_in_range(torch.tensor([[0, 4], [3, 2]]), 5)  # all inside: no error
    check_ids_in_range(torch.empty(0, 0, dtype=torch.long), 5)
    with pytest.raises(ValueError, match=r"critic input row 1 contains token id 7 \(2 out-of-range id\(s\) in all\), "
                                         r"but the model embeds only 5 tokens \(ids 0\.\.4\)"):
        check_ids_in_range(torch.tensor([[0, 4], [1, 7], [9, 0]]), 5, "critic input")
    with pytest.raises(ValueError, match="prompt row 0 contains token id -1"):
        check_ids_in_range(torch.tensor([2, -1]), 5)
