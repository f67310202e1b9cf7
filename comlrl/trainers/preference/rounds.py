"""The stage loop of preference runs: iterations of named stages, each one checkpoint boundary.

:class:`PreferenceRounds` is what MARLHFTrainer (collect -> fit reward model -> learn policy) and
MADPOIterTrainer (collect -> learn policy) share: the iteration and stage counters, running the
next stage (the pipeline runs one task per call of :meth:`PreferenceRounds.run_next_stage`), the
run's output directory (never overwritten: a resumed run writes into ``resume-N``) with its
``history.jsonl`` of stage records, and the access to the agents, data and callbacks of the
policy trainer the run holds as ``policy_trainer``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from comlrl.callbacks import dispatch
from comlrl.training.loop import TrainerState, TrainingLoop
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
    """``num_iterations`` rounds of ``STAGES``; subclasses define one method per stage name."""

    STAGES: tuple[str, ...] = ()
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
    def planned_boundaries(cls, args: Any) -> int:
        """Boundaries (stages) a run with ``args`` has: what the pipeline counts its transactions by."""
        return len(cls.STAGES) * cls.iterations_of(args)

    @property
    def num_iterations(self) -> int:
        return self.iterations_of(self.args)

    # What the preference run shares with its policy trainer: one set of agents, data and callbacks.
    agents = property(lambda self: self.policy_trainer.agents)
    tokenizers = property(lambda self: self.policy_trainer.tokenizers)
    num_agents = property(lambda self: self.policy_trainer.num_agents)
    device = property(lambda self: self.policy_trainer.device)
    train_dataset = property(lambda self: self.policy_trainer.train_dataset)
    eval_dataset = property(lambda self: self.policy_trainer.eval_dataset)
    callbacks = property(lambda self: self.policy_trainer.callbacks)
    data_parallel = property(lambda self: self.policy_trainer.data_parallel)

    @property
    def agent_map(self) -> Any:
        return self.policy_trainer.agent_map

    @agent_map.setter
    def agent_map(self, agent_map: Any) -> None:
        self.policy_trainer.agent_map = agent_map

    def watch_stop(self, request: StopRequest) -> None:
        super().watch_stop(request)
        self.policy_trainer.watch_stop(request)  # the policy's steps check it

    # ----- the stage loop -----------------------------------------------------------------------
    def begin_training(self, **checkpoint_options: Any) -> Any:
        runner = super().begin_training(**checkpoint_options)
        self.prepare_output_dir(resuming=runner.resume_path is not None)
        history = self.comparator is not None and getattr(self.comparator, "kind", "") == "history"
        if history and self.comparator.directory is None and self.output_path is not None:
            self.comparator.directory = self.output_path / "policies"
        return runner

    def total_boundaries(self) -> int:
        return len(self.STAGES) * self.num_iterations

    def run_boundaries(self, runner: Any) -> None:
        while self.state.boundaries < self.total_boundaries():
            self.run_next_stage()
            runner.on_boundary()
        self._advance_iteration()

    def run_next_stage(self) -> dict[str, float]:
        """Run the next stage (one boundary) and count it; the pipeline runs one task per call."""
        self._advance_iteration()
        name = self.STAGES[self.state.stage]
        metrics = getattr(self, name)()
        self.record_stage(name, metrics)
        self.state.stage += 1
        self.state.stage_step = 0
        self.state.boundaries += 1
        return metrics

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
