"""Run the benchmark workload with the reference implementation (PyPI ``comlrl``, in .venv-peers).

The reference trains on one prompt per step, and steps an agent's optimizer each time its
rollout buffer holds ``rollout_buffer_size`` samples; with a buffer of 1 a step is the same
work as this library's step with ``per_device_train_batch_size=1``. The stages are timed by
wrapping its methods from outside: ``_generate_completions`` (generation),
``_compute_rewards`` (reward), ``_compute_loss_with_gradients`` (the log-prob forward and
loss) and ``_drain_ready_buffers`` (the whole update).
"""

from __future__ import annotations

from workload import PhaseTimer, RunResult, StepClock, Workload, joint_reward, model_dtype, runner_parser, versions



def instrument(trainer, timer: PhaseTimer, clock, *timed_args) -> None:
    """Time the reference trainer's phases from outside (its private methods, wrapped) and count the
    tokens it generates; ``clock.timed`` wraps each training step (``timed_args``: its extra arguments)."""
    generate = trainer._generate_completions

    def counted_generate(*args, **kwargs):
        produced = generate(*args, **kwargs)
        clock.count(sum(produced["response_lens"]), max(len(ids) for ids in produced["completion_input_ids"][0]))
        return produced

    trainer._generate_completions = timer.wrap("generation", counted_generate)
    trainer._compute_rewards = timer.wrap("reward", trainer._compute_rewards)
    trainer._compute_loss_with_gradients = timer.wrap("forward", trainer._compute_loss_with_gradients)
    trainer._drain_ready_buffers = timer.wrap("update", trainer._drain_ready_buffers)
    trainer._train_step_returns = clock.timed(trainer._train_step_returns, *timed_args)

def build_trainer(workload: Workload):
    from datasets import Dataset

    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    config = MAGRPOConfig(
        num_agents=workload.num_agents,
        num_generations=workload.num_generations,
        **workload.reference_config(),
        rollout_buffer_size=1,
        train_batch_size=1,
    )
    return MAGRPOTrainer(
        agent_model=workload.model_dir,
        num_agents=workload.num_agents,
        model_config={"dtype": model_dtype(workload.device)},
        train_dataset=Dataset.from_list(workload.rows()),
        reward_func=joint_reward,
        wandb_config=None,
        args=config,
    )


def run(workload: Workload) -> RunResult:
    workload.setup_torch()
    timer = PhaseTimer(workload.device)
    result = RunResult("reference", vars(workload).copy(), versions("torch", "transformers", "comlrl"))
    trainer = build_trainer(workload)
    trainer.verbose = False
    clock = StepClock(result, timer)
    instrument(trainer, timer, clock, lambda *args, **kwargs: workload.samples_per_step())
    trainer.train()
    result.finish(workload)
    return result


def main() -> None:
    args = runner_parser(__doc__).parse_args()
    run(Workload.from_arguments(args)).emit(args.output)


if __name__ == "__main__":
    main()
