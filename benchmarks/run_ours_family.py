"""Run one algorithm of the family (``--algorithm``) with this library's trainer (the project's .venv).

Every setting the reference runner sets is set here to the same value (``family.py`` holds
the shared rows, reward copy, centralized format and evaluation); where the two libraries'
defaults differ the reference's choice is taken (AdamW weight decay 0.01, no gradient
clipping, unnormalised advantages, a loss proportional to the original's summed sequence
log-probability via ``loss_type="dr_grpo"``, MADPO without a reference model in the ratio).
Only ``train_step`` is timed; the eval reward is measured before and after training.
"""

from __future__ import annotations

from typing import Any

import family
from family import ADVANTAGE_MODES, SeparatedAdapter, eval_rows, evaluate, train_rows
from workload import PhaseTimer, RunResult, StepClock, Workload, versions


def common_settings(workload: Workload) -> dict[str, Any]:
    return dict(workload.ours_config(), weight_decay=0.01)  # torch AdamW's default, which the reference uses


def build_trainer(algorithm: str, workload: Workload, pairs_per_prompt: int = 2, dpo_beta: float = 0.1):
    from datasets import Dataset

    from comlrl import trainers
    from comlrl.tasks.letters import letters_reward

    dataset = Dataset.from_list(train_rows(workload.total_steps))
    settings = common_settings(workload)
    if algorithm in ADVANTAGE_MODES:
        name = {"mareinforce": "MAREINFORCE", "maremax": "MAReMax", "marloo": "MARLOO"}[algorithm]
        config = getattr(trainers, f"{name}Config")(num_agents=workload.num_agents, advantage_mode=ADVANTAGE_MODES[algorithm],
                                                    normalize_advantages=False, loss_type="dr_grpo", **settings)
        return getattr(trainers, f"{name}Trainer")(agent_model=workload.model_dir, num_agents=workload.num_agents,
                                                   reward_func=letters_reward, train_dataset=dataset, args=config)
    if algorithm == "magrpo_centralized":
        config = trainers.CentralizedMAGRPOConfig(num_agents=workload.num_agents, advantage_mode="mean",
                                                  normalize_advantages=False, loss_type="dr_grpo", **settings)
        return trainers.CentralizedMAGRPOTrainer(agent_model=workload.model_dir, num_agents=workload.num_agents,
                                                 reward_func=letters_reward, collaboration=SeparatedAdapter(),
                                                 train_dataset=dataset, args=config)
    if algorithm == "madpo":
        config = trainers.MADPOConfig(num_agents=workload.num_agents, max_pairs_per_prompt=pairs_per_prompt,
                                      pair_selection="reward_gap", dpo_beta=dpo_beta, dpo_reference="none", **settings)
        return trainers.MADPOTrainer(agent_model=workload.model_dir, num_agents=workload.num_agents,
                                     reward_func=letters_reward, train_dataset=dataset, args=config)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def run(algorithm: str, workload: Workload, eval_prompts: int = 4, eval_samples: int = 4,
        pairs_per_prompt: int = 2, dpo_beta: float = 0.1) -> RunResult:
    workload.setup_torch()
    timer = PhaseTimer(workload.device)
    result = RunResult("ours", vars(workload).copy(), versions("torch", "transformers", "comlrl"))
    result.notes.append(algorithm)
    trainer = build_trainer(algorithm, workload, pairs_per_prompt, dpo_beta)
    centralized = algorithm == "magrpo_centralized"

    def eval_reward() -> float:
        return evaluate(trainer.agents, trainer.tokenizers, eval_rows(eval_prompts), eval_samples,
                        workload.max_new_tokens, workload.seed, centralized)

    before = eval_reward()
    clock = StepClock(result, timer)
    trainer.train_step = clock.timed(trainer.train_step, lambda rows: len(rows) * workload.num_generations)
    trainer.train()
    return family.finish(result, workload, before, eval_reward())


if __name__ == "__main__":
    family.main(run, __doc__)
