"""CentralizedMAGRPOTrainer: one model writes every role's response in one joint completion.

The rollout, advantages and update are MAGRPO's with one agent (so GRPO over the joint
completions): for each prompt the model samples ``num_generations`` joint completions from the
joint prompt that the collaboration adapter (:mod:`comlrl.rollout.collaboration`) builds from
the roles' own prompts. Only scoring differs: each joint completion is parsed into one response
per role and the task reward is called with per-role lists, exactly as for ``num_agents``
decentralized agents, so the same reward function, evaluation and metrics serve both.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Callable

import torch

from comlrl.data import resolve_formatters
from comlrl.models import entities
from comlrl.rollout.collaboration import (CollaborationAdapter, as_adapter, role_eval_logger, role_samples_callback,
                                          split_completions)
from comlrl.rollout.episodes import Rollout
from comlrl.rollout.rewards import JointReward
from comlrl.trainers.inputs import TrainerInputs, Unpack
from comlrl.trainers.config import reward_call_policy
from comlrl.trainers.reinforce.centralized_config import CentralizedMAGRPOConfig
from comlrl.trainers.reinforce.magrpo import MAGRPOTrainer
from comlrl.training.metrics import Total, pooled_means, this_process
from comlrl.tokenizers import encode


class CentralizedMAGRPOTrainer(MAGRPOTrainer):
    """MAGRPO with one policy for ``num_agents`` roles (``self.num_agents`` is 1: the models; ``self.num_roles`` the roles).

    ``collaboration`` (or 1.4.3's name ``centralized_adapter``) replaces the adapter the config
    describes: a :class:`~comlrl.rollout.collaboration.CollaborationAdapter`, or any object with
    1.4.3's ``build_prompt`` and ``parse_completion``. ``formatters`` are the roles' formatters (one
    callable for all, or one per role). ``metrics_callback`` and ``eval_logger`` receive per-role
    samples and completions, as from decentralized agents.
    """

    config_class = CentralizedMAGRPOConfig
    args: CentralizedMAGRPOConfig

    def __init__(self, agent_model: Any = None, *, args: CentralizedMAGRPOConfig | None = None,
                 collaboration: Any = None, centralized_adapter: Any = None, **inputs: Unpack[TrainerInputs]) -> None:
        """``inputs`` as every trainer's (:class:`~comlrl.trainers.inputs.TrainerInputs`); ``num_agents`` counts
        the roles one model writes."""
        num_agents, agents, tokenizer = inputs.pop("num_agents", None), inputs.get("agents"), inputs.get("tokenizer")
        external_transition = inputs.pop("external_transition", None)
        reward_func, reward_processor = inputs.get("reward_func"), inputs.get("reward_processor")
        formatters = inputs.pop("formatters", None)
        metrics_callback, eval_logger = inputs.pop("metrics_callback", None), inputs.pop("eval_logger", None)
        name = type(self).__name__
        args = args if args is not None else self.config_class()
        if not isinstance(args, self.config_class):
            raise ValueError(f"args must be a {self.config_class.__name__}, got {type(args).__name__}")
        self.num_roles = entities.resolve_num_agents(num_agents, args.num_agents, self.config_class.__name__)
        if agents is not None and (isinstance(agents, (str, bytes)) or len(agents) != 1):
            count = "a string" if isinstance(agents, (str, bytes)) else f"{len(agents)} entries"
            raise ValueError(f"Centralized collaboration requires exactly one actor model: {name} trains one model "
                             f"for its {self.num_roles} roles: agents must be a list of one model, got {count} (the "
                             "roles are num_agents)")
        if isinstance(tokenizer, (list, tuple)) and len(tokenizer) != 1:
            raise ValueError(f"Centralized collaboration requires one actor tokenizer: {name} trains one model: give "
                             f"one tokenizer, got a list of {len(tokenizer)}")
        if external_transition is not None:
            raise ValueError(f"{name} runs one-turn episodes, so external_transition is never called; leave it None")
        if collaboration is not None and centralized_adapter is not None and collaboration is not centralized_adapter:
            raise ValueError("collaboration and centralized_adapter name the same argument (1.4.3 called it "
                             "centralized_adapter); give one of them")
        adapter = collaboration if collaboration is not None else centralized_adapter
        self.collaboration: CollaborationAdapter = (
            as_adapter(adapter, self.num_roles) if adapter is not None else args.collaboration_adapter())
        if reward_func is None:
            raise ValueError(f"reward_func must be callable: {name} needs reward_func (a callable or a list of "
                             "callables), got None")
        # The task reward sees the roles, as it would see decentralized agents.
        role_reward = JointReward(reward_func, args.reward_weights, reward_processor, on_invalid=args.invalid_reward,
                                  num_agents=self.num_roles, call_policy=reward_call_policy(args))
        self.role_formatters = resolve_formatters(formatters, self.num_roles)
        if callable(metrics_callback):
            metrics_callback = role_samples_callback(self.collaboration, metrics_callback, args.parse_failure)
        if callable(eval_logger):
            eval_logger = role_eval_logger(self.collaboration, eval_logger, args.parse_failure)
        # The base counts models: it sees one agent whose formatter writes the joint prompt.
        one_model = copy.copy(args)
        one_model.num_agents = 1
        super().__init__(agent_model=agent_model, num_agents=1, formatters=self.joint_prompt, args=one_model,
                         metrics_callback=metrics_callback, eval_logger=eval_logger, **inputs)
        self.args = args
        self.reward = role_reward

    def joint_prompt(self, row: Mapping[str, Any]) -> str:
        """The model's prompt for ``row``: the adapter's joint prompt over every role's own prompt."""
        role_prompts = []
        for role, formatter in enumerate(self.role_formatters):
            role_name = self.collaboration.names[role]
            try:
                prompt = formatter(row)
            except KeyError as error:
                raise ValueError(f"the row has no field {error.args[0]!r} needed by the formatter of role {role} "
                                 f"({role_name}); fields present: {sorted(row)}") from None
            if not isinstance(prompt, str):
                raise ValueError(f"the formatter of role {role} ({role_name}) returned {type(prompt).__name__}; "
                                 "it must return str")
            role_prompts.append(prompt)
        return self.collaboration.build_prompt(row, role_prompts)

    # ----- stages (rollout, advantages and update: MAGRPO's with one agent) ----------------------------
    def score(self, rollout: Rollout, reward: JointReward | Callable | None = None) -> list[torch.Tensor]:
        """Stage 2: each joint completion parsed into the roles' responses (``parse_failure`` decides what an
        unparsable one gives), then the task reward over per-role lists; ``[num_nodes, num_joint]`` per turn."""
        if reward is not None and not isinstance(reward, JointReward):
            reward = JointReward(reward, num_agents=self.num_roles)
        reward = reward or self.reward
        scores = []
        for turn_number, turn in enumerate(rollout.turns):
            rows = rollout.joint_rows(turn_number)
            responses, _ = split_completions(self.collaboration, rollout.joint_completions(turn_number)[0], rows,
                                             self.args.parse_failure)
            scores.append(reward(responses, rows).reshape(turn.num_nodes, rollout.num_joint))
        return scores

    def rollout_metrics(self, rollout: Rollout, rewards: list[torch.Tensor], total: Total = this_process
                        ) -> dict[str, float]:
        """MAGRPO's metrics with the roles in the agents' places: ``agent_<role>/completion_length`` is the
        role's parsed response in tokens; plus ``joint/completion_length`` and ``collaboration/parse_error_rate``."""
        metrics = super().rollout_metrics(rollout, rewards, total)
        metrics["joint/completion_length"] = metrics.pop("agent_0/completion_length")
        texts: list[str] = []
        rows: list[Any] = []
        for turn in rollout.turns:
            generation = turn.generations[0]
            texts += generation.texts
            rows += [rollout.rows[row] for row in turn.node_rows for _ in range(generation.num_generations)]
        responses, failed = split_completions(self.collaboration, texts, rows, self.args.parse_failure)
        lengths = [torch.tensor([float(len(ids)) for ids in
                                 encode(self.tokenizers[0], role_texts, add_special_tokens=False)["input_ids"]])
                   for role_texts in responses]
        failed_share, *role_lengths = pooled_means([torch.tensor([float(f) for f in failed]), *lengths], total)
        metrics["collaboration/parse_error_rate"] = failed_share
        for role, role_length in enumerate(role_lengths):
            metrics[f"agent_{role}/completion_length"] = role_length
        return metrics

    def compat_settings(self) -> dict[str, Any]:
        return {**super().compat_settings(), "num_roles": self.num_roles,
                "collaboration": self.collaboration.describe()}
