"""Run one algorithm of the family (``--algorithm``) with the reference comlrl 1.4.3 (benchmarks/.venv-peers).

Settings match ``run_ours_family.py`` (``family.py`` holds the shared rows, the letters
reward's logic, the centralized format and the evaluation). The REINFORCE family and
centralized MAGRPO take one prompt per step with ``rollout_buffer_size=train_batch_size=1``
(one optimizer step per agent per prompt, as ours with ``per_device_train_batch_size=1``) and
``advantage_normalization=False`` (its re-centring would turn every mode into MAGRPO's); a
step is ``_train_step_returns``. MADPO is not stepwise in the reference: it samples every
prompt's pairs once with the initial policy, then trains on the shuffled pairs in batches of
``train_batch_size`` (= pairs per prompt). Its "step" here is a prompt's collection
(``_generate_preference_pairs_for_item``) plus one batch update (``_update_from_preference_batch``),
each timed on its own and paired in order.
"""

from __future__ import annotations

import family
from family import ADVANTAGE_MODES, SeparatedAdapter, eval_rows, evaluate, letters_reward, train_rows
from workload import PhaseTimer, RunResult, StepClock, StepRecord, Workload, model_dtype, versions


def build_trainer(algorithm: str, workload: Workload, pairs_per_prompt: int = 2, dpo_beta: float = 0.1):
    from datasets import Dataset

    from comlrl import trainers

    dataset = Dataset.from_list(train_rows(workload.total_steps))
    kwargs = dict(agent_model=workload.model_dir, num_agents=workload.num_agents,
                  model_config={"dtype": model_dtype(workload.device)}, train_dataset=dataset,
                  reward_func=letters_reward, wandb_config=None)
    settings = workload.reference_config()
    if algorithm in ADVANTAGE_MODES:
        name = {"mareinforce": "MAREINFORCE", "maremax": "MAReMax", "marloo": "MARLOO"}[algorithm]
        config = getattr(trainers, f"{name}Config")(num_agents=workload.num_agents, num_generations=workload.num_generations,
                                                    advantage_mode=ADVANTAGE_MODES[algorithm], advantage_normalization=False,
                                                    rollout_buffer_size=1, train_batch_size=1, **settings)
        return getattr(trainers, f"{name}Trainer")(args=config, **kwargs)
    if algorithm == "magrpo_centralized":
        from comlrl.trainers.reinforce import CentralizedMAGRPOConfig, CentralizedMAGRPOTrainer

        config = CentralizedMAGRPOConfig(num_agents=workload.num_agents, num_generations=workload.num_generations,
                                                  advantage_mode="mean", advantage_normalization=False,
                                                  rollout_buffer_size=1, train_batch_size=1, **settings)
        return CentralizedMAGRPOTrainer(centralized_adapter=SeparatedAdapter(), args=config, **kwargs)
    if algorithm == "madpo":
        config = trainers.MADPOConfig(num_agents=workload.num_agents, preference_num_candidates=workload.num_generations,
                                      preference_pairs_per_sample=pairs_per_prompt, pair_selection="reward_gap",
                                      dpo_beta=dpo_beta, rollout_buffer_size=pairs_per_prompt,
                                      train_batch_size=pairs_per_prompt, **settings)
        return trainers.MADPOTrainer(args=config, **kwargs)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def timed_list(timer: PhaseTimer, func, times: list[float]):
    """``func`` with each call's wall time appended to ``times``."""
    import time

    def call(*args, **kwargs):
        timer.sync()
        start = time.perf_counter()
        value = func(*args, **kwargs)
        timer.sync()
        times.append(time.perf_counter() - start)
        return value

    return call


def run(algorithm: str, workload: Workload, eval_prompts: int = 4, eval_samples: int = 4,
        pairs_per_prompt: int = 2, dpo_beta: float = 0.1) -> RunResult:
    workload.setup_torch()
    timer = PhaseTimer(workload.device)
    result = RunResult("reference", vars(workload).copy(), versions("torch", "transformers", "comlrl"))
    result.notes.append(algorithm)
    trainer = build_trainer(algorithm, workload, pairs_per_prompt, dpo_beta)
    trainer.verbose = False
    centralized = algorithm == "magrpo_centralized"

    def eval_reward() -> float:
        return evaluate(trainer.agents, trainer.tokenizers, eval_rows(eval_prompts), eval_samples,
                        workload.max_new_tokens, workload.seed, centralized)

    before = eval_reward()
    if algorithm == "madpo":
        collect: list[float] = []
        updates: list[float] = []
        trainer._generate_preference_pairs_for_item = timed_list(timer, trainer._generate_preference_pairs_for_item, collect)
        trainer._update_from_preference_batch = timed_list(timer, trainer._update_from_preference_batch, updates)
        trainer.train()
        # One "step" = one prompt's collection + one batch update, paired in order.
        for gathered, updated in zip(collect, updates):
            result.steps.append(StepRecord(gathered + updated, {"collection": gathered, "update": updated},
                                           workload.num_generations, 0))
        result.notes.append(f"madpo_prompts={len(collect)} madpo_updates={len(updates)}")
    else:
        clock = StepClock(result, timer)
        trainer._train_step_returns = clock.timed(trainer._train_step_returns, lambda *a, **k: workload.num_generations)
        trainer.train()
    return family.finish(result, workload, before, eval_reward())


if __name__ == "__main__":
    family.main(run, __doc__)
