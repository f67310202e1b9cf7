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

from workload import PhaseTimer, RunResult, StepClock, Workload, joint_reward, model_dtype, runner_parser, versions


def build_trainer(workload: Workload):
    from datasets import Dataset

    from comlrl.trainers.actor_critic import MAACConfig, MAACTrainer

    config = MAACConfig(
        num_agents=workload.num_agents,
        num_generations=workload.num_generations,
        critic_learning_rate=workload.learning_rate,
        critic_type="v",
        value_loss_coef=0.5,
        advantage_normalization=False,
        rollout_buffer_size=workload.num_generations,
        train_batch_size=workload.num_generations,
        critic_devices=workload.device,
        **workload.reference_config(),
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
    clock = StepClock(result, timer)
    generate = trainer._generate

    def counted_generate(*args, **kwargs):
        produced = generate(*args, **kwargs)
        clock.count(sum(produced["response_lens"]), produced["sequences"].shape[1] - produced["prompt_len"])
        return produced

    trainer._generate = timer.wrap("generation", counted_generate)
    reference_maac.call_reward_function = timer.wrap("reward", reference_maac.call_reward_function)
    trainer._critic_value_from_text = timer.wrap("values", trainer._critic_value_from_text)
    trainer._policy_eval = timer.wrap_inside("update", "forward", trainer._policy_eval, outside="old_logprobs")
    trainer._value_on_prompt_only = timer.wrap_inside("update", "forward", trainer._value_on_prompt_only)
    trainer._drain_ready_agent_buffers = timer.wrap("update", trainer._drain_ready_agent_buffers)
    trainer._run_batch = clock.timed(trainer._run_batch, lambda batch, *rest: workload.samples_per_step(len(batch)))
    trainer.train()
    result.finish(workload)
    return result


def main() -> None:
    args = runner_parser(__doc__).parse_args()
    run(Workload.from_arguments(args)).emit(args.output)


if __name__ == "__main__":
    main()
