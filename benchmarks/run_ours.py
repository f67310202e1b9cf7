"""Run the benchmark workload with this library's MAGRPOTrainer (the project's .venv)."""

from __future__ import annotations

import time

from workload import RunResult, StepRecord, PhaseTimer, Workload, joint_reward, runner_parser, versions, PROCESS_START


def build_trainer(workload: Workload, timer: PhaseTimer, generation_backend: str = "comlrl"):
    from datasets import Dataset

    import comlrl.policy
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    config = MAGRPOConfig(
        num_agents=workload.num_agents,
        num_generations=workload.num_generations,
        max_new_tokens=workload.max_new_tokens,
        temperature=workload.temperature,
        top_p=1.0,
        top_k=None,
        agent_learning_rate=workload.learning_rate,
        num_train_epochs=1,
        per_device_train_batch_size=1,
        shuffle=False,
        seed=workload.seed,
        device=workload.device,
        disable_tqdm=True,
        logging_steps=10**6,
        generation_backend=generation_backend,
    )
    # The log-prob forward passes of the update, timed where every trainer calls them.
    original = getattr(comlrl.policy.completion_logprobs, "__wrapped__", comlrl.policy.completion_logprobs)
    comlrl.policy.completion_logprobs = timer.wrap("forward", original)
    return MAGRPOTrainer(
        agent_model=workload.model_dir,
        num_agents=workload.num_agents,
        reward_func=joint_reward,
        train_dataset=Dataset.from_list(workload.rows()),
        args=config,
    )


def run(workload: Workload, generation_backend: str = "comlrl") -> RunResult:
    workload.setup_torch()
    timer = PhaseTimer(workload.device)
    result = RunResult("ours", vars(workload).copy(), versions("torch", "transformers", "comlrl"))
    result.notes.append(f"generation_backend={generation_backend}")
    trainer = build_trainer(workload, timer, generation_backend)
    tokens = {"count": 0, "decode_steps": 0}
    rollout, score, update, train_step = trainer.rollout, trainer.score, trainer.update, trainer.train_step

    def counted_rollout(*args, **kwargs):
        produced = rollout(*args, **kwargs)
        tokens["count"] += produced.generated_tokens()
        tokens["decode_steps"] += sum(g.completion_ids.shape[1] for turn in produced.turns for g in turn.generations)
        return produced

    def timed_step(rows):
        timer.take()
        tokens["count"] = tokens["decode_steps"] = 0
        start, cpu_start = time.perf_counter(), time.process_time()
        if not result.startup_time:
            result.startup_time = start - PROCESS_START
        metrics = train_step(rows)
        end = time.perf_counter()
        if not result.first_step_end:
            result.first_step_end = end - PROCESS_START
        samples = workload.num_agents * workload.num_generations * len(rows)
        result.steps.append(StepRecord(end - start, timer.take(), samples, tokens["count"], time.process_time() - cpu_start,
                                       tokens["decode_steps"]))
        return metrics

    trainer.rollout = timer.wrap("generation", counted_rollout)
    trainer.score = timer.wrap("reward", score)
    trainer.update = timer.wrap("update", update)
    trainer.train_step = timed_step
    trainer.train()
    result.steps = result.steps[workload.warmup_steps:]
    result.finish(workload.device)
    return result


def main() -> None:
    parser = runner_parser(__doc__)
    parser.add_argument("--generation-backend", default="comlrl", choices=("comlrl", "transformers"),
                        help="MAGRPOConfig.generation_backend: our decode loop, or model.generate (the 'before')")
    args = parser.parse_args()
    run(Workload.from_arguments(args), args.generation_backend).emit(args.output)


if __name__ == "__main__":
    main()
