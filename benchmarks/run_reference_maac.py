"""Run the MAAC benchmark workload with the reference implementation (PyPI ``comlrl``, in .venv-peers).

The reference collects a prompt's samples into one buffer per agent and, when a buffer holds
``rollout_buffer_size`` samples, runs that agent's update: one actor step and one step of the
shared critic per ``train_batch_size`` samples. With both set to ``num_generations`` every
prompt gives one update per agent. Timed from outside by wrapping its methods: ``_generate``
(generation), ``call_reward_function`` (reward), ``_critic_value_from_text`` (the critic's
value forward at rollout time), ``_policy_eval`` outside the update (its rollout-time
log-prob forward, ``old_logprobs``) and ``_drain_ready_agent_buffers`` (the whole update),
of which ``_policy_eval`` and ``_value_on_prompt_only`` are the forward passes.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from workload import (PROCESS_START, PhaseTimer, RunResult, StepRecord, Workload, joint_reward, model_dtype, runner_parser,
                      versions)


def build_trainer(workload: Workload):
    from datasets import Dataset

    from comlrl.trainers.actor_critic import MAACConfig, MAACTrainer

    config = MAACConfig(
        num_agents=workload.num_agents,
        num_generations=workload.num_generations,
        max_new_tokens=workload.max_new_tokens,
        temperature=workload.temperature,
        top_p=1.0,
        top_k=None,
        agent_learning_rate=workload.learning_rate,
        critic_learning_rate=workload.learning_rate,
        critic_type="v",
        value_loss_coef=0.5,
        advantage_normalization=False,
        rollout_buffer_size=workload.num_generations,
        train_batch_size=workload.num_generations,
        num_turns=1,
        num_train_epochs=1,
        early_termination_threshold=None,
        eval_interval=0,
        logging_steps=10**6,
        agent_devices=workload.device,
        critic_devices=workload.device,
    )
    return MAACTrainer(
        agent_model=workload.model_dir,
        critic_model=workload.model_dir,
        model_config={"dtype": model_dtype(workload.device)},
        train_dataset=Dataset.from_list(workload.rows()),
        reward_func=joint_reward,
        wandb_config=None,
        args=config,
    )


def run(workload: Workload) -> RunResult:
    import comlrl.trainers.actor_critic.maac as reference_maac

    workload.setup_torch()
    timer = PhaseTimer(workload.device)
    result = RunResult("reference", vars(workload).copy(), versions("torch", "transformers", "comlrl"))
    result.notes.append("MAAC, centralised V critic")
    trainer = build_trainer(workload)
    trainer.verbose = False
    counts = {"tokens": 0, "decode_steps": 0}
    updating = [False]
    generate, run_batch, drain = trainer._generate, trainer._run_batch, trainer._drain_ready_agent_buffers

    def counted_generate(*args, **kwargs):
        produced = generate(*args, **kwargs)
        counts["tokens"] += sum(produced["response_lens"])
        counts["decode_steps"] += produced["sequences"].shape[1] - produced["prompt_len"]
        return produced

    def timed_step(batch, epoch_metrics):
        timer.take()
        counts["tokens"] = counts["decode_steps"] = 0
        start, cpu_start = time.perf_counter(), time.process_time()
        if not result.startup_time:
            result.startup_time = start - PROCESS_START
        run_batch(batch, epoch_metrics)
        end = time.perf_counter()
        if not result.first_step_end:
            result.first_step_end = end - PROCESS_START
        samples = workload.num_agents * workload.num_generations * len(batch)
        result.steps.append(StepRecord(end - start, timer.take(), samples, counts["tokens"], time.process_time() - cpu_start,
                                       counts["decode_steps"]))

    def timed_drain(*args, **kwargs):
        updating[0] = True
        try:
            return drain(*args, **kwargs)
        finally:
            updating[0] = False

    def by_phase(func: Callable, in_update: str, outside: str | None) -> Callable:
        """``func`` timed as ``in_update`` inside the update, as ``outside`` (or not at all) elsewhere."""
        inside_timed = timer.wrap(in_update, func)
        outside_timed = timer.wrap(outside, func) if outside else func

        def call(*args: Any, **kwargs: Any) -> Any:
            return (inside_timed if updating[0] else outside_timed)(*args, **kwargs)

        return call

    trainer._generate = timer.wrap("generation", counted_generate)
    reference_maac.call_reward_function = timer.wrap("reward", reference_maac.call_reward_function)
    trainer._critic_value_from_text = timer.wrap("values", trainer._critic_value_from_text)
    trainer._policy_eval = by_phase(trainer._policy_eval, "forward", "old_logprobs")
    trainer._value_on_prompt_only = by_phase(trainer._value_on_prompt_only, "forward", None)
    trainer._drain_ready_agent_buffers = timer.wrap("update", timed_drain)
    trainer._run_batch = timed_step
    trainer.train()
    result.steps = result.steps[workload.warmup_steps:]
    result.finish(workload.device)
    return result


def main() -> None:
    args = runner_parser(__doc__).parse_args()
    run(Workload.from_arguments(args)).emit(args.output)


if __name__ == "__main__":
    main()
