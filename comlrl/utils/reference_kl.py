"""The original comlrl's reference-KL helper names (``comlrl.utils.reference_kl``), over this package's own
homes: :mod:`comlrl.training.reference` (reference policies) and :mod:`comlrl.algorithms.kl` (the k3 estimator).

The trainers use those homes directly (``reference_kl_enabled`` on any config); these functions are for
code written against comlrl 1.4.3's helpers.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import torch
from transformers import AutoModelForCausalLM

from comlrl.algorithms.kl import k3_token_kl
from comlrl.parallel.placement import check_placement_format, local_gpus, spread_by_size
from comlrl.training.logprobs import token_logprobs
from comlrl.utils.distributed import unwrap_model


def reference_kl_enabled(args: Any) -> bool:
    """Whether ``args`` asks for the reference-KL penalty (False when it has no such field)."""
    return bool(getattr(args, "reference_kl_enabled", False))


def reference_kl_coef(args: Any) -> float:
    """The penalty's weight (0.1 when ``args`` has no such field)."""
    return float(getattr(args, "reference_kl_coef", 0.1))


def validate_reference_kl_config(args: Any, expected_count: int) -> None:
    """``ValueError`` for a negative coefficient, or (when enabled) ``reference_devices`` that do not name
    ``expected_count`` devices (:func:`resolve_reference_devices`)."""
    if reference_kl_coef(args) < 0:
        raise ValueError(f"reference_kl_coef must be >= 0, got {reference_kl_coef(args)}")
    devices = getattr(args, "reference_devices", None)
    if reference_kl_enabled(args) and devices is not None:
        _named(devices, expected_count)


def resolve_reference_devices(args: Any, fallback_devices: Sequence[torch.device],
                              expected_count: int) -> list[torch.device]:
    """One device per reference model: ``args.reference_devices`` (one for all, a one-entry list for all, or
    one each; ``'auto'`` spreads them over this process's GPUs, else the CPU), else the fallbacks.

    As in comlrl 1.4.3, the devices are resolved by name, apart from the agents' and whether or not this
    machine has them (a config written for a GPU machine resolves on a laptop); a trainer with
    ``reference_kl_enabled`` checks that they exist before it places a model there."""
    devices = getattr(args, "reference_devices", None)
    if devices is None:
        return list(fallback_devices)
    return _named(devices, expected_count)


def _named(devices: Any, count: int) -> list[torch.device]:
    """``count`` devices from a placement's names (:func:`~comlrl.parallel.placement.check_placement_format`'s
    shapes; ``torch.device`` entries are taken as their strings)."""
    if count < 1:
        raise ValueError(f"reference_devices count must be >= 1, got {count} models to place")
    if isinstance(devices, str) and devices.lower() == "auto":
        gpus = local_gpus()
        return spread_by_size([1] * count, gpus) if gpus else [torch.device("cpu")] * count
    if isinstance(devices, torch.device):
        devices = str(devices)
    if isinstance(devices, (list, tuple)):
        devices = [str(entry) if isinstance(entry, torch.device) else entry for entry in devices]
        if not devices:
            raise ValueError("reference_devices must be 'auto', a device string or a non-empty list of them, got []")
    problem = check_placement_format(devices, count, "reference_devices")
    if problem:
        raise ValueError(problem)
    names = [devices] if isinstance(devices, str) else list(devices)
    try:
        return [torch.device(name) for name in (names * count if len(names) == 1 else names)]
    except RuntimeError as error:
        raise ValueError(f"reference_devices={devices!r} names no device: {error}") from None


def _frozen(model: Any, device: torch.device) -> Any:
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def _device_per_model(devices: Sequence[torch.device], count: int, what: str) -> Sequence[torch.device]:
    if len(devices) < count:  # IndexError, as indexing the list did in the original
        raise IndexError(f"{count} {what} but only {len(devices)} devices ({list(devices)}); give one device per model")
    return devices


def clone_reference_models(policy_models: Sequence[Any], *, devices: Sequence[torch.device]) -> list[Any]:
    """A frozen copy of each policy model as given (its weights now), on ``devices[i]`` (extra devices unused)."""
    devices = _device_per_model(devices, len(policy_models), "policy models")
    return [_frozen(copy.deepcopy(model), device) for model, device in zip(policy_models, devices)]


def load_reference_models_from_sources(model_sources: Sequence[str], *, devices: Sequence[torch.device],
                                       model_kwargs: Mapping[str, Any] | None = None) -> list[Any]:
    """Each source (hub id or directory) loaded with ``from_pretrained(**model_kwargs)``, frozen, on ``devices[i]``."""
    devices = _device_per_model(devices, len(model_sources), "model sources")
    return [_frozen(AutoModelForCausalLM.from_pretrained(source, **dict(model_kwargs or {})), device)
            for source, device in zip(model_sources, devices)]


def response_token_logprobs(model: Any, sequences: torch.Tensor, attention_mask: torch.Tensor,
                            prompt_len: int, response_len: int) -> torch.Tensor:
    """Log-probability of each response token of ``sequences`` (prompt then response, ``[batch, length]``):
    ``[batch, response_len]``, the tokens at positions ``prompt_len .. prompt_len + response_len - 1``
    (float32, as the trainers' log-probabilities)."""
    logits = unwrap_model(model)(input_ids=sequences, attention_mask=attention_mask).logits
    token_log_probs = token_logprobs(logits[:, :-1, :].float(), sequences[:, 1:])
    start = max(int(prompt_len) - 1, 0)
    return token_log_probs[:, start:start + int(response_len)]


def reference_kl_for_sequence(policy_model: Any, reference_model: Any, sequences: torch.Tensor,
                              attention_mask: torch.Tensor, prompt_len: int, response_len: int) -> torch.Tensor:
    """The k3 estimate of KL(policy || reference) summed over each sequence's response tokens, ``[batch]``
    (CPU, no graph); both models run in eval mode, their modes restored."""
    modes = [(module, module.training) for module in (unwrap_model(policy_model), unwrap_model(reference_model))]
    try:
        for module, _ in modes:
            module.eval()
        with torch.no_grad():
            policy = response_token_logprobs(policy_model, sequences.to(_device(policy_model)),
                                             attention_mask.to(_device(policy_model)), prompt_len, response_len)
            reference = response_token_logprobs(reference_model, sequences.to(_device(reference_model)),
                                                attention_mask.to(_device(reference_model)), prompt_len, response_len)
            per_token = k3_token_kl(policy.to(reference.device), reference)
    finally:
        for module, mode in modes:
            module.train(mode)
    return per_token.sum(dim=-1).detach().cpu()


def _device(model: Any) -> torch.device:
    return next(unwrap_model(model).parameters()).device


__all__ = ["reference_kl_enabled", "reference_kl_coef", "validate_reference_kl_config", "resolve_reference_devices",
           "clone_reference_models", "load_reference_models_from_sources", "response_token_logprobs",
           "reference_kl_for_sequence"]
