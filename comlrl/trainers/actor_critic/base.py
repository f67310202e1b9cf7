"""ActorCriticTrainer: the stages IAC and MAAC share.

An episode is a chain (one completion per agent and turn, ``num_generations=1`` for several
turns; several independent one-turn episodes per prompt otherwise). Each stage is public so
another trainer (MARLHF's policy stage) can drive it with its own reward:

    rollout(rows) -> score(rollout[, reward]) -> critic_inputs(rollout) -> values(inputs, rollout)
    -> reference(rollout) -> advantages(rewards, values, reference, rollout)
    -> update(rollout, inputs, estimates, values, reference)

Subclasses decide which models carry value heads and what each critic reads.

Under FSDP the critics are sharded as the actors are, and every value head is an FSDP unit of
its own (comlrl/parallel/sharding.py); checkpoints and exports hold full, unsharded weights.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from comlrl.models import entities

from comlrl.parallel import sharding
from comlrl.algorithms.advantages import gae, moments, normalize
from comlrl.algorithms.losses import value_loss
from comlrl.rollout.episodes import Rollout
from comlrl.models.export import save_pretrained_models, save_value_head
from comlrl.parallel.memory import enable_gradient_checkpointing
from comlrl.training.metrics import Total, pooled_means, this_process
from comlrl.training.policy_update import backpropagate, dropout_disabled, policy_losses
from comlrl.training.reference import ReferenceTerms
from comlrl.trainers.actor_critic.config import ActorCriticConfig
from comlrl.trainers.actor_critic.critics import CriticInput
from comlrl.trainers.base import MultiAgentTrainer, check_reward_func
from comlrl.trainers.epochs import Stage
from comlrl.models.value_heads import ValueHead, attach_value_head, distinct_sequence_values, sequence_values

# One on-policy pass: the probability ratio is exactly 1, so the PPO clip never binds.
ON_POLICY_CLIP = 0.2


def check_early_termination_alone(trainer_name: str, args: Any, data_parallel: bool) -> None:
    """Refuse early termination under data parallelism: the processes then hold different numbers of
    episodes per turn, and the actor and critic losses are per-process means over them, so the averaged
    gradient would not be the one process's (MAGRPO divides by the mean counts; actor-critic does not yet)."""
    if data_parallel and args.num_turns > 1 and args.early_termination_threshold is not None:
        raise ValueError(f"{trainer_name}: early_termination_threshold={args.early_termination_threshold} cannot be "
                         "combined with data parallelism yet (the processes would weight their episodes unequally); "
                         "unset it or train in one process")


@dataclass
class Estimates:
    """Per value model, ``[num_episodes, num_turns]``: the actors' advantages and the critic's targets."""

    advantages: list[torch.Tensor]
    returns: list[torch.Tensor]
    # Per agent, when the reference KL shapes each agent's advantage (None: the value model's serve).
    agent_advantages: list[torch.Tensor] | None = None

    def for_agent(self, agent: int, value_model: int) -> torch.Tensor:
        return self.agent_advantages[agent] if self.agent_advantages is not None else self.advantages[value_model]


def episode_matrix(per_turn: Sequence[torch.Tensor], rows: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """Per-turn tensors (``[num_nodes, num_generations]`` or ``[rows]``) as ``[num_episodes, num_turns]``.

    ``rows[t]`` (:meth:`Rollout.episode_rows`) gives the episode of each of turn ``t``'s rows when early
    termination ended some episodes: the turns an episode did not reach hold NaN."""
    if rows is None:
        return torch.stack([turn.reshape(-1).float().cpu() for turn in per_turn], dim=1)
    matrix = torch.full((len(rows[0]), len(per_turn)), float("nan"))
    for turn, (values, episodes) in enumerate(zip(per_turn, rows)):
        matrix[episodes, turn] = values.reshape(-1).float().cpu()
    return matrix


def reached(rows: Sequence[torch.Tensor] | None, num_episodes: int, num_turns: int) -> torch.Tensor | None:
    """``[num_episodes, num_turns]``: True where an episode reached the turn (None: every episode every turn)."""
    if rows is None:
        return None
    mask = torch.zeros(num_episodes, num_turns, dtype=torch.bool)
    for turn, episodes in enumerate(rows):
        mask[episodes, turn] = True
    return mask


def finish_advantages(estimate: torch.Tensor, standardise: bool, data_parallel: Any = None) -> torch.Tensor:
    """Dropped (NaN) samples to 0, then (``standardise``) zero mean and unit std over the global batch: every
    process's samples when ``data_parallel`` is enabled."""
    valid = ~torch.isnan(estimate)
    estimate = torch.where(valid, estimate, torch.zeros_like(estimate))
    if standardise:
        enabled = data_parallel is not None and data_parallel.enabled
        totals = data_parallel.all_sum(moments(estimate[valid])) if enabled else None
        estimate[valid] = normalize(estimate[valid], totals=totals)
    return estimate


class ActorCriticTrainer(MultiAgentTrainer):
    """Base of IAC and MAAC: actors trained by the critic's advantages, critics by MSE to their targets."""

    config_class = ActorCriticConfig
    args: ActorCriticConfig
    tokenizer_explicit_for_lists = True

    def __init__(
        self,
        agent_model: Any = None,
        agents: Sequence[Any] | None = None,
        num_agents: int | None = None,
        tokenizer: Any = None,
        critic_model: Any = None,
        critics: Sequence[Any] | None = None,
        reward_func: Callable | Sequence[Callable] | None = None,
        *,
        args: ActorCriticConfig | None = None,
        model_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        config = args if args is not None else self.config_class()
        if isinstance(config, self.config_class):  # otherwise the base constructor reports the wrong type
            # comlrl 1.4.3's order for IAC/MAAC: reward_func, then the agents, a multi-turn transition (the
            # base constructor), then the critics (check_before_loading), each before any model loads.
            check_reward_func(reward_func, type(self).__name__)
            entities.resolve_num_agents(num_agents, config.num_agents, self.config_class.__name__)
            self.check_model_config_values(dict(model_config or {}))
        self._critic_arguments = (critic_model, critics)
        self._critic_sources: list[Any] = []  # resolved and placed by check_before_loading
        super().__init__(
            agent_model=agent_model, agents=agents, num_agents=num_agents, tokenizer=tokenizer,
            reward_func=reward_func, args=config, model_config=model_config, **kwargs,
        )
        self.critics = self._load_critics(self._critic_sources)
        self.critic_sources = [entities.model_name(source) for source in self._critic_sources]
        self.attach_value_heads()
        self.model_optimizers = self.build_actor_critic_optimizers()

    @property
    def critic_optimizers(self) -> list[torch.optim.Optimizer]:
        """The separate critics' torch optimizers, in critic order (``[]`` when the actors carry the value heads)."""
        return [self.model_optimizers[name].optimizer for name in self.critic_names()] if self.critics else []

    def build_agent_optimizers(self) -> dict[str, Any]:
        return {}  # built once the value heads exist (build_actor_critic_optimizers)

    def build_actor_critic_optimizers(self) -> dict[str, Any]:
        """One optimizer-step component per actor and per separate critic (backbone and head as two parameter
        groups); an actor that carries its own value head trains both in one."""
        args = self.args
        head_rate = args.value_head_learning_rate or args.critic_learning_rate
        components = {}
        for i, agent in enumerate(self.agents):
            groups = [{"params": list(agent.parameters()), "lr": args.agent_learning_rate}]
            if not self.critics:
                groups.append({"params": list(agent.value_head.parameters()), "lr": head_rate})
            module = agent if self.critics else self._with_head(agent)
            components[f"agent_{i}"] = self.model_optimizer(f"agent_{i}", module, groups, args.agent_learning_rate, 1)
        for name, critic in zip(self.critic_names(), self.critics):
            groups = [{"params": list(critic.parameters()), "lr": args.critic_learning_rate},
                      {"params": list(critic.value_head.parameters()), "lr": head_rate}]
            components[name] = self.model_optimizer(name, self._with_head(critic), groups, args.critic_learning_rate,
                                                    args.critic_update_epochs)
        return components

    # ----- what subclasses decide ------------------------------------------------------------
    def resolve_critic_sources(self, critic_model: Any, critics: Any, config: Any, num_agents: int) -> list[Any]:
        raise NotImplementedError

    def critic_names(self) -> list[str]:
        """Checkpoint and ``save_model`` directory name of each critic."""
        raise NotImplementedError

    def critic_tokenizer_index(self, critic: int) -> int:
        """Which actor's tokenizer critic ``critic`` reads."""
        raise NotImplementedError

    def value_model_for_agent(self, agent: int) -> int:
        """Index into :attr:`value_models` of the critic that values agent ``agent``'s samples."""
        raise NotImplementedError

    def value_head_hidden_dim(self) -> int | None:
        raise NotImplementedError

    def critic_inputs(self, rollout: Rollout) -> list[list[CriticInput]]:
        """``[value_model][turn]``: what each critic reads for every episode of every turn."""
        raise NotImplementedError

    def check_before_loading(self, sources: list[Any]) -> None:
        super().check_before_loading(sources)
        self._critic_sources = self.resolve_critic_sources(*self._critic_arguments, self.args, self.num_agents)
        check_early_termination_alone(type(self).__name__, self.args, self.data_parallel.enabled)
        self.critic_devices = self.critic_placement(self._critic_sources)

    def check_model_config_values(self, model_config: dict[str, Any]) -> None:
        """Validate trainer-specific ``model_config`` values before anything is loaded."""

    # ----- entities -----------------------------------------------------------------------------
    def attach_value_heads(self) -> None:
        """A new head on every value model; under FSDP rank 0's head, sharded over the processes."""
        fsdp = self.data_parallel.fsdp
        devices = self.critic_devices if self.critics else self.agent_devices
        for model, device in zip(self.value_models, devices):
            head = attach_value_head(model, self.value_head_hidden_dim())
            if fsdp is not None:
                self.data_parallel.broadcast_parameters([head])
                sharding.shard_module(head, device)

    @property
    def value_models(self) -> list[torch.nn.Module]:
        """Models that carry a ``value_head``: the critics, or the actors when they share their backbone."""
        return self.critics if self.critics else self.agents

    def value_model_names(self) -> list[str]:
        return self.critic_names() if self.critics else [f"agent_{i}" for i in range(self.num_agents)]

    @property
    def critic_tokenizers(self) -> list[Any]:
        return [self.tokenizers[self.critic_tokenizer_index(k)] for k in range(len(self.critics))]

    def _load_critics(self, sources: list[Any]) -> list[Any]:
        if not sources:
            return []
        # A model object also used as an actor must not become that actor's critic in place.
        sources = [copy.deepcopy(s) if any(s is agent for agent in self.agents) else s for s in sources]
        tokenizers = [self.tokenizers[self.critic_tokenizer_index(k)] for k in range(len(sources))]
        devices = sharding.loading_devices(self.data_parallel.fsdp, self.critic_devices)
        loaded = entities.load_models(sources, tokenizers, devices, self.dtype, "critic", self.args.trust_remote_code)
        if self.args.gradient_checkpointing:
            enable_gradient_checkpointing(loaded.models)
        self.data_parallel.broadcast_parameters(loaded.models)
        return sharding.shard_models(loaded.models, self.data_parallel.fsdp, self.critic_devices)

    def critic_placement(self, sources: list[Any]) -> list[torch.device]:
        """Checked critic devices (before anything loads): ``critic_device``, or each critic beside its actor."""
        if self.args.critic_device is None:
            return [self.agent_devices[self.critic_tokenizer_index(k)] for k in range(len(sources))]
        return self.resolve_devices(self.args.critic_device, sources, "critic_device")

    # ----- stages -------------------------------------------------------------------------------
    @torch.no_grad()
    def values(self, inputs: list[list[CriticInput]], rollout: Rollout | None = None) -> list[torch.Tensor]:
        """Stage 3: every critic's values at rollout time, ``[num_episodes, num_turns]`` per value model (NaN at
        turns an episode did not reach)."""
        rows = rollout.episode_rows() if rollout is not None else None
        result = []
        for model, model_inputs in zip(self.value_models, inputs):
            model.eval()
            result.append(episode_matrix([distinct_sequence_values(model, i.input_ids, i.attention_mask)
                                          for i in model_inputs], rows))
        return result

    def advantages(self, rewards: list[torch.Tensor], values: list[torch.Tensor],
                   reference: ReferenceTerms | None = None, rollout: Rollout | None = None) -> Estimates:
        """Stage 4: the actors' advantages and the critic targets per value model.

        The critic's target is ``G = A_gae + value`` (GAE over turns; one turn: the reward).
        V critic (``critic_type="v"``): the advantage is the GAE estimate, one-step ``r - V(h)``.
        Q critic (``critic_type="q"``): the value ``Q(h, a_i)`` depends on the sampled completion,
        so it cannot be the baseline of that completion (``r - Q(h, a_i)`` goes to 0 as Q fits);
        the advantage is ``G_i - mean_{j != i} Q(h, a_j)`` over the other completions sampled for
        the same prompt (:func:`comlrl.algorithms.advantages.q_critic_advantages`), an
        action-independent baseline, hence ``num_generations >= 2``.

        A dropped (NaN) reward makes its turn's and earlier turns' targets NaN: those samples get
        advantage 0 and are left out of the critic loss (and of the other samples' Q baselines).

        With the reference KL as reward shaping (``reference_kl_mode="reward"``), each actor's advantage is
        its value model's estimate less ``coef x KL`` of its own completion at that turn, before
        standardising; the critics keep learning the task reward (a baseline that ignores the penalty
        leaves the policy gradient unbiased).

        An episode that early termination ended at turn ``t`` has ``V_{t+1} = 0`` (its return is its
        reward from then on); its unreached turns get NaN targets and advantages (left out everywhere).
        """
        from comlrl.algorithms.advantages import q_critic_advantages

        rows = rollout.episode_rows() if rollout is not None else None
        reward_matrix = episode_matrix(rewards, rows)
        alive = reached(rows, reward_matrix.shape[0], reward_matrix.shape[1])
        if alive is not None:  # an ended episode: no reward and no value after its end
            reward_matrix = torch.where(alive, reward_matrix, torch.zeros_like(reward_matrix))
        raw, returns = [], []
        for model_values in values:
            if alive is not None:
                model_values = torch.where(alive, model_values, torch.zeros_like(model_values))
            estimate = gae(reward_matrix, model_values, self.args.discount, self.args.gae_lambda)
            targets = estimate + model_values
            if alive is not None:
                estimate = torch.where(alive, estimate, torch.full_like(estimate, float("nan")))
                targets = torch.where(alive, targets, torch.full_like(targets, float("nan")))
            returns.append(targets)
            if self.args.critic_type == "q":
                estimate = q_critic_advantages(targets, model_values, self.args.num_generations)
            raw.append(estimate)
        def finish(estimate: torch.Tensor) -> torch.Tensor:
            return finish_advantages(estimate, self.args.normalize_advantages, getattr(self, "data_parallel", None))

        advantages = [finish(estimate) for estimate in raw]
        agent_advantages = None
        if reference is not None and self.args.reference_kl_mode == "reward":
            # Each actor's advantage less its own completions' KL penalty (the critics keep the task reward).
            coef = self.args.reference_kl_coef
            agent_advantages = [
                finish(raw[self.value_model_for_agent(agent)] - coef * episode_matrix(reference.kl[agent], rows))
                for agent in range(self.num_agents)
            ]
        return Estimates(advantages=advantages, returns=returns, agent_advantages=agent_advantages)

    def update(
        self,
        rollout: Rollout,
        inputs: list[list[CriticInput]],
        estimates: Estimates,
        old_values: list[torch.Tensor],
        reference: ReferenceTerms | None = None,
    ) -> dict[str, float]:
        """Stage 5: actor policy-gradient and critic value-loss backward passes; each model's
        optimizer-step component steps when its accumulation window is full."""
        metrics: dict[str, float] = {}
        components = self.model_optimizers
        rows = rollout.episode_rows() or [slice(None)] * len(rollout.turns)  # each turn's rows' episodes
        for index, agent in enumerate(self.agents):
            agent.train()
            advantages = estimates.for_agent(index, self.value_model_for_agent(index))
            generations = [turn.generations[index] for turn in rollout.turns]
            kl_loss = reference is not None and self.args.reference_kl_mode == "loss"
            losses = policy_losses(agent, generations, [advantages[rows[t], t] for t in range(len(generations))],
                                   ON_POLICY_CLIP, self.args.temperature, entropy_coef=self.args.entropy_coef,
                                   reference_logprobs=reference.reference[index] if kl_loss else None,
                                   kl_coef=self.args.reference_kl_coef if kl_loss else 0.0,
                                   autocast_dtype=self.autocast_dtype)
            metrics[f"agent_{index}/policy_loss"] = backpropagate(losses, components[f"agent_{index}"].loss_scale)
        steps: dict[str, Any] = {}
        for index, (name, model) in enumerate(zip(self.value_model_names(), self.value_models)):
            model.train()
            component = components[name]
            for _ in range(self.args.critic_update_epochs if self.critics else 1):
                losses = self.critic_losses(model, inputs[index], estimates.returns[index], old_values[index], rows)
                loss = backpropagate(losses, self.args.value_loss_coef * component.loss_scale)
                if self.critics:  # a separate critic: each pass is a micro-batch of its own component
                    steps[name] = component.micro_step() or steps.get(name)
            metrics[f"{name}/value_loss"] = loss
        for index in range(self.num_agents):  # actors (with a shared head: after its value loss too)
            steps[f"agent_{index}"] = components[f"agent_{index}"].micro_step()
        metrics.update(self.record_steps(steps))
        return metrics

    def critic_losses(
        self, model: Any, inputs: list[CriticInput], returns: torch.Tensor, old_values: torch.Tensor,
        rows: Sequence[Any] | None = None,
    ) -> Iterator[torch.Tensor]:
        """One critic's (optionally clipped) MSE per turn, over the turns (their sum is its loss), yielded one
        at a time for the caller's backward. The forward and backward passes run with dropout off, as
        :meth:`values` (the rollout-time values the clipping refers to) runs in eval mode.

        A turn's MSE is over its samples with a target (a dropped reward has none). Under data parallelism
        the processes' gradients are averaged, and their counts of such samples can differ: each process's
        MSE is weighted by its count over the processes' mean count, so that the step is the one a single
        process takes over the whole batch."""
        num_turns = len(inputs)
        episodes = [rows[turn] if rows is not None else slice(None) for turn in range(num_turns)]  # each turn's rows
        valid = [~torch.isnan(returns[episodes[turn], turn]) for turn in range(num_turns)]  # dropped rewards: NaN
        counts = [int(turn_valid.sum()) for turn_valid in valid]
        mean_counts = self.data_parallel.mean_counts(counts)
        with dropout_disabled(model):  # backward too: a checkpointed layer recomputes in the same mode
            for turn, turn_input in enumerate(inputs):
                values = sequence_values(model, turn_input.input_ids, turn_input.attention_mask)
                if counts[turn] == 0:
                    if sharding.holds_shards(model):  # a zero backward: every rank joins the same reduce-scatters
                        yield values.sum() * 0.0
                    continue
                kept = valid[turn].to(values.device)
                targets = returns[episodes[turn], turn].to(values.device)[kept]
                loss = value_loss(values[kept], targets, old_values[episodes[turn], turn].to(values.device)[kept],
                                  self.args.value_clip_range)
                yield loss * (counts[turn] / mean_counts[turn]) / num_turns

    @staticmethod
    def _with_head(model: Any) -> torch.nn.Module:
        """The model and its (unregistered) head as one module, for gradient clipping."""
        return torch.nn.ModuleList([model, model.value_head])

    # rollout -> score -> critic_inputs -> values -> reference -> advantages -> update: run by train_step, one task each by the flows.
    step_stages = (
        Stage("rollout", ("rows",), "rollout", timing="generation_time"),
        Stage("score", ("rollout",), "rewards", timing="reward_time"),
        Stage("critic_inputs", ("rollout",), "critic_inputs", timing="update_time"),
        Stage("values", ("critic_inputs", "rollout"), "values", timing="update_time"),
        Stage("reference", ("rollout",), "reference", timing="update_time"),
        Stage("advantages", ("rewards", "values", "reference", "rollout"), "estimates", timing="update_time"),
        Stage("update", ("rollout", "critic_inputs", "estimates", "values", "reference"), "update_metrics",
              timing="update_time", updates=True),
    )

    def step_metrics(self, values: dict[str, Any]) -> dict[str, float]:
        step_time = time.perf_counter() - values["step_started"]
        rollout = values["rollout"]
        metrics = dict(values["update_metrics"])
        metrics.update(self.rollout_metrics(rollout, values["rewards"], self.data_parallel.all_sum))
        metrics.update(self.critic_metrics(values["values"], values["estimates"], self.data_parallel.all_sum))
        metrics.update(self.reference_metrics(values.get("reference")))
        metrics.update(
            step_time=step_time,
            **{name: values["timings"].get(name, 0.0) for name in ("generation_time", "reward_time", "update_time")},
            tokens_per_second=rollout.generated_tokens() / max(step_time, 1e-9),
        )
        return metrics

    # ----- metrics and evaluation ---------------------------------------------------------------
    def critic_metrics(self, values: list[torch.Tensor], estimates: Estimates, total: Total = this_process
                       ) -> dict[str, float]:
        """Per value model: mean value, and mean absolute error to its target (how well it predicts), over
        every process's samples (``total``: see :meth:`~comlrl.trainers.base.MultiAgentTrainer.rollout_metrics`)."""
        names = self.value_model_names()
        series = [s for model_values, returns in zip(values, estimates.returns)
                  for s in (model_values, (returns - model_values).abs())]
        means = pooled_means(series, total)
        metrics = {}
        for index, name in enumerate(names):
            metrics[f"{name}/value_mean"] = means[2 * index]
            metrics[f"{name}/value_error"] = means[2 * index + 1]
        return metrics

    # ----- checkpoints and export ---------------------------------------------------------------
    def checkpoint_modules(self) -> dict[str, torch.nn.Module]:
        modules = super().checkpoint_modules()
        modules.update(dict(zip(self.critic_names(), self.critics)))
        for name, model in zip(self.value_model_names(), self.value_models):
            modules[f"{name}_value_head"] = model.value_head
        return modules

    def compat_settings(self) -> dict[str, Any]:
        return {
            **super().compat_settings(),
            "critic_type": self.args.critic_type,
            "critics": self.critic_names() if self.critics else [],
            "value_head_hidden_dim": self.value_head_hidden_dim(),
        }

    def save_model(self, output_dir: str | Path) -> Path:
        """Actors to ``agent_i/``, critics to their own directories, every value head as ``value_head.pt``."""
        output_dir = super().save_model(output_dir)
        directories = [output_dir / name for name in self.critic_names()] if self.critics else []
        if self.data_parallel.fsdp is not None:  # every rank gathers, rank 0 writes
            sharding.export_models(self.critics, self.critic_tokenizers, directories)
        elif self.data_parallel.is_main:
            save_pretrained_models(self.critics, self.critic_tokenizers, directories)
        for name, model in zip(self.value_model_names(), self.value_models):
            head = unsharded_head(model.value_head)
            if self.data_parallel.is_main:
                save_value_head(head, output_dir / name)
        self.data_parallel.barrier()
        return output_dir


def unsharded_head(head: ValueHead) -> ValueHead:
    """``head`` itself, or for a sharded one an ordinary copy with its gathered weights on rank 0
    (every rank calls this: it is a collective)."""
    if not sharding.is_sharded(head):
        return head
    state = sharding.gather_model_state(head)
    plain = ValueHead(head.input_size, head.hidden_dim)
    if state:
        plain.load_state_dict(state)
    return plain
