"""Run the benchmark workload with this library's MAGRPOTrainer (the project's .venv)."""

from __future__ import annotations

from typing import Any, Callable

from workload import PhaseTimer, RunResult, StepClock, Workload, joint_reward, runner_parser, versions


def build_trainer(workload: Workload, timer: PhaseTimer, generation_backend: str = "comlrl", precision: str = "auto"):
    from datasets import Dataset

    import comlrl.training.policy_update
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    config = MAGRPOConfig(num_agents=workload.num_agents, generation_backend=generation_backend, precision=precision,
                          **workload.ours_config())
    # The log-prob forward passes of the update, timed where every trainer calls them.
    original = getattr(comlrl.training.policy_update.completion_logprobs, "__wrapped__", comlrl.training.policy_update.completion_logprobs)
    comlrl.training.policy_update.completion_logprobs = timer.wrap("forward", original)
    return MAGRPOTrainer(
        agent_model=workload.model_dir,
        num_agents=workload.num_agents,
        reward_func=joint_reward,
        train_dataset=Dataset.from_list(workload.rows()),
        args=config,
    )


def counted_rollout(rollout: Callable, clock: StepClock) -> Callable:
    """The trainer's ``rollout`` stage, counting its generated tokens and decode steps on ``clock``."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        produced = rollout(*args, **kwargs)
        clock.count(produced.generated_tokens(),
                    sum(g.completion_ids.shape[1] for turn in produced.turns for g in turn.generations))
        return produced

    return counted


def run(workload: Workload, generation_backend: str = "comlrl", precision: str = "auto") -> RunResult:
    workload.setup_torch()
    timer = PhaseTimer(workload.device)
    result = RunResult("ours", vars(workload).copy(), versions("torch", "transformers", "comlrl"))
    result.notes.append(f"generation_backend={generation_backend}")
    result.notes.append(f"precision={precision}")
    trainer = build_trainer(workload, timer, generation_backend, precision)
    clock = StepClock(result, timer)
    trainer.rollout = timer.wrap("generation", counted_rollout(trainer.rollout, clock))
    trainer.score = timer.wrap("reward", trainer.score)
    trainer.update = timer.wrap("update", trainer.update)
    trainer.train_step = clock.timed(trainer.train_step, lambda rows: workload.samples_per_step(len(rows)))
    trainer.train()
    result.finish(workload)
    return result


def main() -> None:
    parser = runner_parser(__doc__)
    parser.add_argument("--generation-backend", default="comlrl", choices=("comlrl", "transformers"),
                        help="MAGRPOConfig.generation_backend: our decode loop, or model.generate (the 'before')")
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16-mixed"),
                        help="MAGRPOConfig.precision ('auto': float32 on CPU, bf16 on CUDA)")
    args = parser.parse_args()
    run(Workload.from_arguments(args), args.generation_backend, args.precision).emit(args.output)


if __name__ == "__main__":
    main()
