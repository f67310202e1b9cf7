"""Tiny local causal LMs and tokenizers, built without any network access.

Tests, the bundled demo and the benchmarks use these in place of hub models. They are
saved with ``save_pretrained`` and loaded back through ``from_pretrained(directory)``,
which is the same code path a hub identifier takes.
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2Tokenizer,
)

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}

# Qwen2-style: added tokens after a byte-level BPE vocabulary, a ChatML chat template.
QWEN2_ADDED_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
DEFAULT_VOCAB_SIZES = {"llama": 96, "gpt2": 96, "qwen2": 320}

_WORDS = (
    "the a an agent agents write read code story plan team work together answer short long "
    "task prompt reply model train reward good bad yes no one two three four five blue red "
    "green cat dog sun moon tree river hill road book letter word sentence idea help make"
).split()


def toy_corpus(num_lines: int = 400, seed: int = 0) -> list[str]:
    """Deterministic pseudo-English lines to train the tiny tokenizers on."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))) for _ in range(num_lines)]


def build_tiny_tokenizer(vocab_size: int = 96, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train a small BPE tokenizer (Metaspace, so spaces survive decoding)."""
    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=list("abcdefghijklmnopqrstuvwxyz"),
        show_progress=False,
    )
    tokenizer.train_from_iterator(toy_corpus(seed=seed), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS)


def build_tiny_qwen2_tokenizer(vocab_size: int = 320, seed: int = 0) -> Qwen2Tokenizer:
    """Train a byte-level BPE (``vocab_size`` base tokens, the 256 bytes included) and append Qwen2's
    added tokens: the layout whose reloads ``len(tokenizer)`` and the embedding rows can disagree on."""
    if vocab_size <= 256:
        raise ValueError(f"a byte-level vocabulary needs more than the 256 byte tokens, got vocab_size={vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(toy_corpus(seed=seed), trainer=trainer)
    tokenizer.add_special_tokens(list(QWEN2_ADDED_TOKENS))
    wrapped = Qwen2Tokenizer(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    wrapped.chat_template = QWEN2_CHAT_TEMPLATE
    return wrapped


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    return {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def tiny_llama_config(tokenizer: PreTrainedTokenizerFast, hidden_size: int = 64, num_layers: int = 2) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        **_special_ids(tokenizer),
    )


def tiny_qwen2_config(tokenizer: PreTrainedTokenizerBase, hidden_size: int = 64, num_layers: int = 2) -> Qwen2Config:
    """As many embedding rows as the tokenizer has tokens now, added tokens included."""
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        **_special_ids(tokenizer),
    )


def tiny_gpt2_config(tokenizer: PreTrainedTokenizerFast, hidden_size: int = 48, num_layers: int = 2) -> GPT2Config:
    return GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=hidden_size,
        n_layer=num_layers,
        n_head=4,
        n_positions=256,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **_special_ids(tokenizer),
    )


def save_tiny_model(
    directory: str | Path,
    architecture: str = "llama",
    vocab_size: int | None = None,
    hidden_size: int | None = None,
    seed: int = 0,
) -> Path:
    """Build a randomly initialised tiny model plus its tokenizer and save both to ``directory``.

    ``architecture`` is ``"llama"``, ``"gpt2"`` or ``"qwen2"`` (byte-level BPE, ChatML added tokens and
    chat template); different ``vocab_size`` values give tokenizers with different vocabularies (for
    heterogeneous-agent setups). ``None`` is 96, or 320 for ``"qwen2"``.
    """
    import torch

    if architecture not in DEFAULT_VOCAB_SIZES:
        raise ValueError(f"architecture must be 'llama', 'gpt2' or 'qwen2', got {architecture!r}")
    directory = Path(directory)
    vocab_size = vocab_size or DEFAULT_VOCAB_SIZES[architecture]
    sizes = {"hidden_size": hidden_size} if hidden_size else {}
    if architecture == "qwen2":
        tokenizer = build_tiny_qwen2_tokenizer(vocab_size=vocab_size, seed=seed)
        config = tiny_qwen2_config(tokenizer, **sizes)
    else:
        tokenizer = build_tiny_tokenizer(vocab_size=vocab_size, seed=seed)
        config = (tiny_llama_config if architecture == "llama" else tiny_gpt2_config)(tokenizer, **sizes)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
