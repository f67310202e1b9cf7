"""Training entities: resolving and loading agents (and critics) with their tokenizers.

Every trainer goes through this module, so the consistency rules of the user guide
(``agent_model`` vs ``agents``, list lengths, ``num_agents``, tokenizers) live in one place.
Models are given as hub identifiers, local directories or loaded ``PreTrainedModel`` objects;
identifiers and directories both load through ``from_pretrained``.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from comlrl.tokenizers import check_tokenizer, check_tokenizers
from comlrl.rollout.generation import token_text

logger = logging.getLogger(__name__)

@dataclass
class LoadedModels:
    """Models in role order, one tokenizer per model, and where each came from."""

    models: list[PreTrainedModel]
    tokenizers: list[PreTrainedTokenizerBase]
    sources: list[str | None]


def model_name(source: Any) -> str | None:
    """The identifier/directory a source stands for (``name_or_path`` for model objects)."""
    if isinstance(source, str):
        return source
    return getattr(source, "name_or_path", None) or None


def infer_model_name(source: Any) -> str | None:
    """comlrl 1.4.3's name for a model source: its trainers' ``model_name`` (of the first agent).

    ``None`` gives ``None`` and a string is its own name. For an object: the ``model_type``
    (else ``_name_or_path``) of its ``base_model``'s config if it has one (so ``"llama"`` for a
    loaded Llama); else the ``_name_or_path`` (else ``model_type``) of the config of its
    ``.model`` (else ``.base_model``, else itself); else that object's class name.
    """
    if source is None:
        return None
    if isinstance(source, str):
        return source
    base_config = getattr(getattr(source, "base_model", None), "config", None)
    if base_config is not None:
        found = getattr(base_config, "model_type", None) or getattr(base_config, "_name_or_path", None)
        if found:
            return str(found)
    if hasattr(source, "model"):
        inner = source.model
    elif hasattr(source, "base_model"):
        inner = source.base_model
    else:
        inner = source
    config = getattr(inner, "config", None)
    if config is not None:
        found = getattr(config, "_name_or_path", None) or getattr(config, "model_type", None)
        if found:
            return str(found)
    return type(inner).__name__


def agent_model_argument(agent_model: Any, model: Any) -> Any:
    """The homogeneous agents' model from a trainer's ``agent_model`` and ``model`` arguments.

    ``model`` was this argument's name in comlrl's trainers before 1.4 (1.4.3 refuses it); the two
    name one argument, so giving both with different values is refused.
    """
    if model is None:
        return agent_model
    if agent_model is not None and agent_model is not model and _normalize(agent_model) != _normalize(model):
        raise ValueError(f"agent_model={_describe(agent_model)} and model={_describe(model)} disagree: model is the "
                         "older name of agent_model (comlrl before 1.4); give one of them")
    return model


def _describe(source: Any) -> str:
    return repr(source) if isinstance(source, str) else f"<{type(source).__name__} {model_name(source)!r}>"


def _normalize(source: Any) -> Any:
    """Paths are accepted wherever a directory string is."""
    return os.fspath(source) if isinstance(source, os.PathLike) else source


def _check_source_type(argument: str, source: Any) -> None:
    if not isinstance(source, (str, PreTrainedModel)):
        raise ValueError(
            f"{argument} must be a model identifier, a local directory or a loaded "
            f"transformers PreTrainedModel, got {type(source).__name__}: {source!r}"
        )


def resolve_num_agents(num_agents: int | None, config_num_agents: int, config_name: str) -> int:
    """The constructor's ``num_agents`` may be given alongside the config's; they must agree."""
    if num_agents is None:
        return config_num_agents
    if isinstance(num_agents, bool) or not isinstance(num_agents, int) or num_agents < 1:
        raise ValueError(f"num_agents must be a positive integer, got {num_agents!r}")
    if num_agents != config_num_agents:
        raise ValueError(
            f"num_agents must match args.num_agents: num_agents={num_agents} (constructor) disagrees with "
            f"{config_name}.num_agents={config_num_agents}; set both to the same value (the config alone never "
            "overrides the constructor argument)"
        )
    return num_agents


def keep_num_agents(trainer_name: str, current: int, value: Any) -> None:
    """Assigning a trainer's ``num_agents``: its own value is accepted (code written for comlrl 1.4.3,
    where it was a plain attribute, may set it), any other refused: the agents are loaded at construction."""
    if isinstance(value, bool) or not isinstance(value, int) or value != current:
        raise ValueError(
            f"{trainer_name}.num_agents is {current}, fixed at construction with its {current} agents; it cannot "
            f"become {value!r}: construct a new trainer with num_agents={value!r} (and args.num_agents={value!r})")


def keep_agents(trainer_name: str, current: Sequence[Any], value: Any) -> None:
    """Assigning a composite trainer's ``agents`` (a plain attribute in comlrl 1.4.3): the same models, in the
    same order, are accepted; other models are refused, since the optimizers and checkpoints hold these ones."""
    same = isinstance(value, (list, tuple)) and len(value) == len(current) and all(
        given is held for given, held in zip(value, current))
    if not same:
        raise ValueError(
            f"{trainer_name}.agents are the {len(current)} models loaded at construction, which its optimizers and "
            f"checkpoints hold; they cannot be replaced by {type(value).__name__} {value!r:.120}: construct a new "
            "trainer with agents=[...] instead")


def require_sources(single: Any, many: Any, single_name: str = "agent_model", list_name: str = "agents") -> None:
    """Some model given at all: the original comlrl's first check of the agents (before their values)."""
    if single is None and many is None:
        raise ValueError(f"Either {single_name} or {list_name} must be provided (both are None)")


def resolve_model_list(
    single: Any,
    many: Sequence[Any] | None,
    count: int,
    single_name: str = "agent_model",
    list_name: str = "agents",
    count_label: str | None = None,
) -> list[Any]:
    """Merge a homogeneous shortcut (``single``) and an explicit list (``many``) into ``count`` sources.

    Both may be given only if every listed model has the shortcut's name and the list has
    ``count`` entries; an error names the argument and the values seen otherwise. Messages
    start with the original comlrl's words; ``count_label`` is what its length error names
    (default ``num_agents (<count>)``).
    """
    count_label = count_label or f"num_agents ({count})"
    single = _normalize(single)
    require_sources(single, many, single_name, list_name)
    if many is not None:
        if isinstance(many, (str, PreTrainedModel)) or not isinstance(many, (list, tuple)):
            raise ValueError(f"{list_name} must be a non-empty sequence: a list of models, got "
                             f"{type(many).__name__}: {many!r}")
        many = [_normalize(source) for source in many]
        for index, source in enumerate(many):
            _check_source_type(f"{list_name}[{index}]", source)
        if len(many) != count:
            # The words of releases before 1.4.3, whose callers match them, when the shortcut came too.
            both = ("" if single is None
                    else f" (both model and {list_name} were given: {single_name}={model_name(single)!r})")
            raise ValueError(
                f"{list_name} length ({len(many)}) must match {count_label}{both}: {list_name} has {len(many)} "
                f"entries but the number of {'agents' if list_name == 'agents' else 'models expected'} is "
                f"{count}; give exactly {count}"
            )
        if single is not None:
            _check_source_type(single_name, single)
            expected = model_name(single)
            names = [model_name(source) for source in many]
            mismatched = [i for i, name in enumerate(names) if name != expected]
            if mismatched:
                raise ValueError(
                    f"{single_name} and {list_name} conflict: {expected} != {names}; "
                    f"{single_name}={expected!r} does not match {list_name} names {names} "
                    f"(entries {mismatched} differ); give only one of them, or make the names match"
                )
        return list(many)
    _check_source_type(single_name, single)
    return [single] * count


def load_tokenizer(source: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ValueError(f"could not load a tokenizer from {source!r}: {error}") from error


def load_causal_lm(
    source: str | PreTrainedModel,
    device: torch.device,
    dtype: torch.dtype,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load (or move) a causal LM to ``device``/``dtype``; a loaded object is used as it is."""
    if isinstance(source, PreTrainedModel):
        return source.to(device=device, dtype=dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ValueError(f"could not load a causal language model from {source!r}: {error}") from error
    return model.to(device)


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase, role: str) -> PreTrainedTokenizerBase:
    """Give a tokenizer without a pad token the EOS token as pad (with a warning)."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer of {role} has neither a pad token nor an EOS token; set one")
        eos_token = getattr(tokenizer, "eos_token", None)
        logger.warning("the tokenizer of %s has no pad token; using its EOS token %r", role, eos_token)
        try:
            tokenizer.pad_token = eos_token
        except AttributeError:  # a tokenizer object whose pad_token cannot be set: reported just below
            pass
        if tokenizer.pad_token_id is None:
            raise ValueError(
                f"the tokenizer of {role} ({type(tokenizer).__name__}) has no pad_token_id, and setting its "
                f"pad_token to the EOS token {eos_token!r} did not give it one; set its pad_token_id"
            )
    return tokenizer


def _template_text(template: Any) -> str:
    """A chat template as one string; tokenizers may hold several named templates."""
    if isinstance(template, str):
        return template
    if isinstance(template, dict):
        return "\n".join(_template_text(value) for value in template.values())
    if isinstance(template, (list, tuple)):
        return "\n".join(_template_text(item.get("template", "") if isinstance(item, dict) else item) for item in template)
    return ""


def chat_template_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[int, str]:
    """Added tokens written literally in the chat template: rendering it feeds them to the model."""
    text = _template_text(getattr(tokenizer, "chat_template", None))
    if not text:
        return {}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i): t.content for i, t in added.items() if t.content and t.content in text}


def used_special_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[int, str]:
    """Special-token ids the trainer feeds the model, each with its role (pad, eos, bos, chat template)."""
    used: dict[int, str] = {}
    for name in ("pad", "eos", "bos"):
        ids = getattr(tokenizer, f"{name}_token_id", None)
        for token_id in ids if isinstance(ids, (list, tuple)) else [ids]:
            if token_id is not None:
                used.setdefault(int(token_id), f"{name} token")
    for token_id in chat_template_tokens(tokenizer):
        used.setdefault(token_id, "chat template token")
    return used


def check_tokenizer_fits(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, role: str) -> None:
    """Compatible means every id the trainer feeds the model has an embedding row: the base vocabulary
    and the special tokens in use. Other added tokens past the embeddings (transformers may add default
    special tokens when it reloads a tokenizer) are never fed, so they only warn. A tokenizer object that
    does not tell its ``vocab_size`` or added tokens (:mod:`comlrl.tokenizers`) is checked on the
    special ids it has."""
    rows = model.get_input_embeddings().num_embeddings
    name = model_name(model)
    remedy = ("pass that model's own tokenizer, or resize the model's embeddings "
              "(model.resize_token_embeddings(len(tokenizer))) before training")
    base = getattr(tokenizer, "vocab_size", None)
    if isinstance(base, int) and base > rows:
        raise ValueError(
            f"the tokenizer given for {role} has {base} tokens but the model {name!r} embeds only {rows}: "
            f"its base-vocabulary ids {rows}..{base - 1} (the first is {token_text(tokenizer, rows)!r}) "
            f"have no embedding row; {remedy}"
        )
    used = used_special_tokens(tokenizer)
    for token_id, kind in sorted(used.items()):
        if not 0 <= token_id < rows:
            raise ValueError(
                f"the {kind} {token_text(tokenizer, token_id)!r} (id {token_id}) of the tokenizer given for "
                f"{role} has no embedding row: the model {name!r} embeds only {rows} tokens (ids 0..{rows - 1}); "
                f"set a token the model embeds instead, or {remedy}"
            )
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    unused = {i: t.content for i, t in added.items() if i >= rows and i not in used}
    if unused:
        listed = ", ".join(f"{text!r} (id {i})" for i, text in sorted(unused.items()))
        logger.warning(
            "the tokenizer given for %s has added tokens beyond the %d embedding rows of the model %r, which "
            "training never feeds it: %s; a prompt that contains one is refused when it is encoded",
            role, rows, name, listed,
        )


def resolve_tokenizers(
    sources: list[Any],
    tokenizer: Any,
    explicit_for_lists: bool,
    agents_given: bool,
    trainer_name: str,
    trust_remote_code: bool = False,
) -> list[PreTrainedTokenizerBase]:
    """One tokenizer per source: given explicitly (one shared, or a matching list) or loaded.

    ``explicit_for_lists`` encodes the MAAC/IAC rule: when ``agents`` is supplied the
    tokenizer must be explicit, even for identifier strings.
    """
    count = len(sources)
    if tokenizer is None:
        if explicit_for_lists and agents_given:
            raise ValueError(
                f"Tokenizer must be provided when using agents: "
                f"{trainer_name} requires an explicit tokenizer when agents is supplied (even as "
                f"strings); pass tokenizer=AutoTokenizer.from_pretrained(...) or a list of {count}"
            )
        tokenizers = []
        for index, source in enumerate(sources):
            if not isinstance(source, str):
                raise ValueError(
                    "Tokenizer(s) must be provided when agents are model objects: "
                    f"agents[{index}] is a loaded model object ({_describe(source)}), so its tokenizer "
                    f"cannot be loaded automatically; pass tokenizer= (one shared tokenizer or a list of {count})"
                )
            tokenizers.append(load_tokenizer(source, trust_remote_code))
        return tokenizers
    if isinstance(tokenizer, (list, tuple)):
        if len(tokenizer) != count:
            raise ValueError(f"tokenizers length must match agents: tokenizer is a list of {len(tokenizer)} but "
                             f"there are {count} agents; give {count}")
        return check_tokenizers(tokenizer, "tokenizer")
    return [check_tokenizer(tokenizer, "tokenizer")] * count


def load_models(
    sources: list[Any],
    tokenizers: list[PreTrainedTokenizerBase],
    device: torch.device | Sequence[torch.device],
    dtype: torch.dtype,
    role: str = "agent",
    trust_remote_code: bool = False,
) -> LoadedModels:
    """Load every source (onto ``device``, or ``device[i]`` when given one per source); repeated
    identifiers and repeated objects become independent copies."""
    devices = [device] * len(sources) if isinstance(device, torch.device) else list(device)
    models: list[PreTrainedModel] = []
    loaded: dict[int, PreTrainedModel] = {}
    by_name: dict[str, PreTrainedModel] = {}
    for index, source in enumerate(sources):
        if isinstance(source, str) and source in by_name:
            model = copy.deepcopy(by_name[source]).to(devices[index])
        elif not isinstance(source, str) and id(source) in loaded:
            model = copy.deepcopy(loaded[id(source)]).to(devices[index])
        else:
            model = load_causal_lm(source, devices[index], dtype, trust_remote_code)
            if isinstance(source, str):
                by_name[source] = model
            else:
                loaded[id(source)] = model
        label = f"{role}_{index}"
        prepare_tokenizer(tokenizers[index], label)
        check_tokenizer_fits(model, tokenizers[index], label)
        models.append(model)
    return LoadedModels(models=models, tokenizers=tokenizers, sources=[model_name(s) for s in sources])
