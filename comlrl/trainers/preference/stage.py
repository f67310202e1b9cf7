"""The preference stage of PbRL: collect preference pairs with the current agents, fit the joint reward model.

A component with its own state (the pairs of every iteration, in its
:class:`~comlrl.trainers.preference.collect.PreferenceCollection`, and the fitted reward model),
used by :class:`~comlrl.trainers.preference.marlhf.MARLHFTrainer` beside an ordinary policy trainer.

Under data parallelism every process collects the pairs of its share of the prompts and all
processes then hold the union (gathered in prompt order), fit the same reward model from the
same fresh weights on the same pairs, and finally take rank 0's fitted weights, so every rank
optimises the same learned reward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from datasets import Dataset

from comlrl.rollout import preferences
from comlrl.models.reward_model import JointRewardModel
from comlrl.training.reward_fit import fit_reward_model
from comlrl.rollout.rewards import JointReward
from comlrl.trainers.preference.collect import PreferenceCollection


class PreferenceStage:
    """Pairs per iteration (collected against the comparator) and the joint reward model fitted on them."""

    def __init__(self, args: Any, options: Any, reward_model_source: str, reward_device: torch.device,
                 dtype: torch.dtype, data_parallel: Any, comparator: Any = None, num_agents: int | None = None) -> None:
        self.args = args
        self.num_agents = num_agents
        self.reward_model_source = reward_model_source
        self.reward_device = reward_device
        self.dtype = dtype
        self.data_parallel = data_parallel
        replay_mode = "all" if args.pool_preference_pairs else options.preference_replay_mode
        self.collection = PreferenceCollection(args, options, data_parallel, comparator,
                                               args.preference_num_generations or args.num_generations, replay_mode)
        self.reward_model: JointRewardModel | None = None

    @property
    def pairs_by_iteration(self) -> list[Dataset]:
        return self.collection.pairs_by_iteration

    def collect(self, policy: Any, task_reward: JointReward, iteration: int, output_dir: Path | None) -> dict[str, float]:
        """Sample joint responses with the policy's agents (and the comparator), label pairs by the task reward."""
        return self.collection.collect(policy, task_reward, iteration, output_dir)

    # ----- reward-model fit -----------------------------------------------------------------------
    def training_pairs(self, iteration: int) -> Dataset:
        """This iteration's pairs, or their replay with earlier ones (pool_preference_pairs, preference_replay_mode)."""
        return self.collection.training_pairs(iteration)

    def load_reward_model(self) -> JointRewardModel:
        """A fresh reward model from its source; the new head is drawn from a fixed seed so every
        reload starts from the same weights, without touching the training RNG."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.args.seed)
            return JointRewardModel.load(self.reward_model_source, self.reward_device, self.dtype,
                                         self.args.reward_max_length, self.args.trust_remote_code, self.num_agents)

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
            "collection": self.collection.state_dict(),
            "reward_model": ({name: tensor.detach().cpu() for name, tensor in self.reward_model.state_dict().items()}
                             if self.reward_model is not None else None),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.collection.load_state_dict(state["collection"])
        self.reward_model = None
        if state["reward_model"] is not None:
            self.reward_model = self.load_reward_model()
            self.reward_model.load_state_dict(state["reward_model"])
