"""The options every iterative preference trainer shares (MADPOIterConfig, MARLHFIterConfig).

Each iteration compares the current policy against a **comparator** (``comparator_policy``),
keeps that iteration's pairs as a **shard** and trains on a **replay** of the shards
(``preference_replay_mode``), logging the reward distribution of the iteration's candidates.
The original comlrl 1.4.3's spellings of the values are accepted and translated (see
:data:`VALUE_ALIASES`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from comlrl.config import not_supported_yet, option
from comlrl.rollout.collaboration import PARSE_FAILURE_POLICIES

COMPARATORS = ("current", "history", "model", "api")
REPLAY_MODES = ("none", "all", "last_k", "lambda_decay")
API_FORMATS = ("chat", "completions")
ORIGINAL_ONLY_API_FORMATS = ("generic", "anthropic", "anthropic_messages", "messages", "openai_responses", "responses",
                             "codex")
# The original's other spellings of a value -> ours.
VALUE_ALIASES = {
    "comparator_policy": {"self": "current", "online": "current", "current_copy": "current", "copy": "current",
                          "online_copy": "current", "checkpoint": "history", "previous": "history",
                          "previous_iteration": "history", "external": "model", "comparator": "model",
                          "reference": "model", "ref": "model", "http": "api", "endpoint": "api"},
    "preference_replay_mode": {"current": "none", "latest": "none", "new": "none", "nearest_k": "last_k",
                               "recent_k": "last_k", "k": "last_k", "all_history": "all", "lambda": "lambda_decay",
                               "td_lambda": "lambda_decay", "td-lambda": "lambda_decay"},
    "comparator_generation_mode": {"decentralised": "decentralized", "multi_agent": "decentralized",
                                   "multi-agent": "decentralized", "centralised": "centralized",
                                   "single_agent": "centralized", "single-agent": "centralized"},
    "comparator_api_format": {"openai": "chat", "openai_chat": "chat", "chat_completions": "chat",
                              "completion": "completions", "openai_completions": "completions"},
}


@dataclass
class IterativeOptions:
    """Comparator, replay and reward-distribution settings of an iterative preference run."""

    comparator_policy: str = option(
        "current", "What the current policy is compared against when pairs are built: 'current' (its own "
        "candidates, compared among themselves), 'history' (the policy as it was comparator_history_k iterations "
        "earlier), 'model' (a local model: comparator_model_name or comparator_agents) or 'api' (an "
        "OpenAI-compatible HTTP endpoint, comparator_api_url). With a comparator, every pair has one candidate "
        "from each side.", choices=COMPARATORS,
        says="comparator_policy must be one of: current, current_copy, model, history, api")
    comparator_history_k: int | None = option(
        None, "comparator_policy='history': compare against the policy at the start of iteration i - k "
        "(the initial policy while i < k; None = 1).", min=1, kind=int, optional=True)
    policy_checkpoint_dir: str | None = option(
        None, "Where the history comparator's per-iteration policy snapshots are written (save_model layout: "
        "iteration_NNNN/agent_i); None = output_dir/policies.", kind=str, optional=True)
    comparator_model_name: str | None = option(
        None, "comparator_policy='model': one model (identifier or directory) that plays every agent's part.",
        kind=str, optional=True)
    comparator_agents: list | None = option(
        None, "comparator_policy='model': one model per agent (identifiers or directories).", kind=list,
        optional=True)
    comparator_devices: str | list | None = option(
        None, "Devices of the comparator models, one for all or one per agent (None = each agent's device).",
        kind=(str, list), optional=True)
    comparator_num_candidates: int | None = option(
        None, "Comparator candidates per prompt (None = as many as the policy samples).", min=1, kind=int,
        optional=True)
    comparator_api_url: str | None = option(
        None, "comparator_policy='api': the endpoint's base URL (e.g. http://host:8000/v1; '/chat/completions' "
        "or '/completions' is appended unless the URL already ends with it).", kind=str, optional=True)
    comparator_api_format: str = option(
        "chat", "comparator_policy='api': 'chat' (POST /chat/completions, the prompt as one user message) or "
        "'completions' (POST /completions, the prompt as text). The original's other formats ('generic', "
        "'anthropic', 'openai_responses') are accepted only while comparator_policy is not 'api'.",
        choices=API_FORMATS + ORIGINAL_ONLY_API_FORMATS)
    comparator_api_model: str | None = option(None, "comparator_policy='api': the 'model' field of each request.",
                                              kind=str, optional=True)
    comparator_api_max_n_per_request: int | None = option(
        None, "comparator_policy='api': at most this many completions per request ('n'); None = all at once.",
        min=1, kind=int, optional=True)
    comparator_api_timeout: float = option(120.0, "comparator_policy='api': seconds to wait for one response.",
                                           min=0.0, min_exclusive=True)
    comparator_api_retries: int = option(
        2, "comparator_policy='api': further attempts after a failed request (timeout, connection error, HTTP "
        "429 or 5xx), waiting comparator_api_retry_backoff x 1, 2, 4 ... seconds between them; other HTTP errors "
        "are not retried.", min=0)
    comparator_api_retry_backoff: float = option(1.0, "comparator_policy='api': seconds before the first retry "
                                                 "(doubling after each).", min=0.0)
    comparator_api_concurrency: int = option(4, "comparator_policy='api': requests in flight at once (one per "
                                             "prompt; completions keep the prompts' order).", min=1)
    comparator_api_headers: dict | None = option(None, "comparator_policy='api': extra HTTP headers.", kind=dict,
                                                 optional=True)
    comparator_api_key: str | None = option(None, "comparator_policy='api': the API key sent in "
                                            "comparator_api_key_header.", kind=str, optional=True)
    comparator_api_key_env: str | None = option(
        None, "comparator_policy='api': the environment variable holding the API key (read at construction).",
        kind=str, optional=True)
    comparator_api_key_header: str = option("Authorization", "comparator_policy='api': the header carrying the key.")
    comparator_api_key_prefix: str = option("Bearer", "comparator_policy='api': text before the key in its header "
                                            "('' = the key alone).")
    comparator_api_extra_body: dict | None = option(None, "comparator_policy='api': extra fields of every request "
                                                    "body.", kind=dict, optional=True)
    comparator_generation_mode: str = option(
        "decentralized", "How the comparator writes a candidate: 'decentralized' (every agent's part sampled from "
        "that agent's prompt by the comparator's model for that agent) or 'centralized' (one model, the one for "
        "agent comparator_centralized_agent_index, writes every agent's part in one joint completion from a joint "
        "prompt, split into the parts by the collaboration adapter: the trainer's centralized_comparator_adapter, "
        "by default the tagged format <agent_i>...</agent_i>). With comparator_policy='current', 'centralized' "
        "compares the policy's candidates against that agent's joint completions.",
        choices=("decentralized", "centralized"),
        says="comparator_generation_mode must be one of: decentralized, centralized")
    comparator_centralized_agent_index: int = option(
        0, "comparator_generation_mode='centralized': whose model writes the joint completions (the policy's "
        "agent, its snapshot, comparator_agents[i], on comparator_devices[i]).", min=0)
    comparator_parse_failure: str = option(
        "partial", "comparator_generation_mode='centralized': a joint completion that does not split into the "
        "agents' parts: 'partial' (each part that could be read is kept, the others are empty), 'empty' (every "
        "part empty) or 'raise' (collection stops with the parse error), as centralized MAGRPO's parse_failure.",
        choices=PARSE_FAILURE_POLICIES)
    comparator_api_response_field: str = not_supported_yet(
        "completions", "Original comlrl's 'generic' API response field; only the OpenAI formats are supported.")
    preference_replay_mode: str = option(
        "none", "Which iterations' pair shards an iteration trains on: 'none' (its own), 'all' (every iteration "
        "so far), 'last_k' (the last preference_replay_k, its own included) or 'lambda_decay' (every shard, "
        "sampled with weight proportional to lambda^age).", choices=REPLAY_MODES,
        says="preference_replay_mode must be one of: current, nearest_k, all_history, lambda_decay")
    preference_replay_k: int | None = option(None, "preference_replay_mode='last_k': how many iterations.", min=1,
                                             kind=int, optional=True)
    preference_replay_lambda: float | None = option(
        None, "preference_replay_mode='lambda_decay': the decay per iteration of age, in [0, 1].", min=0.0,
        max=1.0, kind=(int, float), optional=True, says="preference_replay_lambda must be in [0, 1]")
    preference_replay_sample_size: int | None = option(
        None, "Draw this many pairs (seeded, without replacement while a shard lasts) from the replayed shards "
        "instead of using all of them (None = all; for 'lambda_decay', the current iteration's pair count).",
        min=1, kind=int, optional=True)
    preference_replay_dir: str | None = not_supported_yet(
        None, "Original comlrl's shard folder; here each iteration's shard is output_dir/iteration_i/pairs.parquet "
        "(and in the checkpoint).")
    log_reward_distribution: bool = option(
        True, "Log each iteration's reward distribution (mean, std, min, quartiles, max of the policy's and the "
        "comparator's candidates and of the training pairs) as metrics, and as reward_distribution.json in "
        "output_dir/iteration_i.")


def normalise_values(config: Any) -> None:
    """Translate the original's spellings (``VALUE_ALIASES``) in place, before validation."""
    for name, aliases in VALUE_ALIASES.items():
        value = getattr(config, name, None)
        if isinstance(value, str):
            lowered = value.strip().lower()
            setattr(config, name, aliases.get(lowered, lowered))
    if config.preference_replay_mode == "none" and config.preference_replay_k == 1:
        config.preference_replay_k = None  # the original accepts k=1 with its 'current' mode: the same replay


def iterative_problems(config: Any) -> list[str]:
    """Cross-field rules of :class:`IterativeOptions` (field ranges are checked by ConfigBase)."""
    name = type(config).__name__
    problems = []
    comparator = config.comparator_policy
    model_given = config.comparator_model_name is not None or config.comparator_agents is not None
    if comparator == "model" and not model_given:
        problems.append(f"comparator_model_name or comparator_agents is required when comparator_policy='model' "
                        f"({name})")
    if comparator != "model" and model_given:
        problems.append(f"comparator_model_name and comparator_agents are only valid when comparator_policy='model': "
                        f"{name}.comparator_policy={comparator!r}")
    if config.comparator_model_name is not None and config.comparator_agents is not None:
        problems.append(f"{name}: give comparator_model_name or comparator_agents, not both")
    if config.comparator_agents is not None and len(config.comparator_agents) != config.num_agents:
        problems.append(f"{name}.comparator_agents has {len(config.comparator_agents)} entries for "
                        f"num_agents={config.num_agents}")
    if comparator != "history" and config.comparator_history_k is not None:
        problems.append(f"comparator_history_k is only valid when comparator_policy='history': "
                        f"{name}.comparator_policy={comparator!r}")
    if comparator == "history" and config.policy_checkpoint_dir is None and config.output_dir is None:
        problems.append(f"{name}.comparator_policy='history' keeps per-iteration policy snapshots on disk: set "
                        "output_dir or policy_checkpoint_dir")
    if comparator == "api" and config.comparator_api_format not in API_FORMATS:
        problems.append(f"{name}.comparator_api_format={config.comparator_api_format!r} is not supported yet: the "
                        "comparator endpoint must speak OpenAI's 'chat' or 'completions' format")
    if comparator == "api" and not config.comparator_api_url:
        problems.append(f"comparator_api_url is required when comparator_policy='api' ({name})")
    key_env = config.comparator_api_key_env
    if comparator == "api" and config.comparator_api_key is None and key_env and key_env not in os.environ:
        problems.append(f"{name}.comparator_api_key_env={key_env!r}: that environment variable is not set")
    if comparator != "api" and config.comparator_api_url:
        problems.append(f"{name}.comparator_api_url applies only to comparator_policy='api', got "
                        f"comparator_policy={comparator!r}")
    if config.comparator_api_url and not str(config.comparator_api_url).startswith(("http://", "https://")):
        problems.append(f"{name}.comparator_api_url must start with http:// or https://, got "
                        f"{config.comparator_api_url!r}")
    centralized = config.comparator_generation_mode == "centralized"
    index = config.comparator_centralized_agent_index
    if centralized and isinstance(index, int) and index >= config.num_agents:
        problems.append(f"comparator_centralized_agent_index must be smaller than num_agents: {name}."
                        f"comparator_centralized_agent_index={index} with num_agents={config.num_agents} (agents 0.."
                        f"{config.num_agents - 1})")
    if not centralized and config.comparator_parse_failure != "partial":
        problems.append(f"{name}.comparator_parse_failure={config.comparator_parse_failure!r} applies only to "
                        f"comparator_generation_mode='centralized', got {config.comparator_generation_mode!r}")
    if isinstance(config.comparator_devices, list) and len(config.comparator_devices) != config.num_agents:
        problems.append(f"{name}.comparator_devices has {len(config.comparator_devices)} entries for "
                        f"num_agents={config.num_agents}")
    mode = config.preference_replay_mode
    # Worded as the original (its mode names: 'current' is 'none' here, 'nearest_k' is 'last_k',
    # 'all_history' is 'all'), then our field and values.
    k, replay_lambda = config.preference_replay_k, config.preference_replay_lambda
    seen = f"{name}.preference_replay_mode={mode!r}, preference_replay_k={k!r}, preference_replay_lambda={replay_lambda!r}"
    if mode == "none" and k is not None:
        problems.append(f"preference_replay_k must be null or 1 when preference_replay_mode='current' ({seen})")
    elif mode == "last_k" and k is None:
        problems.append(f"preference_replay_k is required when preference_replay_mode='nearest_k' ({seen})")
    elif mode != "last_k" and k is not None:
        problems.append(f"preference_replay_k is only valid when preference_replay_mode='nearest_k' ({seen})")
    if mode == "lambda_decay" and replay_lambda is None:
        problems.append(f"preference_replay_lambda is required when preference_replay_mode='lambda_decay' ({seen})")
    elif mode != "lambda_decay" and replay_lambda is not None:
        problems.append(f"preference_replay_lambda is only valid when preference_replay_mode='lambda_decay' ({seen})")
    if mode == "none" and config.preference_replay_sample_size is not None:
        problems.append("preference_replay_sample_size is only valid when preference_replay_mode is 'nearest_k', "
                        f"'all_history', or 'lambda_decay' ({name}: replay modes 'last_k', 'all' or 'lambda_decay' "
                        "here, not 'none')")
    return problems


def defaults() -> IterativeOptions:
    """The options' defaults, for configs that do not carry them (MARLHFConfig given to MARLHFIterTrainer)."""
    return IterativeOptions()


def options_of(config: Any) -> Any:
    """``config`` if it carries the iterative options, else their defaults."""
    names = {f.name for f in fields(IterativeOptions)}
    if all(hasattr(config, n) for n in names):
        return config
    return defaults()
