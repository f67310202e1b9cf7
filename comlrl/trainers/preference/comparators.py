"""Comparators of iterative preference training: what the current policy's candidates are paired against.

- ``current`` (no comparator object): the policy's candidates are compared among themselves;
- :class:`HistoryComparator`: the policy as it was ``k`` iterations earlier, from the snapshot
  written (in save_model's layout) at the start of every iteration;
- :class:`ModelComparator`: other local models (one for all agents, or one per agent), frozen;
- :class:`APIComparator`: an OpenAI-compatible HTTP endpoint (``/chat/completions`` or
  ``/completions``), with a timeout and retries; its failures raise :class:`ComparatorAPIError`
  naming the endpoint;
- :class:`CentralizedComparator` (``comparator_generation_mode='centralized'``): one model of the
  above (or the policy's own agent) writes every agent's part in one joint completion.

Every comparator answers ``sample`` (e.g. :meth:`ModelComparator.sample`) with each agent's completions for every prompt, as text and
as token IDs of that agent's tokenizer (the DPO step scores them under the agent), stored as the
policy stores its own: the sampled IDs up to and including EOS (:func:`sampled_ids`), so both sides
of a pair are scored alike, the EOS term included. The history comparator (this run's own agents)
and a model comparator whose tokenizer has the agent's vocabulary and EOS keep the sampled IDs. A
model of another vocabulary, and the API (which returns text), give text: it is tokenized alone with
the agent's tokenizer, without special tokens, and the agent's EOS is appended when the completion
finished (:func:`text_ids`): the model sampled its EOS, or the endpoint answered
``finish_reason="stop"``. A completion cut at the token limit (``"length"``) has no EOS, as the
policy's own. An endpoint that does not say why a completion ended gets no EOS and one warning.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import AutoTokenizer

from comlrl.data import default_formatter, format_prompt
from comlrl.models import entities, lora
from comlrl.models.export import save_pretrained_models
from comlrl.tokenizers import encode, vocabulary
from comlrl.parallel.device import resolve_device
from comlrl.rollout.collaboration import as_adapter, build_adapter, split_completions
from comlrl.rollout.episodes import RolloutSpec, rollout_episodes
from comlrl.rollout.generation import eos_ids

logger = logging.getLogger(__name__)


class ComparatorAPIError(RuntimeError):
    """The comparator endpoint failed (error status, timeout, unreadable answer) after its retries."""


@dataclass
class ComparatorSamples:
    """Every agent's comparator completions: ``texts[agent][node * m + k]`` and the matching token IDs."""

    texts: list[list[str]]
    token_ids: list[list[list[int]]]


def sampled_ids(generation: Any) -> list[list[int]]:
    """The sampled token IDs of each row of a generation (up to and including its EOS)."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(generation.completion_ids.cpu(),
                                                             generation.completion_mask.cpu())]


def ended_with_eos(generation: Any, tokenizer: Any) -> list[bool]:
    """Whether each row of a generation ended with one of ``tokenizer``'s EOS tokens (not at the token limit)."""
    eos = set(eos_ids(tokenizer))
    return [bool(ids) and ids[-1] in eos for ids in sampled_ids(generation)]


def text_ids(tokenizer: Any, texts: Sequence[str], finished: Sequence[bool]) -> list[list[int]]:
    """Completions known only as text, as the policy's generation represents its own: the text's tokens
    (tokenized alone, no special tokens added), then the agent's EOS where the completion finished."""
    eos = eos_ids(tokenizer)
    return [encode(tokenizer, text, add_special_tokens=False)["input_ids"] + (eos[:1] if done else [])
            for text, done in zip(texts, finished, strict=True)]


def same_vocabulary(tokenizer: Any, other: Any) -> bool:
    """Whether IDs sampled with ``other`` are the same tokens to ``tokenizer`` (same vocabulary and EOS); a
    tokenizer that does not tell its vocabulary (no ``get_vocab``) shares it only with itself."""
    if tokenizer is other:
        return True
    mine = vocabulary(tokenizer)
    return mine is not None and eos_ids(tokenizer) == eos_ids(other) and mine == vocabulary(other)


def agent_ids(generation: Any, source_tokenizer: Any, agent_tokenizer: Any) -> list[list[int]]:
    """A comparator model's completions as the agent stores its own: the sampled IDs when the two share a
    vocabulary, else the text re-tokenized for the agent, with its EOS where the model sampled its own."""
    if same_vocabulary(agent_tokenizer, source_tokenizer):
        return sampled_ids(generation)
    return text_ids(agent_tokenizer, generation.texts, ended_with_eos(generation, source_tokenizer))


def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


def comparator_devices(requested: Any, agent_devices: Sequence[torch.device]) -> list[torch.device]:
    """One device per agent: the agents' own, one for all, or one each."""
    if requested is None:
        return list(agent_devices)
    if isinstance(requested, str):
        return [resolve_device(requested)] * len(agent_devices)
    return [resolve_device(device) for device in requested]


class ModelComparator:
    """Frozen local models, one per agent (loaded with the trainer, kept for the run)."""

    kind = "model"

    def __init__(self, sources: Sequence[str], devices: Sequence[torch.device], dtype: torch.dtype,
                 trust_remote_code: bool = False) -> None:
        self.sources = list(sources)
        self.devices = list(devices)
        self.dtype = dtype
        self.trust_remote_code = trust_remote_code
        self.models: list[Any] | None = None
        self.tokenizers: list[Any] | None = None
        if self.sources:  # the history comparator has no sources until an iteration names its snapshot
            self.load()

    def load(self) -> None:
        tokenizers = [entities.prepare_tokenizer(AutoTokenizer.from_pretrained(s, trust_remote_code=self.trust_remote_code),
                                                 f"comparator_{i}") for i, s in enumerate(self.sources)]
        loaded = entities.load_models(self.sources, tokenizers, self.devices, self.dtype, "comparator",
                                      self.trust_remote_code)
        self.models = [_frozen(m) for m in loaded.models]
        self.tokenizers = loaded.tokenizers

    def begin(self, iteration: int, policy: Any) -> None:
        """Nothing to do: the models are loaded at construction and stay (the same every iteration)."""

    def end(self) -> None:
        pass

    def sample(self, policy: Any, spec: RolloutSpec, rows: list[dict[str, Any]], labels: list[int]) -> ComparatorSamples:
        rollout = rollout_episodes(self.models, self.tokenizers, spec, rows, labels, policy.agent_map)
        generations = rollout.turns[0].generations
        return ComparatorSamples(rollout.joint_completions(0),
                                 [agent_ids(generation, own, agent) for generation, own, agent
                                  in zip(generations, self.tokenizers, policy.tokenizers, strict=True)])

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


    def use_output_dir(self, output_dir: Path) -> None:
        """Where the preference run writes its files (this comparator keeps none)."""


class HistoryComparator(ModelComparator):
    """The policy ``k`` iterations ago: at the start of iteration ``i`` the current policy is written to
    ``directory/iteration_{i:04d}`` and the snapshot of iteration ``max(i - k, 0)`` is loaded.

    The snapshots' paths are part of the run's state, so a resumed run (whose output may go to a new
    directory) still finds the earlier ones; a missing one is an error naming it.
    """

    kind = "history"

    def __init__(self, k: int, devices: Sequence[torch.device], dtype: torch.dtype, data_parallel: Any,
                 directory: Path | None = None) -> None:
        super().__init__([], devices, dtype)
        self.k = k
        self.data_parallel = data_parallel
        self.directory = directory  # set by the trainer once its output directory is known
        self.snapshots: dict[int, str] = {}
        self.loaded_from: list[tuple[int, str]] = []  # (iteration, snapshot) of every load, for inspection

    def snapshot(self, iteration: int, policy: Any) -> str:
        """Write the current policy as the policy entering ``iteration`` (merged weights, tokenizers)."""
        if self.directory is None:
            raise RuntimeError("the history comparator has no snapshot directory (set output_dir or "
                               "policy_checkpoint_dir)")
        path = Path(self.directory) / f"iteration_{iteration:04d}"
        if self.data_parallel.is_main:
            agents = [lora.exportable(agent, "merged") for agent in policy.agents]
            save_pretrained_models(agents, policy.tokenizers, [path / f"agent_{i}" for i in range(len(agents))])
        self.data_parallel.barrier()
        self.snapshots[iteration] = str(path)
        return str(path)

    def use_output_dir(self, output_dir: Path) -> None:
        """Policy snapshots go to ``output_dir/policies`` unless a directory was given."""
        if self.directory is None:
            self.directory = Path(output_dir) / "policies"

    def source_iteration(self, iteration: int) -> int:
        """Whose policy iteration ``iteration`` is compared against."""
        return max(iteration - self.k, 0)

    def begin(self, iteration: int, policy: Any) -> None:
        self.snapshot(iteration, policy)
        source = self.source_iteration(iteration)
        path = self.snapshots.get(source)
        if path is None or not all((Path(path) / f"agent_{i}").is_dir() for i in range(policy.num_agents)):
            raise FileNotFoundError(
                f"the history comparator needs the policy snapshot of iteration {source} "
                f"({path or 'never written'}), which is missing; it is written at the start of every iteration "
                "under policy_checkpoint_dir (default output_dir/policies): keep those directories while the run "
                "may resume")
        self.sources = [str(Path(path) / f"agent_{i}") for i in range(policy.num_agents)]
        self.models = [_frozen(entities.load_causal_lm(s, d, self.dtype)) for s, d in zip(self.sources, self.devices)]
        self.tokenizers = policy.tokenizers  # the run's own agents: same vocabularies
        self.loaded_from.append((iteration, path))

    def end(self) -> None:
        self.models, self.tokenizers, self.sources = None, None, []  # free the memory until the next iteration

    def sample(self, policy: Any, spec: RolloutSpec, rows: list[dict[str, Any]], labels: list[int]) -> ComparatorSamples:
        rollout = rollout_episodes(self.models, self.tokenizers, spec, rows, labels, policy.agent_map)
        texts = rollout.joint_completions(0)
        ids = [sampled_ids(generation) for generation in rollout.turns[0].generations]
        return ComparatorSamples(texts, ids)

    def state_dict(self) -> dict[str, Any]:
        return {"snapshots": {str(k): v for k, v in self.snapshots.items()},
                "loaded_from": [[iteration, path] for iteration, path in self.loaded_from]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.snapshots = {int(k): v for k, v in state["snapshots"].items()}
        self.loaded_from = [(int(iteration), path) for iteration, path in state["loaded_from"]]


@dataclass(frozen=True)
class APISettings:
    """How to reach an OpenAI-compatible endpoint; built once from the config (:meth:`from_config`)."""

    url: str
    api_format: str
    model: str | None
    timeout: float
    retries: int
    retry_backoff: float
    concurrency: int
    max_n_per_request: int | None
    headers: dict[str, str]
    extra_body: dict[str, Any]

    @classmethod
    def from_config(cls, options: Any) -> "APISettings":
        base = str(options.comparator_api_url).rstrip("/")
        suffix = "/chat/completions" if options.comparator_api_format == "chat" else "/completions"
        url = base if base.endswith(suffix) else base + suffix
        headers = {"Content-Type": "application/json", **(options.comparator_api_headers or {})}
        key = options.comparator_api_key
        if key is None and options.comparator_api_key_env:
            key = os.environ.get(options.comparator_api_key_env)
            if key is None:
                raise ValueError(f"comparator_api_key_env={options.comparator_api_key_env!r}: that environment "
                                 "variable is not set")
        if key:
            prefix = options.comparator_api_key_prefix.strip()
            headers[options.comparator_api_key_header] = f"{prefix} {key}" if prefix else key
        return cls(url=url, api_format=options.comparator_api_format, model=options.comparator_api_model,
                   timeout=float(options.comparator_api_timeout), retries=int(options.comparator_api_retries),
                   retry_backoff=float(options.comparator_api_retry_backoff),
                   concurrency=int(options.comparator_api_concurrency),
                   max_n_per_request=options.comparator_api_max_n_per_request, headers=headers,
                   extra_body=dict(options.comparator_api_extra_body or {}))


def post_json(settings: APISettings, body: dict[str, Any]) -> Any:
    """POST ``body`` to the endpoint; retries timeouts, connection errors, 429 and 5xx; raises
    :class:`ComparatorAPIError` naming the endpoint when every attempt failed."""
    attempts = settings.retries + 1
    problem = ""
    for attempt in range(attempts):
        request = urllib.request.Request(settings.url, data=json.dumps(body).encode("utf-8"),
                                         headers=settings.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=settings.timeout) as response:
                raw = response.read().decode("utf-8", errors="replace")
            try:
                return json.loads(raw)
            except json.JSONDecodeError:
                raise ComparatorAPIError(f"comparator API {settings.url} answered with non-JSON: {raw[:300]!r}") from None
        except urllib.error.HTTPError as error:
            detail = error.read().decode("utf-8", errors="replace")[:300]
            problem = f"HTTP {error.code} {error.reason}: {detail}"
            if error.code != 429 and error.code < 500:
                raise ComparatorAPIError(
                    f"comparator API {settings.url} refused the request with {problem}; check comparator_api_url, "
                    "comparator_api_model and the key") from None
        except (TimeoutError, socket.timeout):
            problem = f"no answer within comparator_api_timeout={settings.timeout} s"
        except urllib.error.URLError as error:
            timed_out = isinstance(error.reason, (TimeoutError, socket.timeout))
            problem = (f"no answer within comparator_api_timeout={settings.timeout} s" if timed_out
                       else f"connection failed ({error.reason})")
        except (ConnectionError, http.client.HTTPException) as error:
            problem = f"connection failed ({type(error).__name__}: {error})"
        if attempt + 1 < attempts:
            logger.warning("comparator API %s: %s; retrying (%d/%d)", settings.url, problem, attempt + 1,
                           settings.retries)
            time.sleep(settings.retry_backoff * 2 ** attempt)
    raise ComparatorAPIError(
        f"comparator API {settings.url} failed after {attempts} attempt(s): {problem}. Training stopped before this "
        "stage finished; the last checkpoint is intact: resume from it once the endpoint answers")


# finish_reason values: the completion ended on its own (the policy's would end in EOS), or was cut at max_tokens.
FINISHED_REASONS = ("stop", "eos", "eos_token")
CUT_REASONS = ("length", "max_tokens")


@dataclass(frozen=True)
class APICompletion:
    """One choice of an answer: its text and whether it finished (None: the endpoint did not say)."""

    text: str
    finished: bool | None


def answer_choices(settings: APISettings, answer: Any) -> list[APICompletion]:
    """The completions of an OpenAI-format answer (``choices[i].message.content`` or ``choices[i].text``) and
    how each ended (``choices[i].finish_reason``: :data:`FINISHED_REASONS` or :data:`CUT_REASONS`)."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list):
        raise ComparatorAPIError(f"comparator API {settings.url} answered without a 'choices' list: {str(answer)[:300]}")
    completions = []
    for choice in choices:
        message = choice.get("message") if isinstance(choice, dict) else None
        if settings.api_format == "chat" and isinstance(message, dict) and message.get("content") is not None:
            text = str(message["content"])
        elif isinstance(choice, dict) and choice.get("text") is not None:
            text = str(choice["text"])
        else:
            raise ComparatorAPIError(f"comparator API {settings.url}: a choice without text: {str(choice)[:200]}")
        reason = choice.get("finish_reason")
        finished = True if reason in FINISHED_REASONS else False if reason in CUT_REASONS else None
        completions.append(APICompletion(text, finished))
    return completions


class APIComparator:
    """Completions from an OpenAI-compatible endpoint, for every agent's prompt."""

    kind = "api"

    def __init__(self, settings: APISettings) -> None:
        self.settings = settings
        self.warned_unknown_finish = False  # the missing-finish_reason warning is given once per run

    def use_output_dir(self, output_dir: Path) -> None:
        """Where the preference run writes its files (this comparator keeps none)."""

    def begin(self, iteration: int, policy: Any) -> None:
        pass

    def end(self) -> None:
        pass

    def request_body(self, prompt: str, count: int, spec: RolloutSpec) -> dict[str, Any]:
        sampling = spec.sampling
        body: dict[str, Any] = {"n": count, "max_tokens": sampling.max_new_tokens,
                                "temperature": sampling.temperature, "top_p": sampling.top_p}
        if self.settings.model is not None:
            body["model"] = self.settings.model
        if self.settings.api_format == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return {**body, **self.settings.extra_body}

    def completions(self, prompt: str, count: int, spec: RolloutSpec) -> list[APICompletion]:
        completions: list[APICompletion] = []
        while len(completions) < count:
            asked = min(count - len(completions), self.settings.max_n_per_request or count)
            answer = answer_choices(self.settings, post_json(self.settings, self.request_body(prompt, asked, spec)))
            if not answer:
                raise ComparatorAPIError(f"comparator API {self.settings.url} returned no completions (asked n={asked})")
            completions += answer
        return completions[:count]

    def sample(self, policy: Any, spec: RolloutSpec, rows: list[dict[str, Any]], labels: list[int]) -> ComparatorSamples:
        """Every agent's prompt of every row, ``spec.num_generations`` completions each (``concurrency``
        requests at a time; the answers keep the rows' order), stored as the policy's (:func:`text_ids`)."""
        texts, ids, unknown, total = [], [], 0, 0
        with ThreadPoolExecutor(max_workers=self.settings.concurrency) as pool:
            for agent, tokenizer in enumerate(policy.tokenizers):
                prompts = [format_prompt(spec.formatters[agent], row, agent, label) for row, label in zip(rows, labels)]
                answers = pool.map(lambda prompt: self.completions(prompt, spec.num_generations, spec), prompts)
                agent_completions = [completion for answer in answers for completion in answer]
                texts.append([completion.text for completion in agent_completions])
                ids.append(text_ids(tokenizer, texts[-1], [bool(c.finished) for c in agent_completions]))
                unknown += sum(completion.finished is None for completion in agent_completions)
                total += len(agent_completions)
        if unknown and not self.warned_unknown_finish:
            self.warned_unknown_finish = True
            logger.warning(
                "comparator API %s did not say how %d of %d completions ended (no finish_reason 'stop' or 'length'); "
                "they are stored without EOS, as if cut at max_tokens, so a pair against the policy's completions "
                "(which keep their EOS) is scored without the comparator side's EOS term; use an endpoint that "
                "reports finish_reason", self.settings.url, unknown, total)
        return ComparatorSamples(texts, ids)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class CentralizedComparator:
    """One model writes every agent's part of a comparator candidate (comlrl 1.4.3's centralized comparator).

    Per prompt, the collaboration adapter (:mod:`comlrl.rollout.collaboration`, centralized MAGRPO's) builds
    one joint prompt from the agents' own prompts; the model samples joint completions from it, and the
    adapter splits each into the agents' parts (``parse_failure`` decides what one that does not split
    gives). A part is its agent's side of the candidate: its text, tokenized with the agent's tokenizer and
    ended with the agent's EOS (its section was closed). The model is agent ``index``'s: the policy's own
    (``source`` None, comparator_policy 'current'), or ``source.models[source_index]`` of a history or model
    comparator, or the endpoint of an API comparator; ``source`` loads and frees it as it would alone.
    """

    def __init__(self, adapter: Any, index: int, parse_failure: str, source: Any = None, source_index: int = 0) -> None:
        self.adapter = adapter
        self.index = index
        self.parse_failure = parse_failure
        self.source = source
        self.source_index = source_index
        self.kind = f"centralized_{source.kind if source is not None else 'current'}"

    def use_output_dir(self, output_dir: Path) -> None:
        if self.source is not None:
            self.source.use_output_dir(output_dir)

    def begin(self, iteration: int, policy: Any) -> None:
        if self.source is not None:
            self.source.begin(iteration, policy)

    def end(self) -> None:
        if self.source is not None:
            self.source.end()

    def joint_completions(self, policy: Any, spec: RolloutSpec, prompts: list[str], labels: list[int]) -> list[str]:
        """``spec.num_generations`` joint completions of each prompt, prompt by prompt."""
        if isinstance(self.source, APIComparator):
            count = spec.num_generations
            with ThreadPoolExecutor(max_workers=self.source.settings.concurrency) as pool:
                answers = pool.map(lambda prompt: self.source.completions(prompt, count, spec), prompts)
                return [completion.text for answer in answers for completion in answer]
        if self.source is None:
            model, tokenizer = policy.sampling_agents()[self.index], policy.tokenizers[self.index]
        else:
            model, tokenizer = self.source.models[self.source_index], self.source.tokenizers[self.source_index]
        joint_spec = spec.replace(formatters=(default_formatter,))
        rollout = rollout_episodes([model], [tokenizer], joint_spec, [{"prompt": p} for p in prompts], labels,
                                   policy.agent_map)
        return rollout.joint_completions(0)[0]

    def sample(self, policy: Any, spec: RolloutSpec, rows: list[dict[str, Any]], labels: list[int]) -> ComparatorSamples:
        prompts = [self.adapter.build_prompt(row, [format_prompt(formatter, row, agent, label)
                                                   for agent, formatter in enumerate(spec.formatters)])
                   for row, label in zip(rows, labels)]
        joint = self.joint_completions(policy, spec, prompts, list(labels))
        parts, _ = split_completions(self.adapter, joint, [row for row in rows for _ in range(spec.num_generations)],
                                     self.parse_failure)
        return ComparatorSamples(parts, [text_ids(tokenizer, texts, [True] * len(texts))
                                         for tokenizer, texts in zip(policy.tokenizers, parts, strict=True)])

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict() if self.source is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.source is not None:
            self.source.load_state_dict(state)


def build_comparator(options: Any, policy: Any, adapter: Any = None) -> Any:
    """The comparator the options name (None for 'current', decentralized); 'model' loads its models now,
    'history' at each iteration. ``adapter`` is the centralized comparator's collaboration adapter (a
    :class:`~comlrl.rollout.collaboration.CollaborationAdapter` or a 1.4.3 adapter; None: the tagged format)."""
    kind = options.comparator_policy
    centralized = options.comparator_generation_mode == "centralized"
    if adapter is not None and not centralized:
        raise ValueError("centralized_comparator_adapter is used only with comparator_generation_mode='centralized', "
                         f"got {options.comparator_generation_mode!r}; set it, or leave the adapter out")
    index = options.comparator_centralized_agent_index
    devices = comparator_devices(options.comparator_devices, policy.agent_devices)
    source, source_index = None, 0
    if kind == "history":
        source, source_index = HistoryComparator(
            options.comparator_history_k or 1, devices, policy.dtype, policy.data_parallel,
            Path(options.policy_checkpoint_dir) if options.policy_checkpoint_dir else None), index
    elif kind == "model":
        sources = options.comparator_agents or [options.comparator_model_name] * policy.num_agents
        if centralized:  # only the writing agent's model is loaded
            sources, devices = [sources[index]], [devices[index]]
        source = ModelComparator([str(s) for s in sources], devices, policy.dtype, policy.args.trust_remote_code)
    elif kind == "api":
        source = APIComparator(APISettings.from_config(options))
    if not centralized:
        return source
    roles = as_adapter(adapter, policy.num_agents) if adapter is not None else build_adapter(policy.num_agents)
    return CentralizedComparator(roles, index, options.comparator_parse_failure, source, source_index)
