"""MARLHFTrainer and MARLHFIterTrainer: preference-based multi-agent RL with a learned joint reward.

Each iteration runs three stages, each a checkpoint boundary:

1. ``collect_preferences`` — the agents sample joint responses; the task reward from
   ``reward_func`` labels pairs (higher task reward = chosen; ties dropped).
2. ``fit_reward_model`` — a joint reward model is loaded fresh from ``reward_model_name`` and
   fitted with the Bradley-Terry loss on the pairs.
3. ``learn_policy`` — the fitted reward model, kept fixed, is the reward of a policy trainer
   (MAGRPO, MAAC or IAC) for ``num_train_epochs`` epochs; the task reward is reported next to
   it (``monitor/task_reward``) so reward hacking is visible.

``MARLHFTrainer`` runs one iteration; ``MARLHFIterTrainer`` runs ``num_iterations``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from datasets import Dataset

from comlrl import preferences
from comlrl.algorithms.advantages import joint_index
from comlrl.callbacks import dispatch
from comlrl.entities import model_name
from comlrl.episodes import rollout_episodes, score_rollout
from comlrl.metrics import MetricWindow
from comlrl.reward_model import JointRewardModel, fit_reward_model, learned_reward, resolve_reward_device
from comlrl.trainers.base import MultiAgentTrainer, TrainerState
from comlrl.trainers.preference.config import MARLHFConfig
from comlrl.trainers.preference.policy import build_policy_trainer

logger = logging.getLogger(__name__)

STAGES = ("collect_preferences", "fit_reward_model", "learn_policy")


@dataclass
class PbRLState(TrainerState):
    """Progress of a preference-based run: the iteration and the next stage within it."""

    iteration: int = 0
    stage: int = 0
    stage_records: list[dict[str, Any]] = field(default_factory=list)


class MARLHFTrainer(MultiAgentTrainer):
    config_class = MARLHFConfig
    args: MARLHFConfig
    boundary_kind = "pbrl_stage"
    fsdp_refusal = ("the joint reward model and the policy trainer it builds are not sharded yet; launch with "
                    "infra/accelerate/multi_gpu.yaml (DDP) instead")

    def __init__(self, *args: Any, critic_model: Any = None, critics: Sequence[Any] | None = None, **kwargs: Any) -> None:
        self._critic_model = critic_model
        self._critics = critics
        super().__init__(*args, **kwargs)
        self.pairs_by_iteration: list[Dataset] = []
        self.reward_model: JointRewardModel | None = None
        self.output_path: Path | None = Path(self.args.output_dir) if self.args.output_dir else None
        self.policy_trainer = build_policy_trainer(self, self._reward_for_policy, critic_model, critics)

    # ----- construction -----------------------------------------------------------------------
    def check_before_loading(self, sources: list[Any]) -> None:
        self.reward_device = resolve_reward_device(
            self.args.reward_model_device, self.device, self.args.reward_model_device_fallback
        )
        source = self.args.reward_model_name or model_name(sources[0])
        if not source:
            raise ValueError(
                "MARLHFConfig.reward_model_name is required when the actors are model objects without a model "
                "identifier (agents[0] has no name_or_path); set it to a hub identifier or local directory"
            )
        self.reward_model_source = source

    def build_agent_optimizers(self) -> list[torch.optim.Optimizer]:
        return []  # the policy trainer owns the agents' optimizers

    def new_state(self) -> PbRLState:
        return PbRLState()

    @property
    def num_iterations(self) -> int:
        return 1

    def _reward_for_policy(self, *completions: Sequence[str], batch_items: Sequence[dict[str, Any]]) -> list[float]:
        if self.reward_model is None:
            raise RuntimeError("the policy stage ran before a reward model was fitted")
        return learned_reward(self.reward_model)(*completions, batch_items=batch_items)

    def reward_model_source_for_critic(self) -> str:
        """The first actor's identifier, the default critic backbone for MAAC/IAC policy stages."""
        source = self.agent_sources[0]
        if not source:
            raise ValueError(
                "rl_algorithm 'maac'/'iac' needs a critic: pass critic_model/critics or set MARLHFConfig.critic_model_name "
                "(the actors are model objects without an identifier)"
            )
        return source

    def task_reward(self, *completions: Sequence[str], batch_items: Sequence[dict[str, Any]]) -> list[float]:
        """The user's task reward (weights and processor applied), as a plain reward function."""
        return self.reward(list(completions), list(batch_items)).tolist()

    # ----- stage 1: preference collection --------------------------------------------------
    def preference_rows(self) -> list[int]:
        """Train rows used for collection this iteration: all, or a seeded sample."""
        count = self.args.num_preference_prompts
        total = len(self.train_dataset)
        if count is None or count >= total:
            return list(range(total))
        generator = torch.Generator().manual_seed(self.args.seed * 7919 + self.state.iteration)
        return sorted(torch.randperm(total, generator=generator)[:count].tolist())

    def collect_preferences(self) -> dict[str, float]:
        """Sample joint responses, label pairs with the task reward, keep them for this iteration."""
        samples = self.args.preference_num_generations or self.args.num_generations
        index = joint_index(self.num_agents, samples, "aligned")
        records, rewards_seen = [], []
        row_indices = self.preference_rows()
        chunk = max(self.args.per_device_train_batch_size, 8)
        for agent in self.agents:
            agent.eval()
        for start in range(0, len(row_indices), chunk):
            indices = row_indices[start:start + chunk]
            rows = [self.train_dataset[i] for i in indices]
            rollout = rollout_episodes(
                self.agents, self.tokenizers, self.formatters, rows, index, samples, 1,
                self.sampling, max_prompt_length=self.args.max_prompt_length, row_labels=indices,
                agent_map=self.agent_map,
            )
            rewards = score_rollout(rollout, self.reward)[0]
            rewards_seen.append(rewards.reshape(-1))
            records += preferences.label_pairs(
                [str(row.get("prompt", "")) for row in rows], indices, rollout.joint_completions(0), rewards,
                self.state.iteration, self.args.preference_tie_margin, self.args.max_pairs_per_prompt,
            )
        pairs = preferences.pairs_dataset(records)
        del self.pairs_by_iteration[self.state.iteration:]
        self.pairs_by_iteration.append(pairs)
        if self.output_path is not None:
            preferences.save_pairs(pairs, self.iteration_dir() / "pairs.parquet")
        return {
            "preferences/pairs": float(len(pairs)),
            "preferences/prompts": float(len(row_indices)),
            "preferences/task_reward_mean": float(torch.cat(rewards_seen).mean()),
        }

    # ----- stage 2: reward-model fit -------------------------------------------------------
    def training_pairs(self) -> Dataset:
        if self.args.pool_preference_pairs:
            return preferences.pool(self.pairs_by_iteration[: self.state.iteration + 1])
        return self.pairs_by_iteration[self.state.iteration]

    def load_reward_model(self) -> JointRewardModel:
        """A fresh reward model from its source; the new head is drawn from a fixed seed so every
        reload starts from the same weights, without touching the training RNG."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.args.seed)
            return JointRewardModel.load(
                self.reward_model_source, self.reward_device, self.dtype, self.args.reward_max_length,
                self.args.trust_remote_code,
            )

    def fit_reward_model(self) -> dict[str, float]:
        pairs = self.training_pairs()
        if len(pairs) == 0:
            raise ValueError(
                "no preference pairs were collected (every joint sample had the same task reward within "
                f"preference_tie_margin={self.args.preference_tie_margin}); raise num_generations or temperature"
            )
        self.reward_model = self.load_reward_model()
        train, heldout = preferences.split_heldout(len(pairs), self.args.reward_heldout_fraction, self.args.seed)
        result = fit_reward_model(
            self.reward_model, pairs, train, heldout, self.args.reward_train_epochs, self.args.reward_batch_size,
            self.args.reward_learning_rate, self.args.seed + self.state.iteration, self.args.reward_freeze_backbone,
        )
        if self.output_path is not None:
            self.reward_model.save(self.iteration_dir() / "reward_model")
        return result.metrics()

    # ----- stage 3: policy learning --------------------------------------------------------
    def learn_policy(self) -> dict[str, float]:
        """``num_train_epochs`` epochs of the policy trainer on the learned reward."""
        policy = self.policy_trainer
        window = MetricWindow()
        start = len(policy.state.history)
        for _ in range(self.args.num_train_epochs):
            policy.run_epoch(window)
        steps = policy.state.history[start:]
        self.state.history.extend({"iteration": self.state.iteration, **step} for step in steps)
        summary = MetricWindow()
        for step in steps:
            summary.add({k: v for k, v in step.items() if k in ("reward_mean", "monitor/task_reward")})
        means = summary.flush()
        return {
            "policy/learned_reward_mean": means.get("reward_mean", float("nan")),
            "policy/task_reward_mean": means.get("monitor/task_reward", float("nan")),
            "policy/steps": float(len(steps)),
        }

    # ----- the stage loop ------------------------------------------------------------------
    def begin_training(self, **checkpoint_options: Any) -> Any:
        runner = super().begin_training(**checkpoint_options)
        self.prepare_output_dir(resuming=runner.resume_path is not None)
        return runner

    def total_boundaries(self) -> int:
        return len(STAGES) * self.num_iterations

    def run_boundaries(self, runner: Any) -> None:
        while self.state.boundaries < self.total_boundaries():
            self.run_next_stage()
            runner.on_boundary()
        self._advance_iteration()

    def run_next_stage(self) -> dict[str, float]:
        """Run the next stage (one boundary) and count it; the pipeline runs one task per call."""
        self._advance_iteration()
        name = STAGES[self.state.stage]
        metrics = getattr(self, name)()
        self.record_stage(name, metrics)
        self.state.stage += 1
        self.state.boundaries += 1
        return metrics

    def _advance_iteration(self) -> None:
        if self.state.stage == len(STAGES):
            self.state.stage = 0
            self.state.iteration += 1

    def record_stage(self, name: str, metrics: dict[str, float]) -> None:
        record = {"iteration": self.state.iteration, "stage": name, **metrics}
        self.state.stage_records.append(record)
        logger.info("iteration %d, %s: %s", self.state.iteration, name, metrics)
        dispatch(self.callbacks, "on_log", self, {f"pbrl/{k}": v for k, v in metrics.items()}, self.state.boundaries + 1)
        if self.output_path is not None:
            with open(self.output_path / "history.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")

    def iteration_dir(self) -> Path:
        directory = self.output_path / f"iteration_{self.state.iteration}"
        directory.mkdir(parents=True, exist_ok=True)
        return directory

    def prepare_output_dir(self, resuming: bool) -> None:
        """Never overwrite: a resumed run writes into ``resume-N`` if the directory has files."""
        if self.args.output_dir is None:
            return
        root = Path(self.args.output_dir)
        occupied = root.is_dir() and any(root.iterdir())
        if occupied and not resuming:
            raise ValueError(
                f"MARLHFConfig.output_dir {str(root)!r} already contains files; give a new directory, or resume "
                "with train(resume_from_checkpoint=...) to write into a resume-* subdirectory"
            )
        if occupied:
            number = 1
            while (root / f"resume-{number}").exists():
                number += 1
            root = root / f"resume-{number}"
        root.mkdir(parents=True, exist_ok=True)
        self.output_path = root

    # ----- checkpoint hooks -----------------------------------------------------------------
    def checkpoint_modules(self) -> dict[str, torch.nn.Module]:
        return self.policy_trainer.checkpoint_modules()

    def checkpoint_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return self.policy_trainer.checkpoint_optimizers()

    def compat_settings(self) -> dict[str, Any]:
        return {**super().compat_settings(), "rl_algorithm": self.args.rl_algorithm,
                "reward_model_source": self.reward_model_source}

    def check_resume_progress(self, saved_state: dict[str, Any]) -> None:
        if saved_state["iteration"] > self.num_iterations:
            raise ValueError(
                f"the checkpoint has completed {saved_state['iteration']} iterations but num_iterations is "
                f"{self.num_iterations}; num_iterations counts the whole run, so raise it"
            )

    def save_extra(self, directory: Path) -> None:
        for iteration, pairs in enumerate(self.pairs_by_iteration):
            preferences.save_pairs(pairs, directory / f"pairs_{iteration}.parquet")
        if self.reward_model is not None:
            self.reward_model.save(directory / "reward_model")
        (directory / "policy_state.json").write_text(json.dumps(dataclasses.asdict(self.policy_trainer.state)))

    def load_extra(self, directory: Path, metadata: dict[str, Any]) -> None:
        self.pairs_by_iteration = []
        while (directory / f"pairs_{len(self.pairs_by_iteration)}.parquet").is_file():
            self.pairs_by_iteration.append(preferences.load_pairs(directory / f"pairs_{len(self.pairs_by_iteration)}.parquet"))
        if (directory / "reward_model").is_dir():
            self.reward_model = JointRewardModel.load(
                str(directory / "reward_model"), self.reward_device, self.dtype, self.args.reward_max_length,
            )
            self.reward_model.value_head.load_state_dict(
                torch.load(directory / "reward_model" / "value_head.pt", map_location="cpu", weights_only=True)
            )
        state = json.loads((directory / "policy_state.json").read_text())
        self.policy_trainer.state = type(self.policy_trainer.state)(**state)

    # ----- evaluation and export ------------------------------------------------------------
    def evaluate(self, dataset: Any = None, num_samples: int | None = None) -> dict[str, float]:
        """Mean task reward (the learned reward is for training) of joint samples on eval rows,
        under a fixed seed in a forked RNG."""
        dataset = dataset if dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs eval_dataset (given to the trainer or as an argument)")
        count = min(num_samples or self.args.eval_num_samples, len(dataset))
        rows = [dataset[i] for i in range(count)]
        index = joint_index(self.num_agents, self.args.num_generations, "aligned")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.args.seed + 1)
            rollout = rollout_episodes(self.agents, self.tokenizers, self.formatters, rows, index,
                                       self.args.num_generations, 1, self.sampling, row_labels=list(range(count)),
                                       agent_map=self.agent_map)
            task = score_rollout(rollout, self.reward)[0]
            metrics = {"eval/task_reward_mean": float(task.mean())}
            if self.reward_model is not None:
                learned = self._reward_for_policy(*rollout.joint_completions(0), batch_items=rollout.joint_rows(0))
                metrics["eval/learned_reward_mean"] = sum(learned) / len(learned)
        return metrics

    @property
    def preference_pairs(self) -> Dataset:
        """Every pair collected so far (all iterations)."""
        return preferences.pool(self.pairs_by_iteration)

    def save_model(self, output_dir: str | Path) -> Path:
        return self.policy_trainer.save_model(output_dir)


class MARLHFIterTrainer(MARLHFTrainer):
    """``num_iterations`` rounds of collect -> fit -> policy; the reward model is reloaded from
    its source at the start of every fit, and each iteration's pairs are kept apart
    (``pool_preference_pairs=True`` fits on all of them)."""

    boundary_kind = "pbrl_stage"

    @property
    def num_iterations(self) -> int:
        return self.args.num_iterations
