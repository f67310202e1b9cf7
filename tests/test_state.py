"""Every trainer's explicit state is complete: whatever training changes, a resume restores.

Trainer A is snapshotted (every attribute reachable from ``vars(trainer)``), trained to a
checkpoint boundary, and snapshotted again at the moment that checkpoint is written; the paths
whose value changed are the trainer's state. Trainer B, built from the same arguments, resumes
from that checkpoint (``CheckpointRunner.begin``, as ``train(resume_from_checkpoint=...)`` does)
and must hold the same value at every one of those paths, and the same weights in
``checkpoint_modules()``; nor may the resume change any other path (a load that clobbers a
setting). A negative control proves the checker catches a forgotten counter.

The walk descends into plain containers, dataclasses and objects defined in ``comlrl``; torch
modules are compared by the tensors that ``checkpoint_modules()`` does not already cover (e.g.
the preference stage's reward model; not their other attributes, such as the train/eval flag
that every stage sets), optimizers and LR schedulers by ``state_dict()``, HF
datasets by ``to_list()``; tokenizers and callables (user functions, bound methods) are opaque.
An attribute of any other type fails the test until it is classified here.
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
import math
import pathlib
import types
from typing import Any, Callable

import pytest
import torch
from datasets import Dataset

from comlrl.checkpointing.runner import CheckpointRunner
from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl.trainers.preference import (MADPOConfig, MADPOIterConfig, MADPOIterTrainer, MADPOTrainer, MARLHFConfig,
                                        MARLHFIterTrainer, MARLHFTrainer)
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

# Attribute paths (fnmatch patterns on the paths this file prints) that may change in training
# without being restored. Each entry claims that the value does not affect how training continues.
NOT_STATE = {
    "*stop_request": "the SIGTERM/SIGINT flag object of the current train() call; every train() installs a new one",
    "policy_trainer.history_tags": "set by MARLHF's learn_policy from state.iteration before the policy's first step",
    "*_step_guard*": "where an exception would leave the step in progress; between steps (at a checkpoint) it is empty",
    "*_evaluations": "the evaluations this process made (TrainingRun's reports); a resumed process starts a new list",
    "*progress": "the current run's progress bar; every run makes its own",
    "*_epoch_batches": "a cache of the current epoch's batches, recomputed from the seed and the epoch",
}

WORDS = ["cat", "dog", "sun", "moon"]


# ----- snapshots --------------------------------------------------------------------------------
def _owned_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's parameters and buffers, plus those of an unregistered ``value_head`` (comlrl.models.value_heads)."""
    tensors = dict(module.state_dict(keep_vars=True))
    head = module.__dict__.get("value_head")
    if isinstance(head, torch.nn.Module):
        tensors.update({f"value_head.{name}": tensor for name, tensor in head.state_dict(keep_vars=True).items()})
    return tensors


def _covered(trainer: Any) -> set[int]:
    return {id(t) for module in trainer.checkpoint_modules().values() for t in _owned_tensors(module).values()}


def _is_comlrl(value: Any) -> bool:
    """An instance of a class of the ``comlrl`` package (or of a subclass of one, like a test's trainer)."""
    return any(cls.__module__.split(".")[0] == "comlrl" for cls in type(value).__mro__)


def _is_tokenizer(value: Any) -> bool:
    return any(cls.__name__ in ("PreTrainedTokenizerBase", "Tokenizer") for cls in type(value).__mro__)


def _opaque_callable(value: Any) -> bool:
    return isinstance(value, (types.FunctionType, types.MethodType, types.BuiltinFunctionType, type)) or (
        callable(value) and not _is_comlrl(value) and not isinstance(value, torch.nn.Module)
    )


def snapshot(trainer: Any) -> dict[str, Any]:
    """``{attribute path: comparable value}`` for everything reachable from ``vars(trainer)``."""
    flat: dict[str, Any] = {}
    unknown: list[str] = []
    covered = _covered(trainer)

    def leaf(path: str, value: Any) -> None:
        flat[path] = value

    def walk(path: str, value: Any, ancestors: tuple[int, ...]) -> None:
        if id(value) in ancestors:
            leaf(path, "<cycle>")
            return
        inside = ancestors + (id(value),)
        if value is None or isinstance(value, (bool, int, float, str, bytes, complex, enum.Enum, pathlib.PurePath,
                                               torch.device, torch.dtype)):
            leaf(path, value)
        elif isinstance(value, torch.Tensor):
            leaf(path, value.detach().cpu().clone())
        elif isinstance(value, torch.nn.Module):
            leaf(path, f"<module {type(value).__name__}>")
            for name, tensor in _owned_tensors(value).items():
                if id(tensor) not in covered:
                    leaf(f"{path}.<tensor {name}>", tensor.detach().cpu().clone())
        elif isinstance(value, (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)):
            leaf(path, f"<{type(value).__name__}>")
            walk(f"{path}.state_dict()", value.state_dict(), inside)
        elif isinstance(value, torch.Generator):
            leaf(path, value.get_state())
        elif isinstance(value, Dataset):
            leaf(path, f"<Dataset rows={len(value)}>")
            walk(f"{path}.to_list()", value.to_list(), inside)
        elif _is_tokenizer(value):
            leaf(path, f"<tokenizer {type(value).__name__}>")
        elif isinstance(value, dict):
            leaf(path, f"<{type(value).__name__} keys={sorted(map(repr, value))}>")
            for key, item in value.items():
                walk(f"{path}[{key!r}]", item, inside)
        elif isinstance(value, (list, tuple)):
            leaf(path, f"<{type(value).__name__} len={len(value)}>")
            for index, item in enumerate(value):
                walk(f"{path}[{index}]", item, inside)
        elif isinstance(value, (set, frozenset)):
            leaf(path, frozenset(value))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            leaf(path, f"<{type(value).__name__}>")
            for field in dataclasses.fields(value):
                walk(f"{path}.{field.name}", getattr(value, field.name), inside)
        elif _opaque_callable(value):
            leaf(path, f"<callable {getattr(value, '__qualname__', type(value).__qualname__)}>")
        elif _is_comlrl(value) and hasattr(value, "__dict__"):
            leaf(path, f"<{type(value).__name__}>")
            for name, item in vars(value).items():
                walk(f"{path}.{name}" if path else name, item, inside)
        else:
            unknown.append(f"{path}: {type(value).__module__}.{type(value).__qualname__}")

    walk("", trainer, ())
    flat.pop("", None)
    assert not unknown, "attributes of types this test cannot compare (classify them in snapshot()):\n" + \
        "\n".join(unknown)
    return flat


def weights(trainer: Any) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {key: tensor.detach().cpu().clone() for key, tensor in _owned_tensors(module).items()}
            for name, module in trainer.checkpoint_modules().items()}


_MISSING = object()


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return torch.equal(a, b)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def changed_paths(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return sorted(p for p in before.keys() | after.keys()
                  if not same(before.get(p, _MISSING), after.get(p, _MISSING)))


def excluded(path: str) -> bool:
    """``path`` or an attribute it lies under matches a pattern of NOT_STATE."""
    prefixes = [path] + [path[:i] for i, char in enumerate(path) if char in ".[" and i]
    return any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes for pattern in NOT_STATE)


def _shown(value: Any) -> str:
    if value is _MISSING:
        return "<absent>"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _topmost(paths: list[str]) -> list[str]:
    """``paths`` (sorted) without those that lie under another one of them."""
    kept: list[str] = []
    for path in paths:
        if not any(path.startswith(top) and path[len(top)] in ".[" for top in kept):
            kept.append(path)
    return kept


@dataclasses.dataclass
class ResumeReport:
    """What training changed, and where the resumed trainer differs from the trained one (top-most paths)."""

    trainer: str
    changed: list[str]  # every path training changed (NOT_STATE left out)
    missing: dict[str, tuple[Any, Any]]  # changed by training, not restored: {path: (trained, resumed)}
    disturbed: dict[str, tuple[Any, Any]]  # not changed by training, yet different after the resume
    weights_differ: list[str]  # checkpoint_modules() whose weights differ

    @property
    def ok(self) -> bool:
        return not (self.missing or self.disturbed or self.weights_differ)

    def message(self) -> str:
        lines = []
        if self.missing or self.weights_differ:
            lines.append(f"{self.trainer}: a resume from the checkpoint does not restore")
            lines += [f"  {path}: trained {_shown(a)}, resumed {_shown(b)}" for path, (a, b) in self.missing.items()]
            lines += [f"  weights of checkpoint_modules()[{name!r}]" for name in self.weights_differ]
        if self.disturbed:
            lines.append(f"{self.trainer}: the resume changed what training did not")
            lines += [f"  {path}: trained {_shown(a)}, resumed {_shown(b)}" for path, (a, b) in self.disturbed.items()]
        return "\n".join(lines)


def check_resume(build: Callable[[], Any], checkpoint_dir: pathlib.Path, stop_at: int) -> ResumeReport:
    """Train ``build()`` with a checkpoint at every boundary up to boundary ``stop_at``, resume a second
    ``build()`` from that checkpoint, and compare the two (A as it was when the checkpoint was written)."""
    taken: dict[int, tuple[pathlib.Path, dict[str, Any], dict[str, Any]]] = {}
    original_save = CheckpointRunner.save

    class Halt(Exception):
        pass

    def save(runner: CheckpointRunner, name: str | None = None, required: bool = False) -> pathlib.Path | None:
        path = original_save(runner, name, required)
        assert path is not None, "the checkpoint could not be written"
        boundary = runner.trainer.state.boundaries
        taken[boundary] = (path, snapshot(runner.trainer), weights(runner.trainer))
        if boundary == stop_at:
            raise Halt
        return path

    trainer_a = build()
    before = snapshot(trainer_a)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CheckpointRunner, "save", save)
        with pytest.raises(Halt):
            trainer_a.train(checkpoint_dir=checkpoint_dir, checkpoint_interval=1)
    path, after, weights_a = taken[stop_at]
    changed = [p for p in changed_paths(before, after) if not excluded(p)]

    # B: what train(resume_from_checkpoint=path) does before its first step.
    trainer_b = build()
    CheckpointRunner(trainer_b, checkpoint_dir=checkpoint_dir, resume_from_checkpoint=path).begin()
    resumed = snapshot(trainer_b)
    differing = [p for p in changed_paths(after, resumed) if not excluded(p)]
    pair = {p: (after.get(p, _MISSING), resumed.get(p, _MISSING)) for p in differing}
    missing = {p: pair[p] for p in _topmost([p for p in differing if p in set(changed)])}
    disturbed = {p: pair[p] for p in _topmost([p for p in differing if p not in set(changed)])}
    weights_b = weights(trainer_b)
    differ = sorted(name for name in weights_a.keys() | weights_b.keys()
                    if weights_a.get(name, {}).keys() != weights_b.get(name, {}).keys()
                    or not all(same(t, weights_b[name][k]) for k, t in weights_a[name].items()))
    return ResumeReport(type(trainer_a).__name__, changed, missing, disturbed, differ)


# ----- the trainers -----------------------------------------------------------------------------
def sometimes_invalid_reward(completions_0, completions_1):
    """The letters reward, NaN for the first joint sample of every call (dropped under
    invalid_reward='drop'), so the reward's own counter is state that changes."""
    rewards = [0.5 * a.count("e") / max(len(a), 1) + 0.5 * b.count("o") / max(len(b), 1)
               for a, b in zip(completions_0, completions_1)]
    return [math.nan] + rewards[1:]


COMMON = dict(num_agents=2, num_generations=2, max_new_tokens=4, per_device_train_batch_size=2, seed=3,
              disable_tqdm=True, agent_learning_rate=1e-3)
# Two epochs planned, checkpoint after the first: the linear schedule is mid-way, not finished.
DIRECT = dict(COMMON, num_train_epochs=2, lr_scheduler_type="linear", warmup_steps=1, invalid_reward="drop")
# The policy guard off: a guard that restores the policy would leave the optimizer state where it
# began, and the check below wants to see the state move (the guard's own state: test_preference.py).
DPO = dict(COMMON, num_generations=3, num_train_epochs=2, lr_scheduler_type="linear", pair_selection="random",
           invalid_reward="drop")
PREFERENCE = dict(COMMON, preference_num_generations=4, reward_model_device=None, reward_train_epochs=1,
                  reward_batch_size=4, policy_guard=False)


def dataset() -> Dataset:
    return Dataset.from_dict({"prompt": [f"write about the {word}" for word in WORDS]})


def builders(model: str, reward_func: Callable) -> dict[str, tuple[Callable[[], Any], int]]:
    """Each case: a builder (same arguments every call) and the boundary to checkpoint and stop at."""
    direct = dict(agent_model=model, num_agents=2, reward_func=sometimes_invalid_reward)
    return {
        "magrpo": (lambda: MAGRPOTrainer(train_dataset=dataset(), args=MAGRPOConfig(**DIRECT), **direct), 1),
        "maac": (lambda: MAACTrainer(critic_model=model, train_dataset=dataset(), args=MAACConfig(**DIRECT),
                                     **direct), 1),
        "iac-separate": (lambda: IACTrainer(critic_model=model, train_dataset=dataset(),
                                            args=IACConfig(use_separate_critic=True, **DIRECT), **direct), 1),
        "iac-shared": (lambda: IACTrainer(train_dataset=dataset(), args=IACConfig(use_separate_critic=False, **DIRECT),
                                          **direct), 1),
        # collect -> fit -> learn_policy: all three stages of the one iteration.
        "marlhf": (lambda: MARLHFTrainer(agent_model=model, num_agents=2, reward_func=reward_func,
                                         train_dataset=dataset(), args=MARLHFConfig(**PREFERENCE)), 3),
        # Into the second iteration: its pairs collected, the first iteration's reward model and policy stage kept.
        "marlhf-iter": (lambda: MARLHFIterTrainer(agent_model=model, num_agents=2, reward_func=reward_func,
                                                  train_dataset=dataset(),
                                                  args=MARLHFConfig(num_iterations=2, **PREFERENCE)), 4),
        "madpo": (lambda: MADPOTrainer(train_dataset=dataset(), args=MADPOConfig(**DPO), **direct), 1),
        # Into the second iteration (collect, prepare, DPO per iteration): its pairs collected and prepared.
        "madpo-iter": (lambda: MADPOIterTrainer(agent_model=model, num_agents=2, reward_func=reward_func,
                                                train_dataset=dataset(),
                                                args=MADPOIterConfig(num_iterations=2, preference_replay_mode="all",
                                                                     **dict(COMMON, num_generations=3))), 5),
    }


DIRECT_CASES = ["magrpo", "maac", "iac-separate", "iac-shared"]
CASES = DIRECT_CASES + ["marlhf", "marlhf-iter", "madpo", "madpo-iter"]


@pytest.mark.parametrize("case", CASES)
def test_resume_restores_everything_training_changed(case, tiny_llama, reward_func, tmp_path):
    build, stop_at = builders(tiny_llama, reward_func)[case]
    report = check_resume(build, tmp_path / "ckpt", stop_at)
    # The checker saw the state move (a vacuous pass would mean the walk missed the trainer).
    assert any(p.endswith("state.global_step") for p in report.changed), report.changed
    assert any(".optimizer.state_dict()" in p for p in report.changed), report.changed
    if case in DIRECT_CASES:
        expected = {"reward.dropped", "model_optimizers['agent_0'].scheduler.state_dict()['last_epoch']"}
        assert expected <= set(report.changed), report.changed
    assert report.ok, report.message()


# ----- the checker has teeth ----------------------------------------------------------------------
class ForgetfulMAGRPOTrainer(MAGRPOTrainer):
    """Counts its steps in an attribute that ``state_dict()`` does not hold."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps_seen = 0

    def record_step(self, *args: Any, **kwargs: Any) -> None:
        self.steps_seen += 1
        super().record_step(*args, **kwargs)


def test_a_forgotten_attribute_is_reported(tiny_llama, tmp_path):
    def build():
        return ForgetfulMAGRPOTrainer(agent_model=tiny_llama, num_agents=2, reward_func=sometimes_invalid_reward,
                                      train_dataset=dataset(), args=MAGRPOConfig(**DIRECT))

    report = check_resume(build, tmp_path / "ckpt", 1)
    assert "steps_seen" in report.changed and not report.ok
    assert report.missing["steps_seen"] == (2, 0), report.message()
    assert "steps_seen: trained 2, resumed 0" in report.message()
