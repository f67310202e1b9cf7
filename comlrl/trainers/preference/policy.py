"""Building the policy-stage trainer of a preference run (MAGRPO, MAAC or IAC).

The policy trainer shares the preference trainer's agent objects, so the preference
trainer's collection and the policy updates act on the same weights; its reward is the
learned reward model, with the task reward attached as a monitor.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from comlrl.rewards import JointReward

# Fields that belong to the preference trainer alone and never reach the policy config.
PREFERENCE_ONLY = {"reward_weights"}


def policy_classes(rl_algorithm: str) -> tuple[type, type]:
    if rl_algorithm == "magrpo":
        from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

        return MAGRPOTrainer, MAGRPOConfig
    from comlrl.trainers import actor_critic

    if rl_algorithm == "maac":
        return actor_critic.MAACTrainer, actor_critic.MAACConfig
    return actor_critic.IACTrainer, actor_critic.IACConfig


def policy_config(args: Any, config_class: type) -> Any:
    """The policy trainer's config: shared fields copied from ``args``, then ``policy_overrides``."""
    names = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(args.policy_overrides) - names)
    if unknown:
        raise ValueError(
            f"MARLHFConfig.policy_overrides has fields {unknown} that {config_class.__name__} does not define"
        )
    shared = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name in names - PREFERENCE_ONLY}
    shared["disable_tqdm"] = True
    return config_class(**{**shared, **args.policy_overrides})


def critic_arguments(trainer: Any, config: Any, critic_model: Any, critics: Sequence[Any] | None) -> dict[str, Any]:
    """Critic arguments for MAAC/IAC: as given, else ``critic_model_name``, else the first actor's identifier."""
    if trainer.args.rl_algorithm == "magrpo":
        if critic_model is not None or critics is not None or trainer.args.critic_model_name:
            raise ValueError(
                "critic_model, critics and MARLHFConfig.critic_model_name apply only to rl_algorithm 'maac' or 'iac', "
                "not 'magrpo'"
            )
        return {}
    if critic_model is not None or critics is not None:
        return {"critic_model": critic_model, "critics": critics}
    if trainer.args.rl_algorithm == "iac" and not getattr(config, "use_separate_critic", True):
        return {}  # the actors carry their own value heads
    return {"critic_model": trainer.args.critic_model_name or trainer.reward_model_source_for_critic()}


def build_policy_trainer(
    trainer: Any,
    learned_reward: Callable[..., Sequence[float]],
    critic_model: Any = None,
    critics: Sequence[Any] | None = None,
) -> Any:
    trainer_class, config_class = policy_classes(trainer.args.rl_algorithm)
    config = policy_config(trainer.args, config_class)
    policy = trainer_class(
        agents=list(trainer.agents),
        tokenizer=list(trainer.tokenizers),
        reward_func=learned_reward,
        formatters=trainer.formatters,
        external_transition=trainer.external_transition,
        train_dataset=trainer.train_dataset,
        eval_dataset=trainer.eval_dataset,
        callbacks=trainer.callbacks,
        model_config=trainer.model_config,
        args=config,
        **critic_arguments(trainer, config, critic_model, critics),
    )
    policy.reward = JointReward(learned_reward, monitors={"task_reward": trainer.task_reward})
    return policy
