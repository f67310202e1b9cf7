"""Building the policy-stage trainer of a preference run (MAGRPO, MAAC or IAC) from the user's arguments.

The policy trainer loads and owns the agents (placement, LoRA, data parallelism and their
optimizer-step components included), exactly as it would outside PbRL; the preference run
collects pairs with those same agents and replaces the policy trainer's reward by the learned
reward model, with the task reward attached as a monitor.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Sequence

from comlrl.algorithms.kl import TruncatedSamplingKLWarning


def policy_classes(rl_algorithm: str) -> tuple[type, type]:
    """The policy stage's trainer and config classes (``MARLHFConfig.rl_algorithm``: magrpo, maac or iac)."""
    from comlrl.trainers.algorithms import algorithm

    return algorithm(rl_algorithm).load()


def policy_config(args: Any, config_class: type) -> Any:
    """The policy trainer's config: shared fields copied from ``args``, then ``policy_overrides``.

    Every shared value is copied, but only what the user chose counts as given (``was_given``): the fields
    given to ``args`` and those in ``policy_overrides``. So the policy stage tells a default from a choice
    as its trainer would on its own, e.g. a default batch is capped at the dataset's rows, a chosen one not."""
    names = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(args.policy_overrides) - names)
    if unknown:
        raise ValueError(
            f"MARLHFConfig.policy_overrides has fields {unknown} that {config_class.__name__} does not define"
        )
    shared = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name in names}
    shared["disable_tqdm"] = True
    with warnings.catch_warnings():  # the preference config has warned about its settings already
        warnings.simplefilter("ignore", TruncatedSamplingKLWarning)
        chosen = {name for name in shared if args.was_given(name)} | set(args.policy_overrides)
        return config_class.with_choices({**shared, **args.policy_overrides}, chosen)


def critic_arguments(args: Any, config: Any, critic_model: Any, critics: Sequence[Any] | None,
                     first_actor: str | None) -> dict[str, Any]:
    """Critic arguments for MAAC/IAC: as given, else ``critic_model_name``, else the first actor's identifier."""
    if args.rl_algorithm == "magrpo":
        if critic_model is not None or critics is not None or args.critic_model_name:
            raise ValueError(
                "critic_model, critics and MARLHFConfig.critic_model_name apply only to rl_algorithm 'maac' or 'iac', "
                "not 'magrpo'"
            )
        return {}
    if critic_model is not None or critics is not None:
        return {"critic_model": critic_model, "critics": critics}
    if args.rl_algorithm == "iac" and not getattr(config, "use_separate_critic", True):
        return {}  # the actors carry their own value heads
    source = args.critic_model_name or first_actor
    if not source:
        raise ValueError(
            "rl_algorithm 'maac'/'iac' needs a critic: pass critic_model/critics or set MARLHFConfig.critic_model_name "
            "(the actors are model objects without an identifier)"
        )
    return {"critic_model": source}
