"""FSDP: agents sharded over the data-parallel processes with PyTorch's FSDP2 (``fully_shard``).

Turned on by ``accelerate launch --config_file infra/accelerate/fsdp.yaml`` (accelerate sets
``ACCELERATE_USE_FSDP=true`` and the ``FSDP_*`` variables read by :meth:`FSDPSettings.from_environment`).
Every decoder layer, then the whole model, becomes an FSDP unit over all processes; a rank holds
``1/world_size`` of each parameter, gradient and Adam state. Data still splits as in plain data
parallelism (comlrl/parallel/distributed.py): FSDP's backward reduce-scatters (averages) the gradients,
so sharded models skip ``DataParallel.average_gradients``.

Generation: forwards without autograd (sampling, behaviour log-probabilities) run on gathered
weights. The first one all-gathers every layer and the layers stay gathered until the next
forward with autograd reshards them. Ranks then decode with no collectives, so a rank whose
samples all end early never leaves another waiting, and decoding pays no all-gather per token;
the price is one full copy of the agent's weights (not its gradients or optimizer state) while
sampling.

Value heads and backbones: a value head (``model.value_head``, not a registered submodule) is an
FSDP unit of its own, so a critic's optimizer steps DTensors only. Value forwards call the backbone
(``model.base_model``), not ``model.forward`` where FSDP's root hooks sit, so the backbone runs
those hooks itself when called from outside the model's forward (as torch's
``register_fsdp_forward_method`` does for other methods); value forwards without autograd are
gathered like generation.

Checkpoints and ``save_model`` gather full, unsharded weights and optimizer state to rank 0
(in the ordinary single-process formats); loading broadcasts them from rank 0 and every rank
keeps its shard, so checkpoints move freely between sharded and unsharded runs of any size.
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

from comlrl.tokenizers import save_tokenizer

TRUE_VALUES = ("1", "true", "yes")
FALSE_VALUES = ("0", "false", "no")
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "NO_WRAP")
GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
SCATTER = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def _flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    value = environ.get(name)
    if value is None or value == "":
        return default
    if value.lower() in TRUE_VALUES:
        return True
    if value.lower() in FALSE_VALUES:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean; set it (or its fsdp_config key) to true or false")


@dataclass(frozen=True)
class FSDPSettings:
    """How agents are sharded; read from accelerate's FSDP launch variables."""

    reshard_after_forward: bool = True
    wrap_layers: bool = True
    layer_classes: tuple[str, ...] = ()  # empty: the model's own _no_split_modules

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> FSDPSettings | None:
        """The settings of an accelerate FSDP launch, or None when the launch is not one.

        Unsupported choices fail here, before anything loads, naming the config key to change.
        """
        if not _flag(environ, "ACCELERATE_USE_FSDP", False):
            return None
        version = environ.get("FSDP_VERSION", "1")
        if version != "2":
            raise ValueError(
                f"FSDP_VERSION={version!r}: the trainers shard with FSDP2 (torch.distributed.fsdp.fully_shard); "
                "set fsdp_version: 2 in the accelerate config (infra/accelerate/fsdp.yaml)"
            )
        refused = {
            "FSDP_OFFLOAD_PARAMS": "fsdp_offload_params (CPU offload) is not supported; set it to false",
            "FSDP_CPU_RAM_EFFICIENT_LOADING": "fsdp_cpu_ram_efficient_loading is not supported (every process loads "
                                              "the model on CPU, then shards it); set it to false",
            "FSDP_ACTIVATION_CHECKPOINTING": "fsdp_activation_checkpointing is not read; set it to false and "
                                             "gradient_checkpointing=True in the trainer config",
        }
        for name, reason in refused.items():
            if _flag(environ, name, False):
                raise ValueError(f"{name}=true: {reason}")
        policy = environ.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP") or "TRANSFORMER_BASED_WRAP"
        if policy not in WRAP_POLICIES:
            raise ValueError(f"FSDP_AUTO_WRAP_POLICY={policy!r} is not supported; use one of {list(WRAP_POLICIES)}")
        classes = environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "")
        return cls(
            reshard_after_forward=_flag(environ, "FSDP_RESHARD_AFTER_FORWARD", True),
            wrap_layers=policy == "TRANSFORMER_BASED_WRAP",
            layer_classes=tuple(name.strip() for name in classes.split(",") if name.strip()),
        )


def is_sharded(module: torch.nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def holds_shards(module: torch.nn.Module) -> bool:
    """Whether ``module`` is or contains an FSDP unit (e.g. a model with its value head)."""
    return any(is_sharded(part) for part in module.modules())


def unsharded_parts(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The largest parts of ``module`` outside every FSDP unit: whose gradients still need averaging."""
    if is_sharded(module):
        return []
    if not holds_shards(module):
        return [module]
    return [part for child in module.children() for part in unsharded_parts(child)]


def model_class(module: torch.nn.Module) -> type:
    """The model's own class (``fully_shard`` swaps in a subclass named ``FSDP<class>``)."""
    if is_sharded(module):
        return next(base for base in type(module).__bases__ if base is not FSDPModule)
    return type(module)


def check_shardable(trainer_name: str, refusal: str | None, lora_rank: int | None,
                    devices: Sequence[torch.device], precision: str = "auto") -> None:
    """What an FSDP launch cannot do, refused before any model loads."""
    advice = "or launch with infra/accelerate/multi_gpu.yaml (every process holds whole agents)"
    if refusal is not None:
        raise ValueError(f"{trainer_name} cannot shard its models with FSDP: {refusal}; {advice}")
    if lora_rank is not None:
        raise ValueError(f"lora_rank={lora_rank} cannot be combined with FSDP yet; drop lora_rank, {advice}")
    if precision == "bf16-mixed":
        raise ValueError("precision='bf16-mixed' cannot be combined with FSDP yet (its bf16 sampling copies are whole "
                         f"models); use precision='bf16', {advice}")
    own = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    placed = sorted({str(device) for device in devices})
    if placed != [str(own)]:
        raise ValueError(
            f"FSDP shards every agent over the processes, each on its own device ({own} here), but the agents are "
            f"placed on {placed}; use device='auto' with one GPU per process (accelerate's num_processes = GPUs)"
        )


# ----- sharding -------------------------------------------------------------------------------
class _GatherForGeneration:
    """Forward pre-hook on a sharded model: keeps layers gathered through forwards without autograd."""

    def __init__(self, model: FSDPModule, layers: list[FSDPModule], reshard_after_forward: bool) -> None:
        self.model = weakref.ref(model)
        self.layers = layers
        self.reshard_after_forward = reshard_after_forward
        self.gathered = False

    def __call__(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if torch.is_grad_enabled() == (not self.gathered):
            return
        if self.gathered:
            self.release()
            return
        # Gathered here, outside inference mode: FSDP reuses these buffers in training forwards,
        # and buffers first allocated inside inference_mode could never be written outside it.
        with torch.inference_mode(False):
            for layer in self.layers:
                layer.set_reshard_after_forward(False, recurse=False)
                layer.unshard()
            self.model().unshard()  # the root keeps its weights gathered after forwards anyway
        self.gathered = True

    def release(self) -> None:
        """Back to shards: what training forwards, optimizer steps and checkpoints expect."""
        if not self.gathered:
            return
        for layer in self.layers:
            layer.reshard()
            layer.set_reshard_after_forward(self.reshard_after_forward, recurse=False)
        self.model().reshard()
        self.gathered = False


_HOOKS: "weakref.WeakKeyDictionary[torch.nn.Module, _GatherForGeneration]" = weakref.WeakKeyDictionary()


def _layers(model: torch.nn.Module, settings: FSDPSettings) -> list[torch.nn.Module]:
    if not settings.wrap_layers:
        return []
    names = set(settings.layer_classes or getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        source = ("FSDP_TRANSFORMER_CLS_TO_WRAP" if settings.layer_classes
                  else f"{type(model).__name__}._no_split_modules")
        raise ValueError(
            f"no layer of {type(model).__name__} is of a class in {sorted(names)} (from {source}); set "
            "fsdp_transformer_layer_cls_to_wrap to its decoder layer class, or fsdp_auto_wrap_policy: NO_WRAP"
        )
    return layers


@functools.cache
def _mesh(device_type: str) -> DeviceMesh:
    """All processes, one mesh for every agent (one process group, not one per model)."""
    return init_device_mesh(device_type, (dist.get_world_size(),))


def shard_model(model: torch.nn.Module, settings: FSDPSettings, device: torch.device) -> torch.nn.Module:
    """``fully_shard`` every decoder layer, then the model, over all processes; the shards land on ``device``."""
    if is_sharded(model):
        return model
    mesh = _mesh(device.type)
    layers = _layers(model, settings)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=settings.reshard_after_forward)
    fully_shard(model, mesh=mesh)  # the root keeps FSDP's default: gathered from forward to backward
    hook = _GatherForGeneration(model, layers, settings.reshard_after_forward)
    model.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)
    _HOOKS[model] = hook
    _route_backbone_through_root(model, hook)
    return model


def loading_devices(settings: FSDPSettings | None, devices: Sequence[torch.device]) -> list[torch.device]:
    """Where freshly loaded models go: CPU when they are about to be sharded (sharding moves each
    process's shards to its device), else their placement."""
    return [torch.device("cpu")] * len(devices) if settings is not None else list(devices)


def shard_models(models: list[torch.nn.Module], settings: FSDPSettings | None,
                 devices: Sequence[torch.device]) -> list[torch.nn.Module]:
    """Each model sharded onto its device under an FSDP launch (``settings``); unchanged otherwise."""
    if settings is None:
        return models
    return [shard_model(model, settings, device) for model, device in zip(models, devices)]


def shard_module(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """One FSDP unit over all processes for a small module called on its own (a value head)."""
    return shard_model(module, FSDPSettings(wrap_layers=False), device)


def _route_backbone_through_root(model: FSDPModule, hook: _GatherForGeneration) -> None:
    """A call of ``model.base_model`` from outside ``model.forward`` runs the root's FSDP hooks (and the
    gather hook) around it, so its root weights are gathered and its gradients reduced as in a full forward."""
    backbone = getattr(model, "base_model", model)
    if backbone is model:
        return
    state = model._get_fsdp_state()
    entered: list[bool] = []

    def before(module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        if state._training_state != TrainingState.IDLE:
            return None  # inside the model's own forward: its hooks already ran
        hook(model, args, kwargs)
        entered.append(True)
        return state._pre_forward(model, args, kwargs)

    def after(module: torch.nn.Module, args: Any, output: Any) -> Any:
        if not entered:
            return None
        entered.pop()
        return state._post_forward(model, args, output)

    backbone.register_forward_pre_hook(before, prepend=True, with_kwargs=True)
    backbone.register_forward_hook(after)


def _release(model: torch.nn.Module) -> None:
    """Every FSDP unit in ``model`` back to shards (see :meth:`_GatherForGeneration.release`)."""
    for part in model.modules():
        hook = _HOOKS.get(part)
        if hook is not None:
            hook.release()


# ----- full state in, full state out (every rank calls these: they are collectives) ---------------
def _aliases(model: torch.nn.Module) -> dict[str, str]:
    """Tied parameters: every other name of a parameter -> its first name (``lm_head.weight`` -> embeddings)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            aliases[name] = first[id(parameter)]
        else:
            first[id(parameter)] = name
    return aliases


def gather_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights on CPU on rank 0 (tied names share one tensor); an empty dict on other ranks."""
    _release(model)
    state = get_model_state_dict(model, options=GATHER)
    for alias, name in _aliases(model).items():
        if alias in state and name in state:
            state[alias] = state[name]
    return state


def _on_rank0(produce: Callable[[], Any]) -> Any:
    """``produce()`` on rank 0 (None elsewhere); a failure there is raised on every rank, rather than
    leaving the other ranks waiting in the collective that follows."""
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = produce()
        except (OSError, ValueError, RuntimeError, KeyError) as caught:
            error = caught
    message = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(message, src=0)
    if error is not None:
        raise error
    if message[0] is not None:
        raise ValueError(f"rank 0 failed to read the full state to scatter: {message[0]}")
    return result


def load_model_state(model: torch.nn.Module, read: Callable[[], dict[str, torch.Tensor]]) -> None:
    """Rank 0's ``read()`` (full weights; one name per tied tensor is enough), scattered to every rank's shards."""
    _release(model)

    def complete() -> dict[str, torch.Tensor]:
        state = dict(read())
        for alias, name in _aliases(model).items():
            if alias not in state and name in state:
                state[alias] = state[name]
            elif name not in state and alias in state:
                state[name] = state[alias]
        return state

    set_model_state_dict(model, _on_rank0(complete) or {}, options=SCATTER)


def _parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of every parameter the optimizer holds, in the order ``optimizer.state_dict()`` numbers them."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    return [names[id(parameter)] for group in optimizer.param_groups for parameter in group["params"]]


def gather_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Rank 0: the full optimizer state in ``optimizer.state_dict()``'s format (parameters numbered in
    order), as an unsharded run writes it; other ranks: an empty dict."""
    _release(model)
    full = get_optimizer_state_dict(model, optimizer, options=GATHER)
    if dist.get_rank() != 0:
        return {}
    number = {name: index for index, name in enumerate(_parameter_names(model, optimizer))}
    return {
        "state": {number[name]: value for name, value in full["state"].items()},
        "param_groups": [{**group, "params": [number[name] for name in group["params"]]}
                         for group in full["param_groups"]],
    }


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, read: Callable[[], dict[str, Any]],
                         where: str) -> None:
    """Rank 0's ``read()`` (``optimizer.state_dict()`` format) scattered into every rank's sharded state."""
    _release(model)

    def by_name() -> dict[str, Any]:
        saved = read()
        names = _parameter_names(model, optimizer)
        groups = saved["param_groups"]
        counted = sum(len(group["params"]) for group in groups)
        if counted != len(names) or len(groups) != len(optimizer.param_groups):
            raise ValueError(
                f"{where}: the saved optimizer state covers {counted} parameters in {len(groups)} "
                f"group(s), the model here has {len(names)} in {len(optimizer.param_groups)}"
            )
        return {
            "state": {names[int(index)]: value for index, value in saved["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in groups],
        }

    set_optimizer_state_dict(model, optimizer, _on_rank0(by_name) or {}, options=SCATTER)


def export_models(models: Sequence[torch.nn.Module], tokenizers: Sequence[Any], directories: Sequence[Path]) -> None:
    """``save_model`` for sharded agents: gather each model, rank 0 writes an ordinary Hugging Face directory."""
    for model, tokenizer, directory in zip(models, tokenizers, directories):
        state = gather_model_state(model)
        if dist.get_rank() == 0:
            directory.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(directory, state_dict=state, safe_serialization=True)
            save_tokenizer(tokenizer, directory)


def gather_weights(modules: dict[str, torch.nn.Module]) -> dict[str, Any]:
    """What a checkpoint writes for ``modules``: each sharded model replaced by its gathered full state
    (see :func:`gather_model_state`; a collective), the others passed through as they are."""
    return {name: gather_model_state(module) if is_sharded(module) else module for name, module in modules.items()}
