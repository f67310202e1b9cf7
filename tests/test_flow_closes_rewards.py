"""A run's end closes what its rewards hold (flows/training.py ``close_rewards``): the coding task's warm sandbox
workers and their job folder end with the run, not at interpreter exit. A real trainer, a real coding task."""

from __future__ import annotations

import os

from datasets import Dataset

from comlrl.tasks import coding
from comlrl.tasks.coding import make_reward
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from flows.training import close_rewards

DOUBLE = {
    "task_id": "Custom/double",
    "prompt": "def double(x: int) -> int:\n    \"\"\"Twice x.\"\"\"\n",
    "entry_point": "double",
    "test": "def check(candidate):\n    assert candidate(1) == 2\n",
}


def test_the_end_of_a_run_closes_the_coding_tasks_sandbox(tiny_llama):
    task = make_reward(workers=1, warm=True)
    trainer = MAGRPOTrainer(agent_model=tiny_llama, num_agents=2, reward_func=task, formatters=coding.FORMATTERS,
                            train_dataset=Dataset.from_list([DOUBLE]),
                            args=MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=4))
    assert task([""], ["def double(x):\n    return 2 * x\n"], batch_items=[DOUBLE]) == [task([""], [
        "def double(x):\n    return 2 * x\n"], batch_items=[DOUBLE])[0]]
    sandbox = task.executor._sandbox
    worker = sandbox._warm_slots.queue[0]
    job_dir = worker.job_dir
    assert job_dir is not None and os.path.isfile(os.path.join(job_dir, "worker.py"))  # a warm worker is up
    close_rewards(trainer)
    assert not os.path.exists(job_dir) and worker.process is None
    assert task.executor._sandbox is None
    close_rewards(trainer)  # a second end closes nothing twice


def test_a_trainer_without_a_joint_reward_yet_closes_nothing(tiny_llama):
    """MARLHF builds its training reward only when a policy stage starts: a run ending before holds none."""
    from comlrl.trainers.preference import MARLHFConfig, MARLHFTrainer

    task = make_reward(workers=1, warm=True)
    trainer = MARLHFTrainer(agent_model=tiny_llama, num_agents=2, reward_func=task, formatters=coding.FORMATTERS,
                            train_dataset=Dataset.from_list([DOUBLE]),
                            args=MARLHFConfig(num_agents=2, num_generations=2, max_new_tokens=4,
                                              reward_model_device=None))
    close_rewards(trainer)
    assert task.executor._sandbox is None or task.executor._sandbox._warm_slots is None or all(
        slot.process is None for slot in task.executor._sandbox._warm_slots.queue)
