"""Run the MAAC benchmark workload with this library's MAACTrainer (the project's .venv).

2 agents and one centralised V critic (a copy of the benchmark model with a value head).
The stages are timed by wrapping the trainer's own methods: ``rollout`` (generation),
``score`` (reward), ``critic_inputs`` + ``values`` (the critic's value forward at rollout
time), ``advantages`` + ``update`` (the whole actor + critic update); the forward passes
inside the update (``completion_logprobs`` of each actor, ``sequence_values`` of the critic)
are timed as ``forward``.
"""

from __future__ import annotations


from workload import PhaseTimer, RunResult, StepClock, Workload, joint_reward, runner_parser, swapped, versions

from run_ours import counted_rollout


def build_trainer(workload: Workload):
    from datasets import Dataset

    from comlrl.trainers.actor_critic import MAACConfig, MAACTrainer

    config = MAACConfig(
        num_agents=workload.num_agents,
        critic_learning_rate=workload.learning_rate,
        value_head_learning_rate=None,  # the head at the critic's rate too, as the reference
        critic_type="v",
        value_loss_coef=0.5,
        gae_lambda=0.0,  # one turn: advantage r - V, critic target r (as the reference)
        normalize_advantages=False,
        **workload.ours_config(),
    )
    return MAACTrainer(
        agent_model=workload.model_dir,
        num_agents=workload.num_agents,
        critic_model=workload.model_dir,
        reward_func=joint_reward,
        train_dataset=Dataset.from_list(workload.rows()),
        args=config,
    )




def run(workload: Workload) -> RunResult:
    import comlrl.training.policy_update
    import comlrl.trainers.actor_critic.base as actor_critic_base

    workload.setup_torch()
    timer = PhaseTimer(workload.device)
    result = RunResult("ours", vars(workload).copy(), versions("torch", "transformers", "comlrl"))
    result.notes.append("MAAC, centralised V critic")
    trainer = build_trainer(workload)
    clock = StepClock(result, timer)
    # The update's forward passes (each actor's log-probs, the critic's values), timed as "forward".
    forwards = [(module, name, timer.wrap_inside("update", "forward", getattr(module, name)))
                for module, name in ((comlrl.training.policy_update, "completion_logprobs"), (actor_critic_base, "sequence_values"))]
    with swapped(*forwards):  # put back after the run (the smoke test runs in-process)
        trainer.rollout = timer.wrap("generation", counted_rollout(trainer.rollout, clock))
        trainer.score = timer.wrap("reward", trainer.score)
        trainer.critic_inputs = timer.wrap("values", trainer.critic_inputs)
        trainer.values = timer.wrap("values", trainer.values)
        trainer.advantages = timer.wrap("update", trainer.advantages)
        trainer.update = timer.wrap("update", trainer.update)
        trainer.train_step = clock.timed(trainer.train_step, lambda rows: workload.samples_per_step(len(rows)))
        trainer.train()
    result.finish(workload)
    return result


def main() -> None:
    args = runner_parser(__doc__).parse_args()
    run(Workload.from_arguments(args)).emit(args.output)


if __name__ == "__main__":
    main()
