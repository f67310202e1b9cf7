"""Run the benchmark workload with the reference implementation (PyPI ``comlrl``, in .venv-peers).

The reference trains on one prompt per step, and steps an agent's optimizer each time its
rollout buffer holds ``rollout_buffer_size`` samples; with a buffer of 1 a step is the same
work as this library's step with ``per_device_train_batch_size=1``. The stages are timed by
wrapping its methods from outside: ``_generate_completions`` (generation),
``_compute_rewards`` (reward), ``_compute_loss_with_gradients`` (the log-prob forward and
loss) and ``_drain_ready_buffers`` (the whole update).
"""

from __future__ import annotations

import time

from workload import PROCESS_START, PhaseTimer, RunResult, StepRecord, Workload, joint_reward, model_dtype, runner_parser, versions


def build_trainer(workload: Workload):
    from datasets import Dataset

    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    config = MAGRPOConfig(
        num_train_epochs=1,
        agent_learning_rate=workload.learning_rate,
        logging_steps=10**6,
        num_agents=workload.num_agents,
        agent_devices=workload.device,
        num_generations=workload.num_generations,
        max_new_tokens=workload.max_new_tokens,
        temperature=workload.temperature,
        top_p=1.0,
        top_k=None,
        num_turns=1,
        early_termination_threshold=None,
        eval_interval=0,
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
    tokens = {"count": 0, "decode_steps": 0}
    generate, step = trainer._generate_completions, trainer._train_step_returns

    def counted_generate(*args, **kwargs):
        produced = generate(*args, **kwargs)
        tokens["count"] += sum(produced["response_lens"])
        tokens["decode_steps"] += max(len(ids) for ids in produced["completion_input_ids"][0])
        return produced

    def timed_step(batch_item, **kwargs):
        timer.take()
        tokens["count"] = tokens["decode_steps"] = 0
        start, cpu_start = time.perf_counter(), time.process_time()
        if not result.startup_time:
            result.startup_time = start - PROCESS_START
        step(batch_item, **kwargs)
        end = time.perf_counter()
        if not result.first_step_end:
            result.first_step_end = end - PROCESS_START
        samples = workload.num_agents * workload.num_generations
        result.steps.append(StepRecord(end - start, timer.take(), samples, tokens["count"], time.process_time() - cpu_start,
                                       tokens["decode_steps"]))

    trainer._generate_completions = timer.wrap("generation", counted_generate)
    trainer._compute_rewards = timer.wrap("reward", trainer._compute_rewards)
    trainer._compute_loss_with_gradients = timer.wrap("forward", trainer._compute_loss_with_gradients)
    trainer._drain_ready_buffers = timer.wrap("update", trainer._drain_ready_buffers)
    trainer._train_step_returns = timed_step
    trainer.train()
    result.steps = result.steps[workload.warmup_steps:]
    result.finish(workload.device)
    return result


def main() -> None:
    args = runner_parser(__doc__).parse_args()
    run(Workload.from_arguments(args)).emit(args.output)


if __name__ == "__main__":
    main()
