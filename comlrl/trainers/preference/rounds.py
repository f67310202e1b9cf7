"""The stage loop of preference runs: iterations of named stages, each one checkpoint boundary.

:class:`PreferenceRounds` is what MARLHFTrainer (collect -> fit reward model -> learn policy) and
MADPOIterTrainer (collect -> learn policy) share: the iteration and stage counters, running the
next stage (the pipeline runs one task per call of :meth:`PreferenceRounds.run_next_stage`), the
run's output directory (never overwritten: a resumed run writes into ``resume-N``) with its
``history.jsonl`` of stage records, and the access to the agents, data and callbacks of the
policy trainer the run holds as ``policy_trainer``.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from comlrl.callbacks import dispatch
from comlrl.models import entities
from comlrl.progress import Boundary, TrainerState, stage_plan
from comlrl.training.loop import TrainingLoop, rng_restorer
from comlrl.training.signals import StopRequest

logger = logging.getLogger(__name__)


@dataclass
class PbRLState(TrainerState):
    """Progress of a preference run: the iteration, the next stage within it, and the steps already
    taken inside a stage that resumes mid-way (MADPOIterTrainer's DPO stage).

    ``history`` is the per-step history (one list with the policy trainer's, tagged with the iteration)."""

    iteration: int = 0
    stage: int = 0
    stage_step: int = 0
    stage_records: list[dict[str, Any]] = field(default_factory=list)


class PreferenceRounds(TrainingLoop):
    """``num_iterations`` rounds of ``STAGES``; subclasses define one method per stage name.

    The run holds a policy trainer (``policy_trainer``) and talks to it through its documented
    methods only. What it shows of it (``agents``, ``tokenizers``, ``num_agents``, the datasets,
    ``callbacks``, ``history``, ``evaluations``) is read-only (``num_agents`` takes only its own value).
    """

    STAGES: tuple[str, ...] = ()
    # Stages that leave nothing behind until they return: one that fails is simply run again.
    REPEATABLE_STAGES: tuple[str, ...] = ("collect_preferences", "prepare_pairs", "fit_reward_model")
    boundary_kind = "pbrl_stage"
    # Set by subclasses: the policy trainer, the progress, the comparator (or None), the output directory.
    policy_trainer: Any
    state: PbRLState
    comparator: Any = None
    output_path: Path | None = None

    @classmethod
    def iterations_of(cls, args: Any) -> int:
        """Iterations a run with ``args`` makes (1 unless the trainer is iterative)."""
        return 1

    @classmethod
    def plan_boundaries(cls, args: Any) -> list[Boundary]:
        return stage_plan(cls.STAGES, cls.iterations_of(args))

    @classmethod
    def planned_boundaries(cls, args: Any) -> int:
        """Boundaries (stages) a run with ``args`` has."""
        return len(cls.plan_boundaries(args))

    @property
    def num_iterations(self) -> int:
        return self.iterations_of(self.args)

    # What the run shows of its policy trainer (read-only; agents accepts its own value, as num_agents does).
    agents = property(lambda self: self.policy_trainer.agents,
                      lambda self, value: entities.keep_agents(type(self).__name__, self.policy_trainer.agents, value))
    tokenizers = property(lambda self: self.policy_trainer.tokenizers)
    agent_models = property(lambda self: self.policy_trainer.agent_models)
    model_name = property(lambda self: self.policy_trainer.model_name)
    device = property(lambda self: self.policy_trainer.device)
    agent_sources = property(lambda self: self.policy_trainer.agent_sources)
    rollout_spec = property(lambda self: self.policy_trainer.rollout_spec)
    dtype = property(lambda self: self.policy_trainer.dtype)
    train_dataset = property(lambda self: self.policy_trainer.train_dataset)
    eval_dataset = property(lambda self: self.policy_trainer.eval_dataset)
    callbacks = property(lambda self: self.policy_trainer.callbacks)
    data_parallel = property(lambda self: self.policy_trainer.data_parallel)
    history = property(lambda self: self.policy_trainer.history)
    evaluations = property(lambda self: self.policy_trainer.evaluations)

    @property
    def num_agents(self) -> int:
        """The policy trainer's; assigning its own value is accepted (1.4.3 code may), any other refused."""
        return self.policy_trainer.num_agents

    @num_agents.setter
    def num_agents(self, value: int) -> None:
        entities.keep_num_agents(type(self).__name__, self.policy_trainer.num_agents, value)

    def run_agents_with(self, agent_map: Any, private_tokenizers: bool = False) -> None:
        """Route the per-agent work of the policy trainer (collection included) through ``agent_map``."""
        self.policy_trainer.run_agents_with(agent_map, private_tokenizers)

    def check_can_train(self) -> None:
        super().check_can_train()
        self.policy_trainer.check_context(self.policy_trainer.agents)

    def planned_training_steps(self) -> int:
        return self.policy_trainer.planned_training_steps()

    def watch_stop(self, request: StopRequest, progress: Any = None) -> None:
        super().watch_stop(request)
        self.policy_trainer.watch_stop(request, progress)  # the policy's steps check it

    # ----- the stage loop -----------------------------------------------------------------------
    def on_run_begin(self, resuming: bool) -> None:
        self.prepare_output_dir(resuming=resuming)
        if self.comparator is not None and self.output_path is not None:
            self.comparator.use_output_dir(self.output_path)

    def on_run_end(self) -> None:
        self._advance_iteration()

    def total_boundaries(self) -> int:
        return len(self.STAGES) * self.num_iterations

    def steps_left(self) -> int:
        return 0  # a stage is one call (its policy steps run inside it)

    def take_step(self, window: Any, progress: Any = None) -> None:
        raise RuntimeError(f"{type(self).__name__}'s boundaries are stages without separate steps; use close_boundary()")

    def close_boundary(self, window: Any = None) -> dict[str, float]:
        """The next stage (a policy stage logs through its own window). However it ends (done, a stop request
        between two policy steps, an error) the run's step counter is the policy's: a stop inside a policy
        stage is checkpointed after its last finished step (``checkpoint-N-stepS``), not at the stage's start."""
        try:
            return self.run_next_stage()
        finally:
            self.state.global_step = self.policy_trainer.state.global_step

    def recover_after_failure(self) -> bool:
        """A failed stage is repeated from its start (see :data:`REPEATABLE_STAGES`); inside the policy
        stage the policy trainer's own steps decide."""
        return self.policy_trainer.recover_after_failure() and self.step_guard.recover()

    def run_next_stage(self) -> dict[str, float]:
        """Run the next stage (one boundary) and count it."""
        self._advance_iteration()
        name = self.STAGES[self.state.stage]
        self.step_guard.begin(self.stage_restorer() if name in self.REPEATABLE_STAGES else (lambda: None))
        metrics = getattr(self, name)()
        self.record_stage(name, metrics)
        self.state.stage += 1
        self.state.stage_step = 0
        self.state.boundaries += 1
        self.step_guard.end()
        return metrics

    def stage_restorer(self) -> Any:
        """What puts the RNGs and the task reward's counters back to the start of a repeatable stage."""
        rng, reward = rng_restorer(), copy.deepcopy(self.task_reward.state_dict())

        def restore() -> None:
            rng()
            self.task_reward.load_state_dict(reward)

        return restore

    def _advance_iteration(self) -> None:
        if self.state.stage == len(self.STAGES):
            self.state.stage = 0
            self.state.iteration += 1

    def record_stage(self, name: str, metrics: dict[str, float]) -> None:
        record = {"iteration": self.state.iteration, "stage": name, **metrics}
        self.state.stage_records.append(record)
        logger.info("iteration %d, %s: %s", self.state.iteration, name, metrics)
        dispatch(self.callbacks, "on_log", self, {f"pbrl/{k}": v for k, v in metrics.items()}, self.state.boundaries + 1)
        if self.output_path is not None and self.data_parallel.is_main:
            with open(self.output_path / "history.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")

    def _iteration_output(self) -> Path | None:
        if self.output_path is None:
            return None
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
                f"{type(self.args).__name__}.output_dir {str(root)!r} already contains files; give a new directory, "
                "or resume with train(resume_from_checkpoint=...) to write into a resume-* subdirectory"
            )
        if occupied:
            number = 1
            while (root / f"resume-{number}").exists():
                number += 1
            root = root / f"resume-{number}"
        root.mkdir(parents=True, exist_ok=True)
        self.output_path = root

    # ----- state and export ---------------------------------------------------------------------
    def checkpoint_modules(self) -> dict[str, torch.nn.Module]:
        return self.policy_trainer.checkpoint_modules()

    def check_resume_progress(self, saved_state: dict[str, Any]) -> None:
        if saved_state["iteration"] > self.num_iterations:
            raise ValueError(
                f"the checkpoint has completed {saved_state['iteration']} iterations but num_iterations is "
                f"{self.num_iterations}; num_iterations counts the whole run, so raise it"
            )

    def save_model(self, output_dir: str | Path) -> Path:
        """Export the agents (the policy trainer's ``save_model``: ``output_dir/agent_i``)."""
        return self.policy_trainer.save_model(output_dir)
