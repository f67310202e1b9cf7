"""Run the MAAC benchmark workload with this library's MAACTrainer (the project's .venv).

2 agents and one centralised V critic (a copy of the benchmark model with a value head).
The stages are timed by wrapping the trainer's own methods: ``rollout`` (generation),
``score`` (reward), ``critic_inputs`` + ``values`` (the critic's value forward at rollout
time), ``advantages`` + ``update`` (the whole actor + critic update); the forward passes
inside the update (``completion_logprobs`` of each actor, ``sequence_values`` of the critic)
are timed as ``forward``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from workload import PROCESS_START, PhaseTimer, RunResult, StepRecord, Workload, joint_reward, runner_parser, versions


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
        gae_lambda=0.0,  # one turn: advantage r - V, critic target r (as the reference)
        normalize_advantages=False,
        max_grad_norm=None,  # the reference's MAAC does not clip
        num_train_epochs=1,
        per_device_train_batch_size=1,
        shuffle=False,
        seed=workload.seed,
        device=workload.device,
        disable_tqdm=True,
        logging_steps=10**6,
    )
    return MAACTrainer(
        agent_model=workload.model_dir,
        num_agents=workload.num_agents,
        critic_model=workload.model_dir,
        reward_func=joint_reward,
        train_dataset=Dataset.from_list(workload.rows()),
        args=config,
    )


@contextmanager
def update_forwards_timed(timer: PhaseTimer, modules: list[tuple[Any, str]]) -> Iterator[Callable]:
    """Time ``module.name`` as ``forward`` while the returned update wrapper runs; restore them after.

    The same functions also run outside the update (the critic's rollout-time values), and
    those calls belong to their own phase, so a flag says whether the update is running.
    """
    updating = [False]

    def forward_in_update(func: Callable) -> Callable:
        timed = timer.wrap("forward", func)

        def call(*args: Any, **kwargs: Any) -> Any:
            return (timed if updating[0] else func)(*args, **kwargs)

        call.__wrapped__ = func
        return call

    originals = [(module, name, getattr(module, name)) for module, name in modules]
    for module, name, current in originals:
        setattr(module, name, forward_in_update(getattr(current, "__wrapped__", current)))

    def during_update(func: Callable) -> Callable:
        timed = timer.wrap("update", func)

        def call(*args: Any, **kwargs: Any) -> Any:
            updating[0] = True
            try:
                return timed(*args, **kwargs)
            finally:
                updating[0] = False

        return call

    try:
        yield during_update
    finally:
        for module, name, current in originals:
            setattr(module, name, current)


def run(workload: Workload) -> RunResult:
    import comlrl.policy
    import comlrl.trainers.actor_critic.base as actor_critic_base

    workload.setup_torch()
    timer = PhaseTimer(workload.device)
    result = RunResult("ours", vars(workload).copy(), versions("torch", "transformers", "comlrl"))
    result.notes.append("MAAC, centralised V critic")
    trainer = build_trainer(workload)
    tokens = {"count": 0, "decode_steps": 0}
    rollout, train_step = trainer.rollout, trainer.train_step

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

    forwards = [(comlrl.policy, "completion_logprobs"), (actor_critic_base, "sequence_values")]
    with update_forwards_timed(timer, forwards) as during_update:
        trainer.rollout = timer.wrap("generation", counted_rollout)
        trainer.score = timer.wrap("reward", trainer.score)
        trainer.critic_inputs = timer.wrap("values", trainer.critic_inputs)
        trainer.values = timer.wrap("values", trainer.values)
        trainer.advantages = timer.wrap("update", trainer.advantages)
        trainer.update = during_update(trainer.update)
        trainer.train_step = timed_step
        trainer.train()
    result.steps = result.steps[workload.warmup_steps:]
    result.finish(workload.device)
    return result


def main() -> None:
    args = runner_parser(__doc__).parse_args()
    run(Workload.from_arguments(args)).emit(args.output)


if __name__ == "__main__":
    main()
