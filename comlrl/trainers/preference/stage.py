"""The preference stage of PbRL: collect preference pairs with the current agents, fit the joint reward model.

A component with its own state (the pairs of every iteration and the fitted reward model), used by
:class:`~comlrl.trainers.preference.marlhf.MARLHFTrainer` beside an ordinary policy trainer.

Under data parallelism every process collects the pairs of its share of the prompts and all
processes then hold the union (gathered in prompt order), fit the same reward model from the
same fresh weights on the same pairs, and finally take rank 0's fitted weights, so every rank
optimises the same learned reward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from datasets import Dataset

from comlrl.rollout import preferences
from comlrl.rollout.episodes import rollout_episodes, score_rollout
from comlrl.models.reward_model import JointRewardModel, fit_reward_model
from comlrl.rollout.rewards import JointReward


class PreferenceStage:
    """Pairs per iteration and the joint reward model fitted on them."""

    def __init__(self, args: Any, reward_model_source: str, reward_device: torch.device, dtype: torch.dtype,
                 data_parallel: Any) -> None:
        self.args = args
        self.reward_model_source = reward_model_source
        self.reward_device = reward_device
        self.dtype = dtype
        self.data_parallel = data_parallel
        self.pairs_by_iteration: list[Dataset] = []
        self.reward_model: JointRewardModel | None = None

    # ----- collection -----------------------------------------------------------------------------
    def preference_rows(self, num_rows: int, iteration: int) -> list[int]:
        """Train rows used for collection in ``iteration``: all, or a seeded sample."""
        count = self.args.num_preference_prompts
        if count is None or count >= num_rows:
            return list(range(num_rows))
        generator = torch.Generator().manual_seed(self.args.seed * 7919 + iteration)
        return sorted(torch.randperm(num_rows, generator=generator)[:count].tolist())

    def collect(self, policy: Any, task_reward: JointReward, iteration: int, output_dir: Path | None) -> dict[str, float]:
        """Sample joint responses with the policy's agents, label pairs by the task reward, keep them."""
        samples = self.args.preference_num_generations or self.args.num_generations
        spec = policy.rollout_spec.replace(num_generations=samples, num_turns=1, joint_mode="aligned")
        row_indices = self.preference_rows(len(policy.train_dataset), iteration)
        mine = self.data_parallel.shard(row_indices)
        chunk = max(self.args.per_device_train_batch_size, 8)
        for agent in policy.agents:
            agent.eval()
        records, rewards_seen = [], []
        for start in range(0, len(mine), chunk):
            indices = mine[start:start + chunk]
            rows = [policy.train_dataset[i] for i in indices]
            rollout = rollout_episodes(policy.agents, policy.tokenizers, spec, rows, indices, policy.agent_map)
            rewards = score_rollout(rollout, task_reward)[0]
            rewards_seen += rewards.reshape(-1).tolist()
            records += preferences.label_pairs(
                [str(row.get("prompt", "")) for row in rows], indices, rollout.joint_completions(0), rewards,
                iteration, self.args.preference_tie_margin, self.args.max_pairs_per_prompt,
            )
        records, rewards_seen = self._gather(records, rewards_seen, row_indices)
        pairs = preferences.pairs_dataset(records)
        del self.pairs_by_iteration[iteration:]
        self.pairs_by_iteration.append(pairs)
        if output_dir is not None and self.data_parallel.is_main:
            preferences.save_pairs(pairs, output_dir / "pairs.parquet")
        return {
            "preferences/pairs": float(len(pairs)),
            "preferences/prompts": float(len(row_indices)),
            "preferences/task_reward_mean": sum(rewards_seen) / max(len(rewards_seen), 1),
        }

    def _gather(self, records: list[dict[str, Any]], rewards: list[float],
                row_order: list[int]) -> tuple[list[dict[str, Any]], list[float]]:
        """Every process's records and rewards, records in the order of ``row_order`` (one process: as they are)."""
        if not self.data_parallel.enabled:
            return records, rewards
        gathered: list[Any] = [None] * self.data_parallel.world_size
        dist.all_gather_object(gathered, (records, rewards))
        position = {row: index for index, row in enumerate(row_order)}
        merged = sorted((r for part, _ in gathered for r in part), key=lambda r: position[r["row_index"]])
        return merged, [value for _, part in gathered for value in part]

    # ----- reward-model fit -----------------------------------------------------------------------
    def training_pairs(self, iteration: int) -> Dataset:
        if self.args.pool_preference_pairs:
            return preferences.pool(self.pairs_by_iteration[: iteration + 1])
        return self.pairs_by_iteration[iteration]

    def load_reward_model(self) -> JointRewardModel:
        """A fresh reward model from its source; the new head is drawn from a fixed seed so every
        reload starts from the same weights, without touching the training RNG."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.args.seed)
            return JointRewardModel.load(self.reward_model_source, self.reward_device, self.dtype,
                                         self.args.reward_max_length, self.args.trust_remote_code)

    def fit(self, iteration: int, output_dir: Path | None) -> dict[str, float]:
        pairs = self.training_pairs(iteration)
        if len(pairs) == 0:
            raise ValueError(
                "no preference pairs were collected (every joint sample had the same task reward within "
                f"preference_tie_margin={self.args.preference_tie_margin}); raise num_generations or temperature"
            )
        self.reward_model = self.load_reward_model()
        train, heldout = preferences.split_heldout(len(pairs), self.args.reward_heldout_fraction, self.args.seed,
                                                   groups=list(pairs["row_index"]))
        result = fit_reward_model(
            self.reward_model, pairs, train, heldout, self.args.reward_train_epochs, self.args.reward_batch_size,
            self.args.reward_learning_rate, self.args.seed + iteration, self.args.reward_freeze_backbone,
            self.args.reward_early_stopping_patience,
        )
        self.data_parallel.broadcast_parameters([self.reward_model])  # exactly rank 0's fit everywhere
        if output_dir is not None and self.data_parallel.is_main:
            self.reward_model.save(output_dir / "reward_model")
        return result.metrics()

    # ----- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "pairs": [pairs.to_list() for pairs in self.pairs_by_iteration],
            "reward_model": ({name: tensor.detach().cpu() for name, tensor in self.reward_model.state_dict().items()}
                             if self.reward_model is not None else None),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pairs_by_iteration = [preferences.pairs_dataset(records) for records in state["pairs"]]
        self.reward_model = None
        if state["reward_model"] is not None:
            self.reward_model = self.load_reward_model()
            self.reward_model.load_state_dict(state["reward_model"])
