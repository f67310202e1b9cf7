"""Run the single-agent workload with TRL's GRPOTrainer (in .venv-peers): MAGRPO with one agent is GRPO.

A step is one optimizer step on one prompt's ``num_generations`` completions (TRL's
``per_device_train_batch_size`` counts completions). Stages are timed by wrapping its
methods: ``_generate`` (generation), ``_calculate_rewards`` (reward), ``_compute_loss`` (the
log-prob forward and loss); ``_prepare_inputs`` holds generation and scoring, so the update
is the step minus it. Step boundaries come from a TrainerCallback (they include the
optimizer step, which runs outside ``training_step``).
"""

from __future__ import annotations

import tempfile

from workload import PhaseTimer, RunResult, StepClock, Workload, joint_reward, runner_parser, versions


def trl_reward(prompts, completions, **kwargs):
    return joint_reward(completions)


def run(workload: Workload) -> RunResult:
    if workload.num_agents != 1:
        raise SystemExit(f"run_trl.py is the single-agent comparison; got --num-agents {workload.num_agents}")
    workload.setup_torch()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    timer = PhaseTimer(workload.device)
    result = RunResult("trl", vars(workload).copy(), versions("torch", "transformers", "trl"))
    cuda = workload.device.startswith("cuda")
    output_dir = tempfile.mkdtemp(prefix="trl-bench-")
    config = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=workload.num_generations,
        num_generations=workload.num_generations,
        max_completion_length=workload.max_new_tokens,
        max_steps=workload.total_steps,
        learning_rate=workload.learning_rate,
        temperature=workload.temperature,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        logging_steps=10**6,
        report_to="none",
        save_strategy="no",
        use_cpu=not cuda,
        bf16=cuda,
        seed=workload.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    dtype = torch.bfloat16 if cuda else torch.float32
    model = AutoModelForCausalLM.from_pretrained(workload.model_dir, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(workload.model_dir)
    tokenizer.padding_side = "left"
    clock = StepClock(result, timer)

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, trainer_state, control, **kwargs):
            clock.begin()

        def on_step_end(self, args, trainer_state, control, **kwargs):
            record = clock.end(workload.num_generations)
            # TRL's update is the step outside its input preparation (which holds generation and reward).
            record.phases["update"] = max(record.step_time - record.phases.get("prepare", 0.0), 0.0)

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=trl_reward,
        args=config,
        train_dataset=Dataset.from_list(workload.rows() * workload.num_generations),
        processing_class=tokenizer,
        callbacks=[StepTimes()],
    )
    generate = trainer._generate

    def counted_generate(prompts):
        produced = generate(prompts)
        completion_ids = produced[1]  # (prompt_ids, completion_ids, ...): lists of token IDs
        clock.count(sum(len(ids) for ids in completion_ids), max(len(ids) for ids in completion_ids))
        return produced

    trainer._generate = timer.wrap("generation", counted_generate)
    trainer._calculate_rewards = timer.wrap("reward", trainer._calculate_rewards)
    trainer._compute_loss = timer.wrap("forward", trainer._compute_loss)
    trainer._prepare_inputs = timer.wrap("prepare", trainer._prepare_inputs)
    trainer.train()
    result.finish(workload)
    return result


def main() -> None:
    parser = runner_parser(__doc__)
    parser.set_defaults(num_agents=1)
    args = parser.parse_args()
    run(Workload.from_arguments(args)).emit(args.output)


if __name__ == "__main__":
    main()
