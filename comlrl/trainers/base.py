"""What every trainer that owns its agents shares: entities, data, rewards, optimisers, evaluation, state, export.

The steps and epochs are :class:`~comlrl.trainers.epochs.EpochSteps`'; the loop around them
(checkpoints, signals, failures) is :mod:`comlrl.training.run`, the same for ``train()`` and the flows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from comlrl.models import entities
from comlrl.algorithms.advantages import tree_returns
from comlrl.callbacks import TrainerCallback
from comlrl.data import batches, check_dataset, format_prompt, resolve_formatters
from comlrl.parallel import distributed, sharding
from comlrl.models import lora
from comlrl.parallel.memory import enable_gradient_checkpointing, resolve_precision
from comlrl.training.metrics import Total, pooled_means, pooled_std, this_process
from comlrl.training.mixed_precision import compute_dtype, sampling_models
from comlrl.training.reference import ReferencePolicy, ReferenceTerms, reference_terms
from comlrl.parallel.placement import (AgentMap, devices_of, local_gpus, map_by_device, resolve_placement,
                                       runs_concurrently)
from comlrl.parallel.placement import private_tokenizers as private_copies
from comlrl.errors import NonFiniteTrainingError
from comlrl.models.export import save_pretrained_models
from comlrl.tokenizers import check_can_tokenize, tokenizer_size
from comlrl.rollout.rewards import JointReward
from comlrl.rollout.episodes import Rollout, RolloutSpec, rollout_episodes, score_rollout
from comlrl.rollout.generation import context_length
from comlrl.seeding import capture_rng_state, restore_rng_state, set_seed
from comlrl.trainers.config import RolloutConfig, reward_call_policy
from comlrl.tracking_wandb import wandb_callback
from comlrl.progress import TrainerState
from comlrl.trainers.epochs import EpochSteps, activity
from comlrl.training.optimizer_step import (ModelOptimizer, OptimizerSettings, StepResult,
                                            planned_optimizer_steps)

logger = logging.getLogger(__name__)

MODEL_CONFIG_KEYS = {"dtype", "attn_implementation"}


def resolve_num_samples(num_samples: int | None, num_eval_samples: int | None) -> int | None:
    """``evaluate``'s row count from its two names (``num_samples``, 1.4.3's ``num_eval_samples``)."""
    if num_eval_samples is None:
        return num_samples
    if num_samples is not None and num_samples != num_eval_samples:
        raise ValueError(f"num_samples={num_samples!r} and num_eval_samples={num_eval_samples!r} disagree; "
                         "they name the same setting, give one of them")
    return num_eval_samples


@dataclass
class CallbackSample:
    """One completion as ``metrics_callback`` receives it (the fields 1.4.3's rollout samples had)."""

    agent_idx: int
    prompt: str
    completion: str
    reward: torch.Tensor
    returns: torch.Tensor
    metadata: dict[str, Any]


def check_reward_func(reward_func: Any, trainer_name: str) -> None:
    """A trainer without a reward is refused first of all (comlrl 1.4.3's first check)."""
    if reward_func is None:
        raise ValueError(f"reward_func must be a callable: {trainer_name} needs reward_func (a callable or a list of "
                         "callables), got None")


class MultiAgentTrainer(EpochSteps):
    """Base of the trainers that own their agents. Subclasses set ``config_class`` and ``step_stages``."""

    config_class: type[RolloutConfig] = RolloutConfig
    # The algorithm as the original comlrl's messages name it ("Multi-turn MAGRPO requires ...").
    algorithm_name = "multi-agent"
    tokenizer_explicit_for_lists = False
    data_parallel = distributed.DataParallel()  # one process until __init__ looks at the launch
    # Why this trainer cannot shard its models under an FSDP launch (None: it can).
    fsdp_refusal: str | None = None

    def __init__(
        self,
        agent_model: Any = None,
        agents: Sequence[Any] | None = None,
        num_agents: int | None = None,
        tokenizer: Any = None,
        reward_func: Callable | Sequence[Callable] | None = None,
        reward_processor: Callable[[float], float] | None = None,
        formatters: Callable | Sequence[Callable] | None = None,
        external_transition: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        callbacks: Sequence[TrainerCallback] | None = None,
        model_config: dict[str, Any] | None = None,
        wandb_config: dict[str, Any] | None = None,
        args: RolloutConfig | None = None,
        metrics_callback: Callable[[list[Any]], dict[str, Any]] | None = None,
        eval_logger: Callable[..., Any] | None = None,
        eval_aggregator: Callable[..., dict[str, Any]] | None = None,
        model: Any = None,
    ) -> None:
        """``model`` is ``agent_model`` under its name before comlrl 1.4 (:func:`entities.agent_model_argument`)."""
        self.args = args if args is not None else self.config_class()
        if not isinstance(self.args, self.config_class):
            raise ValueError(f"args must be a {self.config_class.__name__}, got {type(self.args).__name__}")
        self.model_config = self._check_model_config(model_config)
        self._num_agents = entities.resolve_num_agents(num_agents, self.args.num_agents, self.config_class.__name__)
        # Everything cheap is validated before any model is loaded, the original's checks in its order: the
        # agents given at all, the reward, a multi-turn transition; then this library's checks of each value.
        agent_model = entities.agent_model_argument(agent_model, model)
        entities.require_sources(agent_model, agents)
        check_reward_func(reward_func, type(self).__name__)
        if self.args.num_turns > 1 and external_transition is None:
            raise ValueError(f"Multi-turn {self.algorithm_name} requires an external_transition: num_turns="
                             f"{self.args.num_turns} needs external_transition to produce the next turn's prompts")
        sources = entities.resolve_model_list(agent_model, agents, self.num_agents)
        self._model_name = entities.infer_model_name(sources[0])
        self.reward = JointReward(reward_func, self.args.reward_weights, reward_processor,
                                  on_invalid=self.args.invalid_reward, num_agents=self.num_agents,
                                  call_policy=reward_call_policy(self.args))
        for name, hook in (("metrics_callback", metrics_callback), ("eval_logger", eval_logger),
                           ("eval_aggregator", eval_aggregator)):
            if hook is not None and not callable(hook):
                raise ValueError(f"{name} must be callable, got {type(hook).__name__}")
        if eval_dataset is not None:
            check_dataset(eval_dataset, "eval_dataset")
        if external_transition is not None and not callable(external_transition):
            raise ValueError("external_transition must be callable")
        if external_transition is not None and self.args.num_turns == 1 and not self.args.was_given("num_turns"):
            raise ValueError(
                f"external_transition is given but {type(self.args).__name__}.num_turns was left at its default, 1, so the "
                "transition would never run (comlrl 1.4.3's default was 2 turns); set num_turns explicitly")
        self.formatters = resolve_formatters(formatters, self.num_agents)
        self.data_parallel = distributed.current()
        # The dataset may come later (``trainer.train_dataset = ...`` before train()); it is checked when it does.
        self._train_dataset = None
        if train_dataset is not None:
            self.check_train_dataset(train_dataset)
            self._train_dataset = train_dataset
        self.external_transition = external_transition
        # What every rollout of this trainer samples, formats and chains (training and evaluation alike).
        self.rollout_spec = RolloutSpec.from_config(self.args, self.formatters, external_transition)
        self.joint_index = self.rollout_spec.joint_index
        self.eval_dataset = eval_dataset
        # Under data parallelism only rank 0 logs, so trackers see one run.
        self.callbacks: list[TrainerCallback] = list(callbacks or []) if self.data_parallel.is_main else []
        self.wandb_config = wandb_config
        self.metrics_callback = metrics_callback
        self.eval_logger = eval_logger
        self.eval_aggregator = eval_aggregator
        if wandb_config is not None and self.data_parallel.is_main:
            tracker = wandb_callback(wandb_config)  # None (after one warning) without the wandb package
            if tracker is not None:
                self.callbacks.append(tracker)
        self.agent_devices = self.resolve_devices(self.args.device, sources, "device")
        self.device = self.agent_devices[0]
        self.dtype = self.model_config.get("dtype") or resolve_precision(self.args.precision, self.device)
        # bf16 autocast of the log-prob forwards and bf16 sampling copies (precision="bf16-mixed"), else None.
        self.autocast_dtype = compute_dtype(self.args.precision)
        if self.args.lora_rank is not None:
            lora.require_peft()
        self.check_before_loading(sources)
        if self.data_parallel.fsdp is not None:
            sharding.check_shardable(type(self).__name__, self.fsdp_refusal, self.args.lora_rank,
                                     self.agent_devices + list(getattr(self, "critic_devices", [])), self.args.precision)

        set_seed(self.args.seed)
        tokenizers = entities.resolve_tokenizers(
            sources,
            tokenizer,
            explicit_for_lists=self.tokenizer_explicit_for_lists,
            agents_given=agents is not None,
            trainer_name=type(self).__name__,
            trust_remote_code=self.args.trust_remote_code,
        )
        load_devices = sharding.loading_devices(self.data_parallel.fsdp, self.agent_devices)
        loaded = entities.load_models(sources, tokenizers, load_devices, self.dtype, "agent", self.args.trust_remote_code)
        self.agents = self.prepare_agents(loaded.models)
        concurrent = runs_concurrently(self.agent_devices)
        self.tokenizers = private_copies(loaded.tokenizers) if concurrent else loaded.tokenizers
        self.agent_sources = loaded.sources
        # Frozen reference policies of the KL penalty (None without reference_kl_enabled).
        self.references = self.build_references(sources)
        # Per-agent generation and backward passes go through this (see comlrl.parallel.placement.AgentMap).
        self.agent_map: AgentMap = map_by_device
        self.optimizer_settings = OptimizerSettings(
            weight_decay=self.args.weight_decay, lr_scheduler_type=self.args.lr_scheduler_type,
            warmup_steps=self.args.warmup_steps, accumulation_steps=self.args.gradient_accumulation_steps,
            max_grad_norm=self.args.max_grad_norm, data_parallel=self.data_parallel,
        )
        # Every trained model's optimizer, schedule and accumulation, by checkpoint name.
        self.model_optimizers: dict[str, ModelOptimizer] = self.build_agent_optimizers()
        self.state = self.new_state()
        self.evaluator = None  # what the eval_interval cadence calls (use_evaluator); None: evaluate()

    # ----- the agents, as comlrl 1.4.3 (and earlier) code reads them ------------------------------
    @property
    def num_agents(self) -> int:
        """The number of agents (models this trainer trains); assigning it anything but its value is refused."""
        return self._num_agents

    @num_agents.setter
    def num_agents(self, value: int) -> None:
        entities.keep_num_agents(type(self).__name__, self._num_agents, value)

    @property
    def model_name(self) -> str | None:
        """The first agent's model name as comlrl 1.4.3 gave it (:func:`entities.infer_model_name` of its source)."""
        return self._model_name

    @property
    def agent_model_name(self) -> str | None:
        """:attr:`model_name` under the name earlier releases of the original comlrl gave it."""
        return self._model_name

    @property
    def agent_models(self) -> list[Any]:
        """The agents' models in role order (a new list each time; the models are :attr:`agents`)."""
        return list(self.agents)

    # ----- the training data -----------------------------------------------------------------
    @property
    def train_dataset(self) -> Any:
        return self._train_dataset

    @train_dataset.setter
    def train_dataset(self, dataset: Any) -> None:
        """A dataset given after construction is checked as the constructor would, and the learning-rate
        schedules are re-planned over its batches (while no optimizer step has been taken)."""
        if dataset is not None:
            self.check_train_dataset(dataset)
        self._train_dataset = dataset
        components = getattr(self, "model_optimizers", None)
        if dataset is not None and components and not any(c.steps for c in components.values()):
            self.replan_schedules(self.schedule_repeats)

    def check_train_dataset(self, dataset: Any) -> None:
        """Fail early on a dataset that cannot train: too small, rows the formatters cannot read, or
        batches that do not split over the data-parallel processes."""
        check_dataset(dataset, "train_dataset")
        size = self.batch_size_for(len(dataset))
        if len(dataset) < size:
            raise ValueError(
                f"train_dataset has {len(dataset)} rows, fewer than one batch "
                f"(per_device_train_batch_size={size}); lower the batch size"
            )
        for agent, formatter in enumerate(self.formatters):  # a missing field fails now, not mid-run
            format_prompt(formatter, dataset[0], agent, 0)
        self.data_parallel.check_batches(len(dataset), size)

    # ----- construction helpers -------------------------------------------------------------
    def new_state(self) -> TrainerState:
        return TrainerState()

    def check_can_train(self) -> None:
        super().check_can_train()
        self.check_context(self.agents)

    def check_context(self, models: Sequence[torch.nn.Module]) -> None:
        """Every model must leave room for ``max_new_tokens`` in its context: checked before training's or an
        evaluation's first rollout, not at construction (comlrl 1.4.3 builds such a trainer, to inspect it)."""
        for index, model in enumerate(models):
            context = context_length(model)
            if context is not None and self.args.max_new_tokens >= context:
                raise ValueError(
                    f"{type(self.args).__name__}.max_new_tokens={self.args.max_new_tokens} leaves no room for a prompt "
                    f"in the {context}-token context of agent {index}; lower it"
                )

    def resolve_devices(self, requested: Any, sources: list[Any], field_name: str) -> list[torch.device]:
        """Checked devices for ``sources`` from a placement field (see :mod:`comlrl.parallel.placement`)."""
        gpus = local_gpus(self.data_parallel.local_rank, self.data_parallel.local_world_size)
        where = f"{type(self.args).__name__}.{field_name}"
        return resolve_placement(requested, sources, where, gpus, self.args.trust_remote_code)

    def prepare_agents(self, models: list[Any]) -> list[Any]:
        """Memory options on freshly loaded actors, then rank 0's weights to every process (sharded
        over the processes under FSDP)."""
        if self.args.lora_rank is not None:
            args = self.args
            models = [lora.add_adapters(m, args.lora_rank, args.lora_alpha, args.lora_dropout, args.lora_target_modules)
                      for m in models]
        if self.args.gradient_checkpointing:
            enable_gradient_checkpointing(models)
        self.data_parallel.broadcast_parameters(models)
        return sharding.shard_models(models, self.data_parallel.fsdp, self.agent_devices)

    def model_devices(self) -> list[torch.device]:
        return devices_of(list(self.agents) + list(getattr(self, "critics", [])))

    def check_before_loading(self, sources: list[Any]) -> None:
        """Subclass hook: validate what depends on the resolved sources before any model loads."""

    def _check_model_config(self, model_config: dict[str, Any] | None) -> dict[str, Any]:
        model_config = dict(model_config or {})
        unknown = set(model_config) - self.allowed_model_config_keys()
        if unknown:
            raise ValueError(
                f"model_config has unknown keys {sorted(unknown)}; allowed: {sorted(self.allowed_model_config_keys())}"
            )
        return model_config

    def allowed_model_config_keys(self) -> set[str]:
        return set(MODEL_CONFIG_KEYS)

    def build_agent_optimizers(self) -> dict[str, ModelOptimizer]:
        return {f"agent_{i}": self.model_optimizer(f"agent_{i}", agent, agent.parameters(),
                                                   self.args.agent_learning_rate, self.agent_update_passes())
                for i, agent in enumerate(self.agents)}

    def agent_update_passes(self) -> int:
        """Backward passes (micro-batches) of each agent per rollout batch."""
        return 1

    def model_optimizer(self, name: str, module: torch.nn.Module, parameters: Any, learning_rate: float,
                        passes: int) -> ModelOptimizer:
        """The optimizer-step component of one trained model, its schedule planned over the whole run."""
        return ModelOptimizer(name, module, list(parameters), learning_rate, self.planned_steps(passes),
                              self.optimizer_settings, passes)

    def planned_steps(self, passes: int) -> int:
        """Optimizer steps a model with ``passes`` micro-batches per rollout batch takes over the run."""
        return planned_optimizer_steps(self.args.num_train_epochs * self.schedule_repeats, self.batches_per_epoch(),
                                       passes, self.args.gradient_accumulation_steps)

    def replan_schedules(self, repeats: int) -> None:
        """Plan every schedule for ``repeats`` runs of ``num_train_epochs`` (before any step)."""
        self.schedule_repeats = repeats
        for component in self.model_optimizers.values():
            component.replan(self.planned_steps(component.passes))

    def use_reward(self, reward: JointReward) -> JointReward:
        """Train on ``reward`` from now on (a preference run's learned reward); returns the reward it replaces."""
        if not isinstance(reward, JointReward):
            raise TypeError(f"use_reward needs a JointReward, got {type(reward).__name__}")
        previous, self.reward = self.reward, reward
        return previous

    def run_agents_with(self, agent_map: AgentMap, private_tokenizers: bool = False) -> None:
        """Route per-agent work (generation, backward passes) through ``agent_map`` (see
        :data:`comlrl.parallel.placement.AgentMap`); ``private_tokenizers`` gives each agent its own
        tokenizer copies, as work on several threads needs (fast tokenizers are not thread-safe)."""
        self.agent_map = agent_map
        if private_tokenizers:
            self.tokenizers = private_copies(self.tokenizers)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The agents' torch optimizers (owned by their :class:`ModelOptimizer`)."""
        return [self.model_optimizers[f"agent_{i}"].optimizer for i in range(self.num_agents)]

    @property
    def reference_models(self) -> list[Any]:
        """The frozen models of the reference KL, one per agent (``[]`` without ``reference_kl_enabled``), as
        comlrl 1.4.3 named them; a LoRA agent's is the agent itself, read with its adapters off."""
        return [reference.model for reference in self.references or []]

    # ----- the loop ---------------------------------------------------------------------------
    def batch_size_for(self, rows: int) -> int:
        """Prompts per step in this process: ``per_device_train_batch_size``, except that a default (neither it nor
        ``rollout_buffer_size`` given) is capped at the dataset's rows, so a one-row dataset trains."""
        size = self.args.per_device_train_batch_size
        if self.args.was_given("per_device_train_batch_size") or self.args.was_given("rollout_buffer_size"):
            return size
        return max(1, min(size, rows))

    @property
    def batch_size(self) -> int:
        """Prompts per step in this process (:meth:`batch_size_for` the training rows)."""
        dataset = self.train_dataset
        return self.args.per_device_train_batch_size if dataset is None else self.batch_size_for(len(dataset))

    @property
    def global_batch_size(self) -> int:
        """Prompts per step over all data-parallel processes."""
        return self.batch_size * self.data_parallel.world_size

    def batches_per_epoch(self) -> int:
        if self.train_dataset is None:  # planned again when the dataset is set
            return 0
        return len(batches(list(range(len(self.train_dataset))), self.global_batch_size))

    def build_references(self, sources: list[Any]) -> list[ReferencePolicy] | None:
        """The KL penalty's references (:meth:`frozen_references`), None without ``reference_kl_enabled``."""
        if not self.args.reference_kl_enabled:
            return None
        if self.data_parallel.fsdp is not None:
            raise ValueError(f"{type(self.args).__name__}.reference_kl_enabled is not supported yet under an FSDP "
                             "launch; use data parallelism without FSDP or LoRA")
        return self.frozen_references(sources)

    def frozen_references(self, sources: list[Any]) -> list[ReferencePolicy]:
        """One frozen reference per agent (see :mod:`comlrl.training.reference`): ``reference_model`` on
        ``reference_devices``, or, built before any update, the agent's initial weights (a resume rebuilds
        them the same way)."""
        args = self.args
        given = args.reference_model
        models = given if isinstance(given, list) else [given] * self.num_agents
        devices = (self.resolve_devices(args.reference_devices, sources, "reference_devices")
                   if args.reference_devices is not None else self.agent_devices)
        load_kwargs = {"dtype": self.dtype, "trust_remote_code": args.trust_remote_code}
        return [ReferencePolicy.for_agent(agent, model, device, load_kwargs)
                for agent, model, device in zip(self.agents, models, devices)]

    def reference(self, rollout: Rollout) -> ReferenceTerms | None:
        """Stage: every completion's log-probabilities under its agent and its reference, and their KL
        (None without ``reference_kl_enabled``)."""
        if self.references is None:
            return None
        generations = [[turn.generations[agent] for turn in rollout.turns] for agent in range(self.num_agents)]
        return reference_terms(self.agents, self.references, generations, self.args.temperature, self.autocast_dtype)

    def reference_metrics(self, terms: ReferenceTerms | None) -> dict[str, float]:
        """``reference_kl_mean`` (per completion, all agents), per agent, and the penalty ``coef x KL``."""
        if terms is None:
            return {}
        mean = terms.mean_kl()
        metrics = {"reference_kl_mean": mean, "reference_kl_penalty_mean": self.args.reference_kl_coef * mean}
        for agent in range(self.num_agents):
            metrics[f"agent_{agent}/reference_kl"] = terms.mean_kl(agent)
        return metrics

    def rollout(self, rows: list[dict[str, Any]], row_labels: list[int] | None = None) -> Rollout:
        """Stage 1: sample every turn of the episodes starting at ``rows``."""
        for agent in self.agents:
            agent.eval()
        return rollout_episodes(self.sampling_agents(), self.tokenizers, self.rollout_spec, rows, row_labels,
                                self.agent_map, reward=self.reward)

    def sampling_agents(self) -> list[torch.nn.Module]:
        """What rollouts sample from: the agents, or bf16 copies of them under ``precision="bf16-mixed"``."""
        return sampling_models(self.agents, self.autocast_dtype)

    def agents_run_in_turn(self) -> bool:
        """Whether per-agent work runs one agent after another (the default map, agents not on several GPUs)."""
        return self.agent_map is map_by_device and not runs_concurrently(devices_of(self.agents))

    def score(self, rollout: Rollout, reward: JointReward | Callable | None = None) -> list[torch.Tensor]:
        """Stage 2: joint rewards per turn, ``[num_nodes, num_joint]`` each (``reward`` overrides the trainer's)."""
        if reward is not None and not isinstance(reward, JointReward):
            reward = JointReward(reward)
        return score_rollout(rollout, reward or self.reward)

    def rollout_metrics(self, rollout: Any, rewards: list[torch.Tensor], total: Total = this_process
                        ) -> dict[str, float]:
        """Reward and completion-length metrics of a rollout (dropped, NaN rewards left out). ``total`` sums
        the statistics over the processes: a training step's rollouts differ between them, and its metrics are
        over all of their samples, as in one process (an evaluation's rows are the same on every process)."""
        # Per turn, numbered from 1 (as comlrl 1.4.3 names them, one turn included): the mean reward, and
        # the expected return, the undiscounted reward sum from that turn on.
        undiscounted = tree_returns(rewards, 1.0, rollout.parents())
        discounted = [tree_returns(rewards, self.args.discount, rollout.parents())[0]] if len(rewards) > 1 else []
        lengths = [torch.cat([turn.generations[agent].lengths().float() for turn in rollout.turns])
                   for agent in range(self.num_agents)]
        means = pooled_means([*rewards, *undiscounted, *discounted, *lengths], total)
        turns = len(rewards)
        metrics = {"reward_mean": means[0], "reward_std": pooled_std(rewards[0], means[0], total)}
        for turn in range(turns):
            metrics[f"turn_{turn + 1}/reward_mean"] = means[turn]
            metrics[f"turn_{turn + 1}/expected_return"] = means[turns + turn]
        if discounted:
            metrics["return_mean"] = means[2 * turns]
        for agent in range(self.num_agents):
            metrics[f"agent_{agent}/completion_length"] = means[2 * turns + len(discounted) + agent]
        if self.metrics_callback is not None:
            metrics.update(self.callback_metrics(rollout, rewards))
        return metrics

    def callback_metrics(self, rollout: Rollout, rewards: list[torch.Tensor]) -> dict[str, float]:
        """``metrics_callback(samples)`` once per dataset row of ``rollout``, its numbers averaged over the rows.

        ``samples`` is what 1.4.3 passed: one :class:`CallbackSample` per agent, generation and turn
        (``agent_idx``, ``prompt``, ``completion``, ``reward``, ``returns``, ``metadata`` with
        ``turn_idx``, ``generation_idx`` and ``batch_item``). A returned value that is not a number is skipped.
        """
        returns = tree_returns(rewards, self.args.discount, rollout.parents())
        per_row: dict[int, list[CallbackSample]] = {row: [] for row in range(len(rollout.rows))}
        joint = rollout.joint_index
        for turn_number, turn in enumerate(rollout.turns):
            per_node = turn.generations[0].num_generations
            for node, row in enumerate(turn.node_rows):
                for agent in range(self.num_agents):
                    for generation in range(per_node):
                        uses = joint[:, agent] == generation  # the joint samples this completion is part of
                        per_row[row].append(CallbackSample(
                            agent_idx=agent,
                            prompt=turn.prompts[agent][node],
                            completion=turn.generations[agent].texts[node * per_node + generation],
                            reward=rewards[turn_number][node][uses].nanmean().reshape(1).float().cpu(),
                            returns=returns[turn_number][node][uses].nanmean().reshape(1).float().cpu(),
                            metadata={"turn_idx": turn_number, "generation_idx": generation,
                                      "batch_item": rollout.rows[row]},
                        ))
        totals: dict[str, list[float]] = {}
        for samples in per_row.values():
            extra = self.metrics_callback(samples)
            if not isinstance(extra, dict):
                continue
            for key, value in extra.items():
                try:
                    number = float(value)
                except (TypeError, ValueError):
                    continue
                totals.setdefault(str(key), []).append(number)
        return {key: sum(values) / len(values) for key, values in totals.items()}

    def evaluate(self, dataset: Any = None, num_samples: int | None = None,
                 reward: JointReward | None = None, *, num_eval_samples: int | None = None) -> dict[str, float]:
        """Mean joint reward (the trainer's, or ``reward``) on the first ``eval_num_samples`` rows of ``eval_dataset``.

        Runs the trainer's ``rollout`` and ``score`` stages under a fixed seed inside a forked
        RNG (every GPU in use included), so evaluating never changes training. ``num_eval_samples``
        is 1.4.3's name of ``num_samples``. With ``eval_logger`` and ``eval_aggregator`` both given,
        their metrics are added under ``eval/``. The samples whose reward was dropped (``invalid_reward="drop"``)
        are counted in ``eval/reward/dropped``, this evaluation's own count; training's ``reward/dropped``
        never counts them.
        """
        num_samples = resolve_num_samples(num_samples, num_eval_samples)
        dataset = dataset if dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs eval_dataset (given to the trainer or as an argument)")
        check_can_tokenize(self.tokenizers)
        self.check_context(self.agents)
        count = min(num_samples or self.args.eval_num_samples, len(dataset))
        scorer = reward or self.reward
        with activity("evaluate"), scorer.drops_counted_apart() as dropped:
            rollout, [rewards] = self.evaluation_rollout([dataset[i] for i in range(count)], [reward])
            metrics = {**self.rollout_metrics(rollout, rewards), "reward/dropped": float(dropped())}
        metrics.update(scorer.drain_monitor_metrics())
        if self.eval_logger is not None and self.eval_aggregator is not None:
            metrics.update(self.logged_eval_metrics(rollout))
        return {f"eval/{name}": value for name, value in metrics.items()}

    def evaluation_rollout(self, rows: list[Any], rewards: Sequence[JointReward | None]
                           ) -> tuple[Rollout, list[list[torch.Tensor]]]:
        """One rollout of ``rows`` under the evaluation seed, inside a forked RNG (every GPU in use
        included, so training is unaffected), scored by each of ``rewards`` (None: the trainer's)."""
        devices = sorted({d.index or 0 for d in self.model_devices() if d.type == "cuda"})
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.args.seed + 1)
            rollout = self.rollout(rows, row_labels=list(range(len(rows))))
            return rollout, [self.score(rollout, reward) for reward in rewards]

    def sample_rewards(self, dataset: Any, rewards: Sequence[JointReward]) -> list[torch.Tensor]:
        """Every row of ``dataset`` sampled once as :meth:`evaluate` samples, scored by each of ``rewards``:
        the first turn's joint rewards, ``[rows, joint samples]``, per reward (their drops are not training's)."""
        with contextlib.ExitStack() as apart:
            for reward in rewards:
                apart.enter_context(reward.drops_counted_apart())
            _, scored = self.evaluation_rollout([dataset[i] for i in range(len(dataset))], list(rewards))
        return [turns[0] for turns in scored]

    def logged_eval_metrics(self, rollout: Rollout) -> dict[str, Any]:
        """``eval_aggregator(eval_logger(...), num_turns=...)`` on one path per row (the first joint sample
        of every turn, until its episode ends), called as 1.4.3 called them."""
        joint = rollout.joint_index
        completions: list[list[list[str]]] = [[[] for _ in rollout.rows] for _ in range(self.num_agents)]
        for row in range(len(rollout.rows)):
            node = row
            for turn_number, turn in enumerate(rollout.turns):
                per_node = turn.generations[0].num_generations
                for agent in range(self.num_agents):
                    index = node * per_node + int(joint[0, agent])
                    completions[agent][row].append(turn.generations[agent].texts[index])
                if turn_number + 1 == len(rollout.turns):
                    break
                first = node * rollout.num_joint  # the node's first joint sample, whose child is logged next
                spawned = rollout.turns[turn_number + 1].parents  # None: sample k spawned node k
                if spawned is not None and first not in spawned:
                    break  # its episode ended at this turn (early termination)
                node = first if spawned is None else spawned.index(first)
        prompts = [row.get("prompt", "") if isinstance(row, dict) else "" for row in rollout.rows]
        detailed = self.eval_logger(agent_completions_turns=completions, batch_items=list(rollout.rows),
                                    prompts=prompts)
        aggregated = self.eval_aggregator(detailed, num_turns=self.args.num_turns)
        return dict(aggregated or {})

    def record_steps(self, results: dict[str, StepResult | None]) -> dict[str, float]:
        """Count the optimizer steps just taken (``None``: no step) and return their metrics."""
        taken = {name: result for name, result in results.items() if result is not None}
        if taken:
            self.record_nonfinite(sum(result.skipped for result in taken.values()))
        metrics = {}
        for name, result in taken.items():
            metrics[f"{name}/grad_norm"] = result.grad_norm
            metrics[f"{name}/learning_rate"] = result.learning_rate
        return metrics

    def flush_optimizers(self) -> dict[str, float]:
        """Apply every partial accumulation window (end of an epoch): no gradient is left unapplied; the
        steps' metrics join the epoch's last history row, and are returned (for the epoch's last log)."""
        metrics = self.record_steps({name: component.flush() for name, component in self.model_optimizers.items()})
        if metrics and self.state.history:
            self.state.history[-1].update(metrics)
        return metrics

    def record_nonfinite(self, skipped: int) -> None:
        """Count skipped updates; too many in a row stop the run (see ``max_nonfinite_updates``)."""
        self.state.nonfinite_updates += skipped
        self.state.consecutive_nonfinite = self.state.consecutive_nonfinite + 1 if skipped else 0
        if self.state.consecutive_nonfinite >= self.args.max_nonfinite_updates:
            raise NonFiniteTrainingError(
                f"{self.state.consecutive_nonfinite} consecutive optimizer steps had a NaN/inf loss or gradient "
                f"(max_nonfinite_updates={self.args.max_nonfinite_updates}); check the rewards and learning rate"
            )

    # ----- state (see comlrl.checkpointing.runner) -------------------------------------------
    def checkpoint_modules(self) -> dict[str, torch.nn.Module]:
        """Every trained model, by name: their weights are the checkpoint's ``models/<name>.safetensors``."""
        return {f"agent_{i}": agent for i, agent in enumerate(self.agents)}

    def stateful_objects(self) -> dict[str, Any]:
        """The user's objects that keep state of their own (a dataset, callbacks): saved by their state_dict()."""
        objects = {"train_dataset": self.train_dataset, **{f"callback_{i}": c for i, c in enumerate(self.callbacks)}}
        return {name: obj for name, obj in objects.items()
                if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))}

    def state_dict(self, include_rng: bool = True) -> dict[str, Any]:
        """Everything besides the weights that a resume needs to continue exactly: progress, every
        optimizer-step component, the reward's counters, the user's stateful objects, the RNGs.

        Tensors and plain values only. Under FSDP it is a collective: every rank calls it.
        """
        state = {
            "progress": dataclasses.asdict(self.state),
            "optimizers": {name: component.state_dict() for name, component in self.model_optimizers.items()},
            "reward": self.reward.state_dict(),
            "stateful": {name: obj.state_dict() for name, obj in self.stateful_objects().items()},
        }
        if include_rng:
            state["rng"] = capture_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any], where: str = "the checkpoint") -> None:
        """Restore :meth:`state_dict`'s output (weights are loaded separately); the RNGs last."""
        self.state = type(self.state)(**state["progress"])
        missing = sorted(set(self.model_optimizers) - set(state["optimizers"]))
        if missing:
            raise ValueError(f"{where} holds no optimizer state for {missing}")
        for name, component in self.model_optimizers.items():
            component.load_state_dict(state["optimizers"][name], f"{where}, optimizer {name!r}")
        self.reward.load_state_dict(state["reward"])
        for name, obj in self.stateful_objects().items():
            if name in state["stateful"]:
                obj.load_state_dict(state["stateful"][name])
        if "rng" in state:
            restore_rng_state(state["rng"])

    def compat_settings(self) -> dict[str, Any]:
        """Settings that must be equal for a checkpoint's state to continue this run exactly."""
        return {
            "num_agents": self.num_agents,
            "tokenizer_sizes": [tokenizer_size(t) for t in self.tokenizers],
            "train_dataset_rows": len(self.train_dataset),
            "train_batch_size": self.global_batch_size,  # per_device_train_batch_size x processes
            "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
            "seed": self.args.seed,
        }

    def check_resume_progress(self, saved_state: dict[str, Any]) -> None:
        if saved_state["epoch"] > self.args.num_train_epochs:
            raise ValueError(
                f"the checkpoint has completed {saved_state['epoch']} epochs but num_train_epochs is "
                f"{self.args.num_train_epochs}; num_train_epochs counts the whole run, so raise it"
            )

    # ----- export -----------------------------------------------------------------------------
    def save_model(self, output_dir: str | Path) -> Path:
        """Export the actors to ``output_dir/agent_i`` (config, safetensors weights, tokenizer).

        An export, not a checkpoint: optimizer, progress and RNG states are not saved.
        """
        output_dir = Path(output_dir)
        directories = [output_dir / f"agent_{i}" for i in range(self.num_agents)]
        if self.data_parallel.fsdp is not None:  # every rank gathers, rank 0 writes
            sharding.export_models(self.agents, self.tokenizers, directories)
        elif self.data_parallel.is_main:  # LoRA actors: merged weights or adapter files, per lora_save
            agents = [lora.exportable(agent, self.args.lora_save) for agent in self.agents]
            save_pretrained_models(agents, self.tokenizers, directories)
        self.data_parallel.barrier()
        return output_dir
