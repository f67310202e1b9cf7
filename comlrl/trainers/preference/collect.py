"""Preference collection: the policy's candidates against the comparator's, paired by task reward, kept per iteration.

A component with its own state (every iteration's pairs, the shards, and the comparator's, e.g. the
history comparator's snapshot paths), used by MARLHF's preference stage and by MADPOIterTrainer.
Per prompt the policy samples ``num_candidates`` joint candidates (one batched generate per agent);
without a comparator they are compared among themselves, with one every pair has one candidate
from each side. The task reward labels them; ties are dropped and ``pair_selection`` keeps at most
``max_pairs_per_prompt`` (:mod:`comlrl.rollout.preferences`). Each iteration's pairs are written to
``iteration_i/pairs.parquet``, and the pairs an iteration trains on are a replay of the shards
(:mod:`comlrl.trainers.preference.replay`).

Under data parallelism every process collects its share of the prompts and all then hold the
union (gathered in prompt order).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from datasets import Dataset

from comlrl.rollout import preferences
from comlrl.rollout.episodes import rollout_episodes, score_rollout
from comlrl.rollout.rewards import JointReward
from comlrl.trainers.preference import replay
from comlrl.trainers.preference.comparators import sampled_ids


def distribution_metrics(prefix: str, values: list[float]) -> dict[str, float]:
    return {f"distribution/{prefix}_reward_{name}": value
            for name, value in replay.reward_distribution(values).items()}


class PreferenceCollection:
    """Pairs per iteration, collected against a comparator (None: the policy's candidates among themselves)."""

    def __init__(self, args: Any, options: Any, data_parallel: Any, comparator: Any, num_candidates: int,
                 replay_mode: str) -> None:
        self.args = args
        self.options = options
        self.data_parallel = data_parallel
        self.comparator = comparator
        self.num_candidates = num_candidates
        self.replay_mode = replay_mode
        self.pairs_by_iteration: list[Dataset] = []

    def preference_rows(self, num_rows: int, iteration: int) -> list[int]:
        """Train rows used for collection in ``iteration``: all, or a seeded sample."""
        count = self.args.num_preference_prompts
        if count is None or count >= num_rows:
            return list(range(num_rows))
        generator = torch.Generator().manual_seed(self.args.seed * 7919 + iteration)
        return sorted(torch.randperm(num_rows, generator=generator)[:count].tolist())

    # ----- collection -----------------------------------------------------------------------------
    def collect(self, policy: Any, task_reward: JointReward, iteration: int, output_dir: Path | None) -> dict[str, float]:
        """Sample, score and pair the candidates of this iteration's prompts; keep the pairs as its shard."""
        spec = policy.rollout_spec.replace(num_generations=self.num_candidates, num_turns=1, joint_mode="aligned")
        comparator_spec = spec.replace(num_generations=self.options.comparator_num_candidates or self.num_candidates)
        row_indices = self.preference_rows(len(policy.train_dataset), iteration)
        mine = self.data_parallel.shard(row_indices)
        chunk = max(policy.batch_size, 8)
        for agent in policy.agents:
            agent.eval()
        generator = None
        if self.args.pair_selection == "random":  # seeded from the run's RNG: a resume draws the same pairs
            generator = torch.Generator().manual_seed(int(torch.randint(2**62, (1,))))
        records: list[dict[str, Any]] = []
        seen = {"policy": [], "comparator": []}
        if self.comparator is not None:
            self.comparator.begin(iteration, policy)
        try:
            for start in range(0, len(mine), chunk):
                indices = mine[start:start + chunk]
                rows = [policy.train_dataset[i] for i in indices]
                records += self._collect_rows(policy, task_reward, spec, comparator_spec, rows, indices, iteration,
                                              generator, seen)
        finally:
            if self.comparator is not None:
                self.comparator.end()
        records, seen = self._gather(records, seen, row_indices)
        pairs = preferences.pairs_dataset(records)
        del self.pairs_by_iteration[iteration:]
        self.pairs_by_iteration.append(pairs)
        if output_dir is not None and self.data_parallel.is_main:
            preferences.save_pairs(pairs, output_dir / "pairs.parquet")
        metrics = {
            "preferences/pairs": float(len(pairs)),
            "preferences/prompts": float(len(row_indices)),
            "preferences/task_reward_mean": sum(seen["policy"]) / max(len(seen["policy"]), 1),
        }
        if self.options.log_reward_distribution:
            metrics.update(self._log_distribution(seen, pairs, output_dir))
        return metrics

    def _collect_rows(self, policy: Any, task_reward: JointReward, spec: Any, comparator_spec: Any,
                      rows: list[dict[str, Any]], indices: list[int], iteration: int,
                      generator: torch.Generator | None, seen: dict[str, list[float]]) -> list[dict[str, Any]]:
        rollout = rollout_episodes(policy.sampling_agents(), policy.tokenizers, spec, rows, indices, policy.agent_map)
        rewards = score_rollout(rollout, task_reward)[0].float().cpu()
        n = spec.num_generations
        texts = rollout.joint_completions(0)
        ids = [sampled_ids(generation) for generation in rollout.turns[0].generations]
        seen["policy"] += rewards.reshape(-1).tolist()
        other = None
        if self.comparator is not None:
            m = comparator_spec.num_generations
            other = self.comparator.sample(policy, comparator_spec, rows, indices)
            other_rewards = task_reward(other.texts, [row for row in rows for _ in range(m)]).float().cpu()
            other_rewards = other_rewards.reshape(len(rows), m)
            seen["comparator"] += other_rewards.reshape(-1).tolist()
        agents = range(policy.num_agents)
        records = []
        for node, row in enumerate(rows):
            flat = [node * n + k for k in range(n)]
            candidates = preferences.Candidates([[texts[a][f] for a in agents] for f in flat],
                                                [[ids[a][f] for a in agents] for f in flat],
                                                rewards[node].tolist(), [0] * n)
            sides = None
            if other is not None:
                flat = [node * m + k for k in range(m)]
                candidates = candidates.extend(preferences.Candidates(
                    [[other.texts[a][f] for a in agents] for f in flat],
                    [[other.token_ids[a][f] for a in agents] for f in flat], other_rewards[node].tolist(), [1] * m))
                sides = candidates.sides
            pairs = preferences.ordered_pairs(candidates.rewards, self.args.preference_tie_margin, sides)
            kept = preferences.select_pairs(pairs, self.args.pair_selection, self.args.max_pairs_per_prompt,
                                            generator, rewards=candidates.rewards, sides=sides)
            records += preferences.pair_records(
                candidates, kept, iteration=iteration, row_index=indices[node], prompt=str(row.get("prompt", "")),
                agent_prompts=[rollout.turns[0].prompts[a][node] for a in agents])
        return records

    def _gather(self, records: list[dict[str, Any]], seen: dict[str, list[float]],
                row_order: list[int]) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
        """Every process's records (in the order of ``row_order``) and rewards (one process: as they are)."""
        if not self.data_parallel.enabled:
            return records, seen
        gathered: list[Any] = [None] * self.data_parallel.world_size
        dist.all_gather_object(gathered, (records, seen))
        position = {row: index for index, row in enumerate(row_order)}
        merged = sorted((r for part, _ in gathered for r in part), key=lambda r: position[r["row_index"]])
        return merged, {side: [v for _, part in gathered for v in part[side]] for side in seen}

    def _log_distribution(self, seen: dict[str, list[float]], pairs: Dataset, output_dir: Path | None) -> dict[str, float]:
        """The iteration's reward distribution as metrics (and with its values as reward_distribution.json)."""
        groups = {"policy": seen["policy"], "chosen": list(pairs["chosen_reward"]) if len(pairs) else [],
                  "rejected": list(pairs["rejected_reward"]) if len(pairs) else []}
        if self.comparator is not None:
            groups["comparator"] = seen["comparator"]
        metrics: dict[str, float] = {}
        for name, values in groups.items():
            metrics.update(distribution_metrics(name, values))
        if output_dir is not None and self.data_parallel.is_main:
            document = {name: {**replay.reward_distribution(values), "values": values} for name, values in groups.items()}
            (output_dir / "reward_distribution.json").write_text(json.dumps(document, indent=1))
        return metrics

    # ----- replay ---------------------------------------------------------------------------------
    def training_pairs(self, iteration: int) -> Dataset:
        """The pairs iteration ``iteration`` trains on (its shard, or a replay of several)."""
        options = self.options
        return replay.training_pairs(self.pairs_by_iteration, iteration, self.replay_mode, options.preference_replay_k,
                                     options.preference_replay_lambda, options.preference_replay_sample_size,
                                     self.args.seed)

    # ----- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"pairs": [pairs.to_list() for pairs in self.pairs_by_iteration],
                "comparator": self.comparator.state_dict() if self.comparator is not None else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pairs_by_iteration = [preferences.pairs_dataset(records) for records in state["pairs"]]
        if self.comparator is not None:
            self.comparator.load_state_dict(state.get("comparator", {}))
