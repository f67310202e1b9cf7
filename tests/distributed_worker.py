"""One data-parallel MAGRPO run, launched by tests/test_distributed.py under ``torchrun``.

Rollouts are made independent of how prompts are sharded: every prompt is sampled on its
own, under a seed drawn from its text and the step (``PerPromptSeededMAGRPO``). A 1-process
run over the global batch and an N-process run over its shards then see the same completions,
so their gradients may differ only by float summation order.

Launched with ``ACCELERATE_USE_FSDP=true FSDP_VERSION=2`` (what ``accelerate launch`` with
infra/accelerate/fsdp.yaml sets), the agents are sharded (tests/test_fsdp.py); the worker then
also exports the agents, samples a different number of tokens on each rank, and, given a
1-process checkpoint, resumes it for a second step. With ``--trainer maac`` or ``iac`` it runs
two steps of that actor-critic trainer (critics from MODEL_DIR; ``iac_shared``: value heads on the
actors) instead, saving every module's
gathered weights, its checkpoints and an export. With ``--trainer matrix`` it runs the data-parallel
cells of the combination matrix (tests/test_matrix_ddp.py, :func:`run_matrix`).

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed_worker.py MODEL_DIR PROMPTS_JSON OUT_DIR [CHECKPOINT] [--trainer maac]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import zlib
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from comlrl.parallel import sharding  # noqa: E402
from comlrl.rollout.episodes import Rollout, Turn  # noqa: E402
from comlrl.rollout.generation import Generation, generate_completions  # noqa: E402
from comlrl.rollout.packed_weights import packable_layers  # noqa: E402
from comlrl.rollout.sampling import SamplingParams  # noqa: E402
from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer  # noqa: E402
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer  # noqa: E402


def merge_generations(parts: list[Generation], pad_token_id: int) -> Generation:
    """Stack per-prompt generations (equal prompt lengths); completions are right-padded."""
    if len({g.prompt_ids.shape[1] for g in parts}) != 1:
        raise ValueError("per-prompt generations must have equal prompt lengths to be stacked without re-padding")
    width = max(g.completion_ids.shape[1] for g in parts)

    def pad(tensor: torch.Tensor, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]), value=value)

    return Generation(
        prompt_ids=torch.cat([g.prompt_ids for g in parts]),
        prompt_mask=torch.cat([g.prompt_mask for g in parts]),
        completion_ids=torch.cat([pad(g.completion_ids, pad_token_id) for g in parts]),
        completion_mask=torch.cat([pad(g.completion_mask, 0) for g in parts]),
        texts=[text for g in parts for text in g.texts],
        num_generations=parts[0].num_generations,
    )


class PerPromptSeeded:
    """Mixin: a trainer whose (one-turn) rollout samples each prompt under its own seed."""

    def rollout(self, rows, row_labels=None):
        singles = []
        for row in rows:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(zlib.crc32(row["prompt"].encode()) + 7919 * self.state.global_step)
                singles.append(super().rollout([row]))
        turns = [single.turns[0] for single in singles]
        generations = [
            merge_generations([t.generations[a] for t in turns], self.tokenizers[a].pad_token_id)
            for a in range(self.num_agents)
        ]
        turn = Turn(
            node_rows=list(range(len(rows))),
            prompts=[[p for t in turns for p in t.prompts[a]] for a in range(self.num_agents)],
            generations=generations,
            prompt_history=[h for t in turns for h in t.prompt_history],
            response_history=[h for t in turns for h in t.response_history],
        )
        return Rollout(rows=list(rows), turns=[turn], joint_index=singles[0].joint_index)


class PerPromptSeededMAGRPO(PerPromptSeeded, MAGRPOTrainer):
    pass


class PerPromptSeededMAAC(PerPromptSeeded, MAACTrainer):
    pass


class PerPromptSeededIAC(PerPromptSeeded, IACTrainer):
    pass


def letter_reward(completions_0, completions_1):
    return [(a.count("e") + b.count("o")) / max(len(a) + len(b), 1) for a, b in zip(completions_0, completions_1)]


def build(model_dir: str, prompts: list[str], per_device_batch: int, epochs: int) -> PerPromptSeededMAGRPO:
    from datasets import Dataset

    args = MAGRPOConfig(
        num_agents=2, num_generations=4, max_new_tokens=6, temperature=1.0, agent_learning_rate=1e-3,
        max_grad_norm=None, per_device_train_batch_size=per_device_batch, num_train_epochs=epochs,
        seed=11, device="cpu", disable_tqdm=True,
    )
    return PerPromptSeededMAGRPO(
        agent_model=model_dir, num_agents=2, reward_func=letter_reward,
        train_dataset=Dataset.from_dict({"prompt": prompts}), args=args,
    )


def build_actor_critic(kind: str, model_dir: str, prompts: list[str], per_device_batch: int, epochs: int
                       ) -> PerPromptSeededMAAC | PerPromptSeededIAC:
    """MAAC, IAC with separate critics, or IAC with heads on the actors (``iac_shared``); MLP value heads,
    so the value models' backbones train from step 2 (a head's output layer starts at zero)."""
    from datasets import Dataset

    common = dict(
        num_agents=2, num_generations=2, max_new_tokens=6, temperature=1.0, agent_learning_rate=1e-3,
        critic_learning_rate=1e-3, max_grad_norm=None, per_device_train_batch_size=per_device_batch,
        num_train_epochs=epochs, seed=11, device="cpu", disable_tqdm=True,
    )
    data = Dataset.from_dict({"prompt": prompts})
    if kind == "maac_drop":  # in prompt order, the odd places (the second process's share) have no reward
        dropped = set(prompts[1::2])

        def reward(prompts, completions_0, completions_1):  # prompts first, as 1.4.3 passed them
            kept = letter_reward(completions_0, completions_1)
            return [float("nan") if prompt in dropped else value for prompt, value in zip(prompts, kept)]

        return PerPromptSeededMAAC(agent_model=model_dir, critic_model=model_dir, num_agents=2, reward_func=reward,
                                   train_dataset=data, model_config={"critic_value_head_hidden_dim": 8},
                                   args=MAACConfig(shuffle=False, invalid_reward="drop", **common))
    if kind == "maac":
        return PerPromptSeededMAAC(agent_model=model_dir, critic_model=model_dir, num_agents=2, reward_func=letter_reward,
                                   train_dataset=data, args=MAACConfig(**common),
                                   model_config={"critic_value_head_hidden_dim": 8})
    if kind == "iac_shared":
        return PerPromptSeededIAC(agent_model=model_dir, num_agents=2, reward_func=letter_reward, train_dataset=data,
                                  args=IACConfig(use_separate_critic=False, value_head_hidden_dim=8, **common))
    return PerPromptSeededIAC(agent_model=model_dir, critic_model=model_dir, num_agents=2, reward_func=letter_reward,
                              train_dataset=data, args=IACConfig(critic_value_head_hidden_dim=8, **common))


def module_weights(trainer: PerPromptSeeded) -> dict[str, dict[str, torch.Tensor]]:
    """Every checkpointed module's full weights (actors, critics, value heads) on rank 0; every rank calls this."""
    return {name: sharding.gather_model_state(module) if sharding.is_sharded(module) else module.state_dict()
            for name, module in trainer.checkpoint_modules().items()}


def full_weights(trainer: PerPromptSeededMAGRPO) -> list[dict[str, torch.Tensor]]:
    """Every agent's weights as plain tensors on rank 0 (sharded agents are gathered: every rank calls this)."""
    if trainer.data_parallel.fsdp is None:
        return [agent.state_dict() for agent in trainer.agents]
    return [sharding.gather_model_state(agent) for agent in trainer.agents]


def uneven_lengths(rank: int) -> int:
    """Tokens rank ``rank`` samples in the generation check: ranks decode different numbers of steps."""
    return 2 + 4 * rank


def sample_unevenly(trainer: PerPromptSeededMAGRPO, prompt: str, out: Path) -> None:
    """Each rank samples its own number of tokens from sharded agent 0 with both backends (none may hang)."""
    rank = trainer.data_parallel.rank
    for backend in ("comlrl", "transformers"):
        sampling = SamplingParams(max_new_tokens=uneven_lengths(rank), backend=backend)
        generation = generate_completions(trainer.agents[0], trainer.tokenizers[0], [prompt], 2, sampling,
                                          generator=torch.Generator().manual_seed(5))
        torch.save(generation.completion_ids, out / f"sampled_{backend}_{rank}.pt")


def run_actor_critic(kind: str, model_dir: str, prompts: list[str], out: Path) -> None:
    """Two sharded steps (checkpoint after each), then every module's gathered weights and an export."""
    trainer = build_actor_critic(kind, model_dir, prompts, per_device_batch=len(prompts) // 2, epochs=2)
    assert trainer.data_parallel.fsdp is not None and trainer.data_parallel.world_size == 2
    assert all(sharding.is_sharded(model) and sharding.is_sharded(model.value_head) for model in trainer.value_models)
    history = trainer.train(checkpoint_dir=out / "checkpoints")
    weights = module_weights(trainer)
    trainer.save_model(out / "export")
    if trainer.data_parallel.is_main:
        torch.save(weights, out / "weights.pt")
        (out / "history.json").write_text(json.dumps(history))


# ----- the combination matrix's data-parallel cells (tests/test_matrix_ddp.py) ---------------------------
# 4 prompts in global batches of 2 make 2 rollout batches an epoch, not a multiple of the accumulation
# window of 3, so every epoch ends with a flushed partial window. The worker's 2 processes take 1 prompt
# each, the 1-process reference (tests/test_matrix_ddp.py) 2.
MATRIX_ACCUMULATION = 3
MATRIX_GLOBAL_BATCH = 2


class StopsAfterStep:
    """Mixin: after step ``stop_after`` every rank receives a real SIGTERM (as a preempted launch's
    processes all do), so the run stops there and checkpoints, possibly with gradients pending."""

    stop_after: int | None = None

    def record_step(self, metrics, window, progress=None):
        if self.stop_after is not None and self.state.global_step + 1 == self.stop_after:
            os.kill(os.getpid(), signal.SIGTERM)
        super().record_step(metrics, window, progress)


class MatrixMAGRPO(StopsAfterStep, PerPromptSeededMAGRPO):
    pass


class MatrixIAC(StopsAfterStep, PerPromptSeededIAC):
    pass


def build_matrix_magrpo_dapo(model_dir: str, prompts: list[str], per_device_batch: int) -> MatrixMAGRPO:
    """MAGRPO with loss_type='dapo' (normalised by the batch's completion tokens, which differ per rank),
    one pass, accumulation 3, cosine schedule, 2 epochs."""
    from datasets import Dataset

    args = MAGRPOConfig(
        num_agents=2, num_generations=4, max_new_tokens=6, temperature=1.0, agent_learning_rate=1e-3,
        max_grad_norm=1.0, per_device_train_batch_size=per_device_batch, num_train_epochs=2, loss_type="dapo",
        gradient_accumulation_steps=MATRIX_ACCUMULATION, lr_scheduler_type="cosine", seed=11, device="cpu",
        disable_tqdm=True,
    )
    return MatrixMAGRPO(agent_model=model_dir, num_agents=2, reward_func=letter_reward,
                        train_dataset=Dataset.from_dict({"prompt": prompts}), args=args)


def build_matrix_madpo(model_dir: str, prompts: list[str], per_device_batch: int):
    """MADPO (the DPO loss is a mean over pairs, whose number differs per rank), accumulation 3, linear, 2 epochs."""
    from datasets import Dataset

    from comlrl.trainers.preference import MADPOConfig, MADPOTrainer

    class MatrixMADPO(StopsAfterStep, PerPromptSeeded, MADPOTrainer):
        pass

    args = MADPOConfig(
        num_agents=2, num_generations=4, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=None,
        agent_learning_rate=1e-3, max_grad_norm=1.0, per_device_train_batch_size=per_device_batch,
        num_train_epochs=2, max_pairs_per_prompt=None, gradient_accumulation_steps=MATRIX_ACCUMULATION,
        lr_scheduler_type="linear", seed=11, device="cpu", disable_tqdm=True,
    )
    return MatrixMADPO(agent_model=model_dir, num_agents=2, reward_func=letter_reward,
                       train_dataset=Dataset.from_dict({"prompt": prompts}), args=args)


def build_matrix_magrpo(model_dir: str, prompts: list[str], per_device_batch: int) -> MatrixMAGRPO:
    """MAGRPO, 2 policy passes per batch, accumulation 3, linear schedule, 2 epochs."""
    from datasets import Dataset

    args = MAGRPOConfig(
        num_agents=2, num_generations=4, max_new_tokens=6, temperature=1.0, agent_learning_rate=1e-3,
        max_grad_norm=1.0, per_device_train_batch_size=per_device_batch, num_train_epochs=2, policy_update_epochs=2,
        gradient_accumulation_steps=MATRIX_ACCUMULATION, lr_scheduler_type="linear", seed=11, device="cpu",
        disable_tqdm=True,
    )
    return MatrixMAGRPO(agent_model=model_dir, num_agents=2, reward_func=letter_reward,
                        train_dataset=Dataset.from_dict({"prompt": prompts}), args=args)


def build_matrix_iac(model_dir: str, prompts: list[str], per_device_batch: int) -> MatrixIAC:
    """IAC with separate critics (2 critic passes per batch), accumulation 3, cosine schedule, 2 epochs, and
    advantages standardised over the global batch (every rank's samples)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    args = IACConfig(
        num_agents=2, num_generations=2, max_new_tokens=6, temperature=1.0, agent_learning_rate=1e-3,
        critic_learning_rate=2e-3, max_grad_norm=1.0, per_device_train_batch_size=per_device_batch,
        num_train_epochs=2, use_separate_critic=True, critic_update_epochs=2, critic_value_head_hidden_dim=8,
        normalize_advantages=True,
        gradient_accumulation_steps=MATRIX_ACCUMULATION, lr_scheduler_type="cosine", seed=11, device="cpu",
        disable_tqdm=True,
    )
    return MatrixIAC(agent_model=model_dir, tokenizer=AutoTokenizer.from_pretrained(model_dir),
                     critics=[model_dir, model_dir], num_agents=2, reward_func=letter_reward,
                     train_dataset=Dataset.from_dict({"prompt": prompts}), args=args)


def build_matrix_marlhf(model_dir: str, prompts: list[str], per_device_batch: int):
    from datasets import Dataset

    from comlrl.trainers.preference import MARLHFConfig, MARLHFTrainer

    args = MARLHFConfig(
        num_agents=2, num_generations=2, max_new_tokens=6, temperature=1.0, agent_learning_rate=1e-3,
        per_device_train_batch_size=per_device_batch, num_train_epochs=1,
        gradient_accumulation_steps=MATRIX_ACCUMULATION,
        reward_model_device=None, preference_num_generations=4, reward_train_epochs=1, reward_batch_size=4,
        reward_learning_rate=1e-3, seed=3, device="cpu", disable_tqdm=True,
    )
    return MARLHFTrainer(agent_model=model_dir, num_agents=2, reward_func=letter_reward,
                         train_dataset=Dataset.from_dict({"prompt": prompts}), args=args)


# What every rank's fitted reward model scores (a fixed joint response).
FIXED_JOINT = ("write a story about the sun", ["the sun rose over the hill", "a boat on the river"])


def record_learning_rates(components: dict) -> dict[str, list[float]]:
    """Per optimizer-step component, the learning rate each real optimizer step runs at (a step pre-hook)."""
    seen: dict[str, list[float]] = {}
    for name, component in components.items():
        log = seen.setdefault(name, [])
        component.optimizer.register_step_pre_hook(
            lambda optimizer, args, kwargs, log=log: log.append(float(optimizer.param_groups[0]["lr"])))
    return seen


def leftovers(trainer) -> dict[str, dict]:
    """Per component, the micro-batches still pending and the parameters still holding a gradient."""
    result = {name: {"pending": component.pending,
                     "grads": [n for n, p in component.module.named_parameters() if p.grad is not None]}
              for name, component in trainer.model_optimizers.items()}
    result["all_modules"] = {"pending": 0, "grads": [
        f"{name}.{n}" for name, module in trainer.checkpoint_modules().items()
        for n, p in module.named_parameters() if p.grad is not None]}
    return result


def plain_weights(trainer) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
            for name, module in trainer.checkpoint_modules().items()}


def run_matrix_cell(builder, model_dir: str, prompts: list[str], out: Path, stop_after: int | None = None) -> None:
    """Train a cell on 2 processes; every rank writes its learning rates, leftovers and final weights."""
    from comlrl.errors import TrainingInterrupted

    out.mkdir(parents=True, exist_ok=True)
    trainer = builder(model_dir, prompts, per_device_batch=MATRIX_GLOBAL_BATCH // 2)
    assert trainer.data_parallel.world_size == 2 and trainer.data_parallel.fsdp is None, trainer.data_parallel
    rank = trainer.data_parallel.rank
    rates = record_learning_rates(trainer.model_optimizers)
    trainer.stop_after = stop_after
    try:
        history = trainer.train(checkpoint_dir=out / "checkpoints")
    except TrainingInterrupted as stopped:
        history = trainer.state.history
        (out / f"stopped_{rank}.json").write_text(json.dumps({
            "checkpoint": stopped.checkpoint, "global_step": trainer.state.global_step,
            "pending": {name: c.pending for name, c in trainer.model_optimizers.items()}}))
    (out / f"lrs_{rank}.json").write_text(json.dumps(rates))
    (out / f"leftovers_{rank}.json").write_text(json.dumps(leftovers(trainer)))
    (out / f"history_{rank}.json").write_text(json.dumps(history))
    torch.save(plain_weights(trainer), out / f"weights_{rank}.pt")


class EachRankAlone:
    """The preference stage's view of data parallelism before the fix: every rank collects every prompt
    with its own sampling stream, keeps its own pairs and its own fitted reward model."""

    enabled = False  # nothing gathered

    def __init__(self, data_parallel) -> None:
        self._data_parallel = data_parallel

    def __getattr__(self, name):
        return getattr(self._data_parallel, name)

    def shard(self, batch):
        return list(batch)

    def broadcast_parameters(self, models) -> None:
        return None


def save_preference_state(trainer, out: Path, rank: int) -> None:
    """A rank's preference pairs, reward-model weights and its score of :data:`FIXED_JOINT`."""
    prompt, joint = FIXED_JOINT
    score = trainer.reward_model.score([prompt], [[completion] for completion in joint])
    (out / f"pairs_{rank}.json").write_text(json.dumps(trainer.preference_pairs.to_list()))
    torch.save({"reward_model": {k: v.detach().cpu().clone() for k, v in trainer.reward_model.state_dict().items()},
                "score": score.clone()}, out / f"reward_{rank}.pt")


def run_matrix_marlhf(model_dir: str, prompts: list[str], out: Path) -> None:
    """A whole MARLHF run on 2 processes, then (``local``) the preference stages as they ran before the
    stage gathered pairs and broadcast the fit (:class:`EachRankAlone`)."""
    (out / "marlhf").mkdir(parents=True, exist_ok=True)
    (out / "marlhf_local").mkdir(parents=True, exist_ok=True)
    trainer = build_matrix_marlhf(model_dir, prompts, per_device_batch=MATRIX_GLOBAL_BATCH // 2)
    rank = trainer.data_parallel.rank
    assert trainer.data_parallel.world_size == 2
    trainer.train()
    save_preference_state(trainer, out / "marlhf", rank)
    torch.save(plain_weights(trainer), out / "marlhf" / f"weights_{rank}.pt")
    shard = trainer.data_parallel.shard(list(range(len(prompts))))
    (out / "marlhf" / f"rows_{rank}.json").write_text(json.dumps(shard))

    local = build_matrix_marlhf(model_dir, prompts, per_device_batch=MATRIX_GLOBAL_BATCH // 2)
    alone = EachRankAlone(local.preference.data_parallel)
    local.preference.data_parallel = alone
    local.preference.collection.data_parallel = alone  # the pairs' own component collects and gathers
    local.data_parallel.seed(local.args.seed, 0)  # each rank's own sampling stream, as train() sets it
    local.run_next_stage()  # collect_preferences
    local.run_next_stage()  # fit_reward_model
    save_preference_state(local, out / "marlhf_local", rank)


def run_matrix(model_dir: str, prompts: list[str], out: Path) -> None:
    """Every data-parallel matrix cell: MAGRPO (straight, and stopped mid-window after step 1), IAC, MARLHF."""
    run_matrix_cell(build_matrix_magrpo, model_dir, prompts, out / "magrpo")
    run_matrix_cell(build_matrix_magrpo, model_dir, prompts, out / "magrpo_stop", stop_after=1)
    run_matrix_cell(build_matrix_iac, model_dir, prompts, out / "iac")
    run_matrix_cell(build_matrix_magrpo_dapo, model_dir, prompts, out / "magrpo_dapo")
    run_matrix_cell(build_matrix_madpo, model_dir, prompts, out / "madpo")
    run_matrix_marlhf(model_dir, prompts, out)


# ----- the data-parallel maths cells (tests/test_matrix_ddp.py): what 2 processes apply, for a 1-process hand check --
# One rollout batch of 4 prompts (2 per rank); each rank saves its completions, rewards and pairs and, at every
# optimizer step, each agent's weights and the gradient about to be applied (after averaging; no clipping), which
# the test compares with the gradient of the loss over all 4 prompts, computed in one process by hand.
class EndsEarlyPerPrompt:
    """Mixin: sample g of a prompt ends after ``1 + (crc32(prompt) + g + agent) % max_new_tokens`` tokens, as if EOS
    had been sampled there (texts re-decoded): the ranks hold different numbers of completion tokens (and of
    pairs), whatever the sharding, and a random tiny model rarely samples EOS itself."""

    def rollout(self, rows, row_labels=None):
        rollout = super().rollout(rows, row_labels)
        turn = rollout.turns[0]
        for agent, generation in enumerate(turn.generations):
            width = generation.completion_ids.shape[1]
            lengths = torch.tensor([1 + (zlib.crc32(row["prompt"].encode()) + sample + agent) % self.args.max_new_tokens
                                    for row in rows for sample in range(generation.num_generations)])
            mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
            ids = torch.where(mask, generation.completion_ids, self.tokenizers[agent].pad_token_id)
            turn.generations[agent] = Generation(
                prompt_ids=generation.prompt_ids, prompt_mask=generation.prompt_mask, completion_ids=ids,
                completion_mask=mask.to(generation.completion_mask.dtype),
                texts=self.tokenizers[agent].batch_decode(ids, skip_special_tokens=True),
                num_generations=generation.num_generations)
        return rollout


class RecordsStageInputs:
    """Mixin: keeps the rewards (score stage), the pairs (MADPO's select_pairs stage) and the rollout the update
    stage trains on."""

    def score(self, rollout, reward=None):
        rewards = super().score(rollout, reward)
        self.__dict__.setdefault("recorded", {})["rewards"] = [r.clone() for r in rewards]
        return rewards

    def select_pairs(self, rewards):
        pairs = super().select_pairs(rewards)
        self.__dict__.setdefault("recorded", {})["pairs"] = [[(p.chosen, p.rejected) for p in kept] for kept in pairs]
        return pairs

    def update(self, rollout, *inputs):
        self.__dict__.setdefault("recorded", {})["rollout"] = rollout
        return super().update(rollout, *inputs)


def record_optimizer_steps(trainer) -> list[list[dict]]:
    """Per agent, at every optimizer step: its trained weights and the gradient the optimizer is about to apply."""
    steps: list[list[dict]] = [[] for _ in trainer.agents]
    for index, agent in enumerate(trainer.agents):
        trainer.model_optimizers[f"agent_{index}"].optimizer.register_step_pre_hook(
            lambda optimizer, args, kwargs, agent=agent, log=steps[index]: log.append({
                "parameters": {n: p.detach().cpu().clone() for n, p in agent.named_parameters()},
                "applied": {n: p.grad.detach().cpu().clone() for n, p in agent.named_parameters()}}))
    return steps


MATHS_CELLS = {
    # name: (trainer kind, config fields beyond the common ones)
    "magrpo_passes2": ("magrpo", dict(policy_update_epochs=2, agent_learning_rate=1e-2)),
    "magrpo_dapo": ("magrpo", dict(loss_type="dapo", agent_learning_rate=1e-3)),
    "madpo": ("madpo", dict(dpo_reference="none", dpo_beta=0.5, max_pairs_per_prompt=None, agent_learning_rate=1e-3)),
}


def build_maths_cell(name: str, model_dir: str, prompts: list[str], per_device_batch: int):
    """A :data:`MATHS_CELLS` trainer: one epoch of one global batch of 4 prompts, no accumulation, no clipping."""
    from datasets import Dataset

    from comlrl.trainers.preference import MADPOConfig, MADPOTrainer

    kind, fields = MATHS_CELLS[name]
    common = dict(num_agents=2, num_generations=4, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=None,
                  max_grad_norm=None, per_device_train_batch_size=per_device_batch, num_train_epochs=1, seed=11,
                  device="cpu", disable_tqdm=True, **fields)
    trainer_class, config_class = (MAGRPOTrainer, MAGRPOConfig) if kind == "magrpo" else (MADPOTrainer, MADPOConfig)
    cell_class = type(f"Maths{trainer_class.__name__}", (RecordsStageInputs, EndsEarlyPerPrompt, PerPromptSeeded,
                                                         trainer_class), {})
    return cell_class(agent_model=model_dir, num_agents=2, reward_func=letter_reward,
                      train_dataset=Dataset.from_dict({"prompt": prompts}), args=config_class(**common))


def run_maths_cells(model_dir: str, prompts_file: str, out_dir: str) -> None:
    """Every :data:`MATHS_CELLS` cell on this rank's share of the 4 prompts; writes ``<cell>/rank_<rank>.pt``."""
    prompts = json.loads(Path(prompts_file).read_text())
    for name in MATHS_CELLS:
        trainer = build_maths_cell(name, model_dir, prompts, per_device_batch=len(prompts) // 2)
        assert trainer.data_parallel.world_size == 2 and trainer.data_parallel.fsdp is None, trainer.data_parallel
        steps = record_optimizer_steps(trainer)
        trainer.train()
        recorded = trainer.recorded
        generations = [{"prompt_ids": g.prompt_ids, "prompt_mask": g.prompt_mask, "completion_ids": g.completion_ids,
                        "completion_mask": g.completion_mask, "texts": list(g.texts)}
                       for g in recorded["rollout"].turns[0].generations]
        out = Path(out_dir) / name
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"rows": [row["prompt"] for row in recorded["rollout"].rows], "rewards": recorded["rewards"][0],
                    "generations": generations, "pairs": recorded.get("pairs"), "steps": steps},
                   out / f"rank_{trainer.data_parallel.rank}.pt")


def fsdp_refusals(model_dir: str, out_dir: str) -> None:
    """Under an FSDP launch, what the trainers refuse (``refusals.json`` from rank 0, each refusal's words by
    case): LoRA, ``bf16-mixed``, MADPO and a critic on another device before loading, the reference KL once the
    agents are sharded."""
    from datasets import Dataset

    from comlrl.trainers.preference import MADPOConfig, MADPOTrainer

    common = dict(num_agents=2, num_generations=2, max_new_tokens=2, device="cpu", disable_tqdm=True)
    cases = {
        "lora_rank": (MAGRPOTrainer, MAGRPOConfig(**common, lora_rank=2)),
        "bf16-mixed": (MAGRPOTrainer, MAGRPOConfig(**common, precision="bf16-mixed")),
        "madpo": (MADPOTrainer, MADPOConfig(**common)),
        "reference_kl": (MAGRPOTrainer, MAGRPOConfig(**common, reference_kl_enabled=True, top_p=1.0, top_k=None)),
        "critic_device": (MAACTrainer, MAACConfig(**common, critic_device="meta")),  # meta: not the agents' device
    }
    refusals = {}
    for case, (trainer_class, args) in cases.items():
        critic = {"critic_model": model_dir} if trainer_class is MAACTrainer else {}
        try:
            trainer_class(agent_model=model_dir, num_agents=2, reward_func=letter_reward,
                          train_dataset=Dataset.from_dict({"prompt": ["ab", "cd"]}), args=args, **critic)
        except ValueError as refusal:
            refusals[case] = str(refusal)
    if int(os.environ["RANK"]) == 0:
        (Path(out_dir) / "refusals.json").write_text(json.dumps(refusals))


def madpo_iter_drops(model_dir: str, out_dir: str) -> None:
    """MADPOIter on 2 processes with ``invalid_reward="drop"``: the reward is NaN for the second process's prompts
    (prompts 1 and 3), so only that process drops samples, in its preference collection. Each rank writes how many
    NaNs its reward gave (``nans_<rank>.json``) and its history's ``reward/dropped`` (``dropped_<rank>.json``)."""
    from datasets import Dataset

    from comlrl.trainers.preference import MADPOIterConfig, MADPOIterTrainer

    prompts = ["ab", "cd", "ef", "gh"]
    given = []

    def reward(prompts_given, completions_0, completions_1):
        values = [float("nan") if prompt in ("cd", "gh") else float(len(a) - len(b))
                  for prompt, a, b in zip(prompts_given, completions_0, completions_1)]
        given.extend(values)
        return values

    trainer = MADPOIterTrainer(
        agent_model=model_dir, reward_func=reward, train_dataset=Dataset.from_dict({"prompt": prompts}),
        args=MADPOIterConfig(num_agents=2, num_generations=2, max_new_tokens=3, num_iterations=1, dpo_batch_size=2,
                             per_device_train_batch_size=1, invalid_reward="drop", device="cpu",
                             disable_tqdm=True, seed=5))
    trainer.train()
    rank = trainer.data_parallel.rank
    out = Path(out_dir)
    (out / f"nans_{rank}.json").write_text(json.dumps(sum(value != value for value in given)))
    (out / f"dropped_{rank}.json").write_text(json.dumps([row.get("reward/dropped") for row in trainer.state.history]))


def main(model_dir: str, prompts_file: str, out_dir: str, resume: str | None = None, trainer_kind: str = "magrpo"
         ) -> None:
    prompts = json.loads(Path(prompts_file).read_text())
    out = Path(out_dir)
    if trainer_kind == "matrix":
        run_matrix(model_dir, prompts, out)
        return
    if trainer_kind != "magrpo":
        run_actor_critic(trainer_kind, model_dir, prompts, out)
        return
    trainer = build(model_dir, prompts, per_device_batch=len(prompts) // 2, epochs=1)
    assert trainer.data_parallel.world_size == 2, trainer.data_parallel
    sharded = trainer.data_parallel.fsdp is not None
    assert sharded == (os.environ.get("ACCELERATE_USE_FSDP") == "true")
    assert all(sharding.is_sharded(agent) == sharded for agent in trainer.agents)
    if sharded:  # FSDP gathers each layer's weights inside its forward: no packed decode copy of a shard
        assert all(packable_layers(agent) == [] for agent in trainer.agents)
    history = trainer.train(checkpoint_dir=out / "checkpoints")
    weights = full_weights(trainer)
    if trainer.data_parallel.is_main:
        torch.save(weights, out / "weights.pt")
        (out / "history.json").write_text(json.dumps(history))
    # Every rank reports the prompts it rolled out, to check the sharding.
    shard = trainer.epoch_batches(0)[0]
    (out / f"shard_{trainer.data_parallel.rank}.json").write_text(json.dumps(shard))
    if sharded:
        trainer.save_model(out / "export")
        sample_unevenly(trainer, prompts[0], out)
    if resume is not None:  # a 1-process checkpoint, one more step here
        resumed = build(model_dir, prompts, per_device_batch=len(prompts) // 2, epochs=2)
        resumed_history = resumed.train(resume_from_checkpoint=resume)
        weights = full_weights(resumed)
        if resumed.data_parallel.is_main:
            torch.save(weights, out / "resumed_weights.pt")
            (out / "resumed_history.json").write_text(json.dumps(resumed_history))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name in ("model_dir", "prompts_file", "out_dir"):
        parser.add_argument(name)
    parser.add_argument("resume", nargs="?")
    parser.add_argument("--trainer", default="magrpo",
                        choices=("magrpo", "maac", "maac_drop", "iac", "iac_shared", "matrix"))
    arguments = parser.parse_args()
    main(arguments.model_dir, arguments.prompts_file, arguments.out_dir, arguments.resume, arguments.trainer)
