"""The combination matrix: trainer x update passes x accumulation x LR schedule x LoRA, every cell checked.

For each cell a run of two boundaries is checked for what the user planned:
- the learning rate at every optimizer step of every trained model is the planned schedule over the
  whole run (``transformers.get_scheduler``'s formulas, written out here), and the run takes
  exactly the planned number of optimizer steps (a linear schedule never reaches 0 early);
- no gradient is left unapplied at the end (every ``.grad`` is None, nothing pending);
- resuming from a checkpoint taken mid-run ends bit-identical to the uninterrupted run, with the
  same learning rates at the remaining steps.
- for the REINFORCE family (fp32 cells), the gradient each agent's optimizer applies at the run's first
  step (with 2 update passes also the second, whose passes run at weights that did not sample their batch) is
  the gradient of the cell's loss written out by hand (tests/test_trainer_maths.py): its loss type, its KL mode,
  the ratio to the sampling policy, the mean over the accumulation window and the clip to max_grad_norm; and
  the other loss types, or ratio 1, would give another one. Completions end early by hand (``EndsEarly``), so
  a batch's completions differ in length and the loss types differ.
A second group interrupts a run mid-epoch while gradients are pending (accumulation 3) and
resumes it. OPTION_CELLS add the later options (advantage mode, loss type, reference KL, mixed
precision) and MADPO in pairings. The data-parallel cells are in test_matrix_ddp.py, the generation backends in
test_backends.py.

Sizes: 4 prompts, batch 1, so an epoch has 4 rollout batches; with accumulation 3 that is not a
multiple of the window, so every epoch ends with a flushed partial window.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import signal

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer

from comlrl.callbacks import TrainerCallback
from comlrl.errors import TrainingInterrupted
from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl.trainers.preference import MADPOConfig, MADPOTrainer, MARLHFConfig, MARLHFIterTrainer, MARLHFTrainer
from comlrl.trainers.reinforce import (MAGRPOConfig, MAGRPOTrainer, MAREINFORCEConfig, MAREINFORCETrainer,
                                       MAReMaxConfig, MAReMaxTrainer, MARLOOConfig, MARLOOTrainer)
from test_trainer_maths import LOSS_TYPES, FamilyMaths, OptimizerSteps, assert_gradient_matches, gradient, model_at

TRAINERS = ("magrpo", "iac", "maac", "marlhf", "marlhf_iter")


class EndsEarly:
    """Mixin: sample g of every prompt ends after ``1 + (g + agent) % max_new_tokens`` tokens, as if EOS had been
    sampled there (the rest is padding, the texts are re-decoded), so a batch's completions differ in length and
    each loss type gives its own update (a random tiny model rarely samples EOS). Deterministic: a resumed run
    cuts the same way."""

    def rollout(self, rows, row_labels=None):
        rollout = super().rollout(rows, row_labels)
        for turn in rollout.turns:
            for agent, generation in enumerate(turn.generations):
                num_rows, width = generation.completion_ids.shape
                samples = torch.arange(num_rows) % generation.num_generations
                lengths = 1 + (samples + agent) % self.args.max_new_tokens
                mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
                ids = torch.where(mask, generation.completion_ids, self.tokenizers[agent].pad_token_id)
                turn.generations[agent] = dataclasses.replace(
                    generation, completion_ids=ids, completion_mask=mask.to(generation.completion_mask.dtype),
                    texts=self.tokenizers[agent].batch_decode(ids, skip_special_tokens=True))
        return rollout


class RecordsBatches:
    """Mixin: keeps each rollout batch's rewards and rollout as the advantages stage receives them."""

    def advantages(self, rewards, reference=None, rollout=None):
        self.__dict__.setdefault("recorded_batches", []).append((rewards, rollout))
        return super().advantages(rewards, reference, rollout)


FAMILY = {kind: (type(f"Matrix{trainer.__name__}", (EndsEarly, RecordsBatches, trainer), {}), config)
          for kind, (trainer, config) in {
              "magrpo": (MAGRPOTrainer, MAGRPOConfig), "mareinforce": (MAREINFORCETrainer, MAREINFORCEConfig),
              "maremax": (MAReMaxTrainer, MAReMaxConfig), "marloo": (MARLOOTrainer, MARLOOConfig)}.items()}
PROMPTS = ["write about the cat", "write about the sun", "write about the tree", "write about the road"]
LEARNING_RATE = 1e-3
# The boundary each trainer's resume starts from (after it, the run still has work that depends on the state).
RESUME_FROM = {"magrpo": 1, "iac": 1, "maac": 1, "marlhf": 2, "marlhf_iter": 4, "mareinforce": 1, "maremax": 1,
               "marloo": 1, "madpo": 1}


def letters_reward(completions_0, completions_1):
    return [0.5 * a.count("e") / max(len(a), 1) + 0.5 * b.count("o") / max(len(b), 1)
            for a, b in zip(completions_0, completions_1)]


def build(kind: str, model: str, passes: int, accumulation: int, schedule: str, lora: bool, **options):
    common = dict(num_agents=2, num_generations=2, max_new_tokens=4, temperature=1.0, agent_learning_rate=LEARNING_RATE,
                  per_device_train_batch_size=1, gradient_accumulation_steps=accumulation, lr_scheduler_type=schedule,
                  lora_rank=2 if lora else None, seed=3, disable_tqdm=True, **options)
    data = dict(reward_func=letters_reward, train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    if kind in FAMILY:
        trainer, config = FAMILY[kind]
        return trainer(agent_model=model, args=config(policy_update_epochs=passes, num_train_epochs=2, **common), **data)
    if kind == "madpo":  # one DPO micro-batch per rollout batch: no update passes
        assert passes == 1
        return MADPOTrainer(agent_model=model, args=MADPOConfig(num_train_epochs=2, **common), **data)
    if kind in ("iac", "maac"):
        critic = dict(critic_learning_rate=2 * LEARNING_RATE, critic_update_epochs=passes, num_train_epochs=2)
        tokenizer = AutoTokenizer.from_pretrained(model)
        if kind == "iac":
            return IACTrainer(agent_model=model, tokenizer=tokenizer, critic_model=model,
                              args=IACConfig(use_separate_critic=True, **critic, **common), **data)
        return MAACTrainer(agent_model=model, tokenizer=tokenizer, critic_model=model,
                           args=MAACConfig(**critic, **common), **data)
    preference = dict(policy_update_epochs=passes, reward_model_device=None, preference_num_generations=4,
                      reward_train_epochs=1, reward_batch_size=4, **common)
    if kind == "marlhf":
        return MARLHFTrainer(agent_model=model, args=MARLHFConfig(num_train_epochs=2, **preference), **data)
    return MARLHFIterTrainer(agent_model=model, args=MARLHFConfig(num_train_epochs=1, num_iterations=2, **preference),
                             **data)


def components(trainer):
    """Every optimizer-step component of the trainer (a preference run's live in its policy trainer)."""
    return getattr(trainer, "policy_trainer", trainer).model_optimizers


def record_learning_rates(trainer) -> dict[str, list[list[float]]]:
    """Per component, the learning rate of every parameter group at each optimizer step (a real step hook)."""
    seen: dict[str, list[list[float]]] = {}
    for name, component in components(trainer).items():
        seen[name] = []
        component.optimizer.register_step_pre_hook(
            lambda optimizer, args, kwargs, log=seen[name]: log.append([g["lr"] for g in optimizer.param_groups]))
    return seen


def schedule_factor(schedule: str, step: int, total: int) -> float:
    """transformers' schedules without warm-up, written out: the LR multiplier at 0-based ``step`` of ``total``."""
    if schedule == "linear":
        return (total - step) / total
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * step / total))
    return 1.0


def planned_steps(kind: str, name: str, passes: int, accumulation: int) -> int:
    """The optimizer steps each model must take: 2 epochs (or 2 iterations of 1) x ceil(4 batches x passes / A)."""
    model_passes = passes if (kind not in ("iac", "maac") or name.startswith("critic")) else 1
    return 2 * math.ceil(4 * model_passes / accumulation)


def weights(trainer) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {k: v.detach().clone() for k, v in module.state_dict().items()}
            for name, module in trainer.checkpoint_modules().items()}


def assert_same_weights(expected, actual) -> None:
    assert expected.keys() == actual.keys()
    for name in expected:
        for key, tensor in expected[name].items():
            assert torch.equal(tensor, actual[name][key]), f"{name}.{key} differs after resume"


def assert_no_gradient_left(trainer) -> None:
    for name, component in components(trainer).items():
        assert component.pending == 0, f"{name}: {component.pending} micro-batches never applied"
        left = [n for n, p in component.module.named_parameters() if p.grad is not None]
        assert not left, f"{name}: gradients left on {left[:3]}"


# The options added after the full product above: advantage mode (the REINFORCE family), loss type and the
# reference KL (off / as reward shaping / as a loss term). Every value of each occurs with both update-pass
# counts, both accumulation settings and LoRA on and off, and each KL mode with every trainer family
# (checked by test_option_cells_cover_every_pairing); 'grpo' and 'mean' are also in the full product above.
OPTION_CELLS = [
    # kind, passes, accumulation, schedule, lora, options
    ("mareinforce", 1, 3, "linear", False, dict(loss_type="bnpo")),
    ("mareinforce", 2, 1, "cosine", True, dict(reference_kl_enabled=True, reference_kl_mode="loss")),
    ("maremax", 2, 1, "cosine", True, dict(reference_kl_enabled=True)),
    ("maremax", 1, 3, "constant", False, dict(loss_type="dr_grpo")),
    ("marloo", 2, 3, "constant", True, dict(loss_type="dr_grpo", reference_kl_enabled=True,
                                            reference_kl_mode="loss")),
    ("marloo", 1, 1, "linear", False, dict(loss_type="dapo", reference_kl_enabled=True)),
    ("magrpo", 2, 3, "linear", True, dict(loss_type="dapo", reference_kl_enabled=True, reference_kl_mode="loss")),
    ("magrpo", 1, 1, "cosine", False, dict(loss_type="bnpo", reference_kl_enabled=True)),
    ("magrpo", 2, 3, "constant", True, dict(loss_type="bnpo")),
    ("magrpo", 1, 1, "linear", True, dict(loss_type="dr_grpo")),
    ("iac", 2, 3, "cosine", True, dict(reference_kl_enabled=True)),
    ("iac", 1, 1, "linear", False, dict(reference_kl_enabled=True, reference_kl_mode="loss")),
    ("maac", 1, 3, "linear", True, dict(reference_kl_enabled=True, reference_kl_mode="loss")),
    ("maac", 2, 1, "constant", False, dict(reference_kl_enabled=True)),
    # Mixed precision (bf16 sampling copies, bf16 autocast of the log-prob forwards): resume is still exact.
    ("magrpo", 1, 3, "linear", True, dict(precision="bf16-mixed")),
    ("marloo", 2, 1, "cosine", False, dict(precision="bf16-mixed", reference_kl_enabled=True, reference_kl_mode="loss")),
    ("iac", 2, 3, "constant", False, dict(precision="bf16-mixed")),
    ("maac", 1, 1, "linear", True, dict(precision="bf16-mixed", reference_kl_enabled=True)),
    ("marlhf", 2, 3, "cosine", False, dict(precision="bf16-mixed")),
    # MADPO (one DPO micro-batch per rollout batch, so one update pass), each schedule, LoRA, pair selections.
    ("madpo", 1, 3, "linear", True, dict(pair_selection="random")),
    ("madpo", 1, 1, "cosine", False, dict(precision="bf16-mixed")),
    ("madpo", 1, 3, "constant", False, dict(dpo_reference="none")),
    ("madpo", 1, 1, "linear", True, dict(max_pairs_per_prompt=1)),
]
ADVANTAGE_MODE = {"mareinforce": "raw", "maremax": "max", "marloo": "rloo", "magrpo": "mean"}


def test_option_cells_cover_every_pairing():
    def values(cell):
        kind, passes, accumulation, _, lora, options = cell
        family = kind in ADVANTAGE_MODE
        kl = options.get("reference_kl_mode", "reward") if options.get("reference_kl_enabled") else "off"
        return {"mode": ADVANTAGE_MODE.get(kind), "loss": options.get("loss_type", "grpo") if family else None,
                "kl": kl, "passes": passes, "accumulation": accumulation, "lora": lora,
                "precision": options.get("precision", "fp32"), "family": "reinforce" if family else kind}

    seen = [values(cell) for cell in OPTION_CELLS]
    wanted = {"mode": ["raw", "max", "rloo"], "loss": ["bnpo", "dapo", "dr_grpo"], "kl": ["off", "reward", "loss"],
              "precision": ["bf16-mixed"]}
    others = {"passes": [1, 2], "accumulation": [1, 3], "lora": [False, True]}
    missing = [(dim, value, other, choice) for dim, values_ in wanted.items() for value in values_
               for other, choices in others.items() for choice in choices
               if not any(s[dim] == value and s[other] == choice for s in seen)]
    missing += [("kl", mode, "family", family) for mode in ("reward", "loss") for family in ("reinforce", "iac", "maac")
                if not any(s["kl"] == mode and s["family"] == family for s in seen)]
    missing += [("precision", "bf16-mixed", "family", family) for family in ("reinforce", "iac", "maac", "marlhf")
                if not any(s["precision"] == "bf16-mixed" and s["family"] == family for s in seen)]
    assert not missing, missing


def cell_id(cell) -> str:
    kind, passes, accumulation, schedule, lora, options = cell
    named = "-".join(f"{k.replace('reference_kl_', 'kl_')}={v}" for k, v in options.items())
    return f"{kind}-passes{passes}-acc{accumulation}-{schedule}-{'lora' if lora else 'full'}-{named}"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("accumulation", [1, 3], ids=["acc1", "acc3"])
@pytest.mark.parametrize("passes", [1, 2], ids=["passes1", "passes2"])
@pytest.mark.parametrize("kind", TRAINERS)
def test_cell(kind, passes, accumulation, schedule, lora, tiny_llama, tmp_path):
    check_cell(kind, passes, accumulation, schedule, lora, {}, tiny_llama, tmp_path)


@pytest.mark.parametrize("cell", OPTION_CELLS, ids=[cell_id(cell) for cell in OPTION_CELLS])
def test_option_cell(cell, tiny_llama, tmp_path):
    kind, passes, accumulation, schedule, lora, options = cell
    check_cell(kind, passes, accumulation, schedule, lora, options, tiny_llama, tmp_path)


def clipped(gradients: dict[str, torch.Tensor], max_norm: float | None) -> dict[str, torch.Tensor]:
    """torch's clip_grad_norm_, written out: scaled by max_norm / (norm + 1e-6) when that is below 1."""
    if max_norm is None:
        return gradients
    norm = sum(float(g.double().pow(2).sum()) for g in gradients.values()) ** 0.5
    factor = min(1.0, max_norm / (norm + 1e-6))
    return {name: g * factor for name, g in gradients.items()}


def check_first_updates(trainer, initial_agents, steps, passes: int, accumulation: int) -> None:
    """Each agent's gradient at the run's first optimizer step (with 2 passes also the second) against the maths.

    Micro-batch ``m`` is pass ``m % passes`` over rollout batch ``m // passes``; window ``k`` holds micro-batches
    ``kA .. kA + A - 1`` and all of them run at the weights before step ``k`` with pi_old the weights that
    sampled their batch (those before the step whose window holds the batch's first pass). The window's gradient
    (as accumulated) is the mean over its micro-batches (they hold equal counts here, so it is also the mean over
    their completions or tokens); the optimizer applies it clipped to max_grad_norm. The reference (KL cells) is
    the initial policy.
    """
    args = trainer.args
    windows = 2 if passes == 2 else 1
    for agent in range(trainer.num_agents):
        initial = initial_agents[agent]
        reference = initial if args.reference_kl_enabled else None
        for window in range(windows):
            step = steps[agent][window]
            batches = []
            for micro in range(window * accumulation, (window + 1) * accumulation):
                batch = micro // passes
                rewards, rollout = trainer.recorded_batches[batch]
                behaviour = steps[agent][batch * passes // accumulation].parameters
                batches.append(FamilyMaths(initial, rollout.turns[0].generations[agent], rewards[0], behaviour, args,
                                           reference))

            def window_gradient(**options):
                model = model_at(initial, step.parameters)
                loss = sum(maths.loss(model, maths.advantages(), **options) for maths in batches) / accumulation
                return gradient(loss, model)

            expected = window_gradient()
            if window == 0:  # (in the second window every token of a batch may be clipped: no gradient, any type)
                same = {"bnpo", "dapo"} if args.loss_type in ("bnpo", "dapo") else {args.loss_type}
                wrong = {f"loss_type={t!r}": window_gradient(loss_type=t) for t in LOSS_TYPES if t not in same}
            else:  # a pass at weights that did not sample its batch: its ratios are not 1
                wrong = {"ratio 1": window_gradient(ratio_one=True)}
            assert_gradient_matches(step.accumulated, expected, wrong)
            assert_gradient_matches(step.applied, clipped(expected, args.max_grad_norm), {})


def check_cell(kind, passes, accumulation, schedule, lora, options, tiny_llama, tmp_path):
    straight = build(kind, tiny_llama, passes, accumulation, schedule, lora, **options)
    learning_rates = record_learning_rates(straight)
    maths = kind in FAMILY and options.get("precision", "fp32") == "fp32"  # (bf16 forwards: not float32 maths)
    if maths:
        initial_agents = [copy.deepcopy(agent) for agent in straight.agents]
        optimizer_steps = OptimizerSteps(straight)
    straight.train(checkpoint_dir=tmp_path / "run", checkpoint_interval=1)
    if maths:
        check_first_updates(straight, initial_agents, optimizer_steps.steps, passes, accumulation)

    # The planned schedule, step by step, over the whole run; exactly the planned number of steps.
    for name, steps in learning_rates.items():
        component = components(straight)[name]
        total = planned_steps(kind, name, passes, accumulation)
        assert component.planned_steps == total and len(steps) == total, (name, len(steps), total)
        bases = [group["initial_lr"] if "initial_lr" in group else group["lr"]
                 for group in component.optimizer.param_groups]
        for step, groups in enumerate(steps):
            expected = [base * schedule_factor(schedule, step, total) for base in bases]
            assert groups == pytest.approx(expected, rel=1e-12, abs=0.0), (name, step, groups, expected)
        assert min(steps[-1]) > 0.0, f"{name}: the last step ran at LR 0"
    assert_no_gradient_left(straight)

    # Resume from a mid-run checkpoint: the same weights, rewards and learning rates as the uninterrupted run.
    resumed = build(kind, tiny_llama, passes, accumulation, schedule, lora, **options)
    resumed_rates = record_learning_rates(resumed)
    resumed.train(resume_from_checkpoint=tmp_path / "run" / f"checkpoint-{RESUME_FROM[kind]}",
                  checkpoint_dir=tmp_path / "resumed")
    assert_same_weights(weights(straight), weights(resumed))
    assert [s["reward_mean"] for s in straight.state.history] == [s["reward_mean"] for s in resumed.state.history]
    for name, steps in resumed_rates.items():
        assert steps == learning_rates[name][len(learning_rates[name]) - len(steps):], name
    assert_no_gradient_left(resumed)


class StopAfter(TrainerCallback):
    """Sends this process a real SIGTERM after the given step (the trainer finishes it and checkpoints)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_log(self, trainer, metrics, step):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("passes", [1, 2], ids=["passes1", "passes2"])
@pytest.mark.parametrize("kind", ["magrpo", "iac", "maac"])
def test_stop_with_pending_gradients_resumes_exactly(kind, passes, tiny_llama, tmp_path):
    """A stop after step 5 (epoch 2, one micro-batch into a window of 3) checkpoints the pending gradients."""
    straight = build(kind, tiny_llama, passes, 3, "linear", False)
    straight.train()

    interrupted = build(kind, tiny_llama, passes, 3, "linear", False)
    interrupted.callbacks.append(StopAfter(5))
    with pytest.raises(TrainingInterrupted) as info:
        interrupted.train(checkpoint_dir=tmp_path, checkpoint_interval=1)
    pending = {name: c.pending for name, c in components(interrupted).items()}
    assert any(pending.values()), pending  # the checkpoint really holds a partial window
    saved = torch.load(os.path.join(info.value.checkpoint, "state.pt"), weights_only=True)
    assert {name: s["pending"] for name, s in saved["optimizers"].items()} == pending
    assert all(s["pending_grads"] for s in saved["optimizers"].values() if s["pending"])

    resumed = build(kind, tiny_llama, passes, 3, "linear", False)
    resumed.train(resume_from_checkpoint=info.value.checkpoint)
    assert_same_weights(weights(straight), weights(resumed))
    assert [s["reward_mean"] for s in straight.state.history] == [s["reward_mean"] for s in resumed.state.history]
