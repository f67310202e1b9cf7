"""The CUDA paths on the tiny models: placement, the precisions (``auto`` -> bf16, ``bf16-mixed``, ``fp16``),
checkpoint/resume and LoRA, each trainer family for two rollout steps.

Every test is skipped without a CUDA GPU (CI has none); run them on a GPU machine with
``pytest tests/test_cuda.py``. Sizes are the smallest that exercise each path (2 agents, 2 samples per prompt,
4 new tokens, 4 prompts in batches of 2), so the file takes seconds on a GPU.

Resume: docs/checkpoints.md promises an uninterrupted run's weights "bit for bit" on CPU and says nothing about CUDA, and
the library does not call ``torch.use_deterministic_algorithms``. So the resume test first checks that two
uninterrupted CUDA runs agree bit for bit (the GPU kernels of these tiny models are deterministic), then that a
resumed run equals them: if the first holds and the second fails, the resume itself loses state on CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer

from comlrl.checkpointing import list_checkpoints
from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl.trainers.preference import MADPOConfig, MADPOTrainer
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICE = "cuda"
AUTO = "auto"  # precision="auto": bf16 on a CUDA GPU that supports it, else fp32 (comlrl/parallel/device.py)


def auto_dtype() -> torch.dtype:
    return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32


PROMPTS = ["write about the cat", "write about the sun", "write about the tree", "write about the road"]
COMMON = dict(num_agents=2, num_generations=2, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=None,
              agent_learning_rate=3e-3, per_device_train_batch_size=2, num_train_epochs=1, seed=3, disable_tqdm=True)
FAMILIES = ("magrpo", "iac", "maac", "madpo")


def letters_reward(completions_0, completions_1):
    return [0.5 * a.count("e") / max(len(a), 1) + 0.5 * b.count("o") / max(len(b), 1)
            for a, b in zip(completions_0, completions_1)]


def build(kind: str, model: str, device: str = DEVICE, precision: str = AUTO, **options):
    settings = dict(COMMON, device=device, precision=precision, **options)
    data = dict(reward_func=letters_reward, train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    if kind == "magrpo":
        return MAGRPOTrainer(agent_model=model, args=MAGRPOConfig(**settings), **data)
    if kind == "madpo":
        return MADPOTrainer(agent_model=model, args=MADPOConfig(**settings), **data)
    tokenizer = AutoTokenizer.from_pretrained(model)
    if kind == "iac":
        return IACTrainer(agent_model=model, tokenizer=tokenizer, critic_model=model,
                          args=IACConfig(use_separate_critic=True, critic_learning_rate=3e-3, **settings), **data)
    assert kind == "maac"
    return MAACTrainer(agent_model=model, tokenizer=tokenizer, critic_model=model,
                       args=MAACConfig(critic_learning_rate=3e-3, **settings), **data)


def snapshot(modules: dict[str, torch.nn.Module]) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {k: p.detach().clone() for k, p in module.named_parameters()} for name, module in modules.items()}


def changed(before: dict[str, torch.Tensor], module: torch.nn.Module) -> list[str]:
    return [k for k, p in module.named_parameters() if not torch.equal(p.detach(), before[k])]


def assert_on(module: torch.nn.Module, device_type: str, name: str) -> None:
    devices = {p.device.type for p in module.parameters()} | {b.device.type for b in module.buffers()}
    assert devices == {device_type}, (name, devices)


def assert_finite_history(history: list[dict], steps: int) -> None:
    assert [row["step"] for row in history] == list(range(1, steps + 1)), [row.get("step") for row in history]
    for row in history:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (row["step"], bad)
        assert row.get("nonfinite_updates", 0) == 0, row
        assert any(k.endswith("loss") for k in row), sorted(row)


def assert_weights_finite(module: torch.nn.Module, name: str) -> None:
    bad = [k for k, p in module.named_parameters() if not torch.isfinite(p).all()]
    assert not bad, (name, bad)


@pytest.mark.parametrize("kind", FAMILIES)
def test_each_family_trains_on_cuda_in_auto_precision(kind, tiny_llama):
    """precision='auto' on a bf16 GPU: every model on CUDA, the agents in bf16; two steps train every model."""
    trainer = build(kind, tiny_llama)
    modules = trainer.checkpoint_modules()
    assert set(modules) >= {"agent_0", "agent_1"}
    if kind in ("iac", "maac"):
        assert any(name.startswith("critic") for name in modules), sorted(modules)
    for name, module in modules.items():
        assert_on(module, "cuda", name)
    for i, agent in enumerate(trainer.agents):
        assert {p.dtype for p in agent.parameters()} == {auto_dtype()}, i
    dtypes = {name: sorted({str(p.dtype) for p in module.parameters()}) for name, module in modules.items()}
    print(f"{kind}: parameter dtypes {dtypes}")
    before = snapshot(modules)

    history = trainer.train()

    assert_finite_history(history, 2)
    assert trainer.state.global_step == 2
    for name, module in modules.items():
        assert_on(module, "cuda", name)
        assert_weights_finite(module, name)
        assert changed(before[name], module), f"{kind}: {name} did not change"
    for component in trainer.model_optimizers.values():  # AdamW's state sits with its weights
        states = [t for s in component.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        assert states and {t.device.type for t in states} == {"cuda"}


class ForwardLog:
    """Per forward of a model or of a sampling copy of it (deepcopy shares the hook function): the dtype of
    its weights, whether CUDA autocast was on, whether gradients were recorded."""

    def __init__(self, model: torch.nn.Module, device_type: str) -> None:
        self.calls: list[tuple[torch.dtype, bool, bool]] = []
        calls = self.calls

        def hook(module, args, kwargs):
            weight = module.get_input_embeddings().weight
            calls.append((weight.dtype, torch.is_autocast_enabled(device_type), torch.is_grad_enabled()))

        model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("precision,weights", [("bf16-mixed", torch.float32), ("fp16", torch.float16),
                                               ("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_magrpo_precisions_on_cuda(precision, weights, tiny_llama):
    """Weights, gradients and AdamW state in the documented dtype; bf16-mixed samples from bf16 copies on the GPU
    and runs its fp32-weight forwards under CUDA autocast; two steps stay finite and train."""
    trainer = build("magrpo", tiny_llama, precision=precision)
    device_type = torch.device(DEVICE).type
    for i, agent in enumerate(trainer.agents):
        assert_on(agent, device_type, f"agent_{i}")
        assert {p.dtype for p in agent.parameters()} == {weights}, (precision, i)
    copies = trainer.sampling_agents()
    if precision == "bf16-mixed":
        for copy, agent in zip(copies, trainer.agents):
            assert copy is not agent
            assert {p.dtype for p in copy.parameters()} == {torch.bfloat16}
            assert_on(copy, device_type, "sampling copy")
    else:
        assert all(copy is agent for copy, agent in zip(copies, trainer.agents))
    del copies
    logs = [ForwardLog(agent, device_type) for agent in trainer.agents]
    grads: list[torch.dtype] = []
    for agent in trainer.agents:
        for parameter in agent.parameters():
            parameter.register_hook(lambda grad: grads.append(grad.dtype))
    before = snapshot(dict(enumerate(trainer.agents)))

    history = trainer.train()

    assert_finite_history(history, 2)
    assert grads and set(grads) == {weights}
    for i, agent in enumerate(trainer.agents):
        assert {p.dtype for p in agent.parameters()} == {weights}
        assert_weights_finite(agent, f"agent_{i}")
        assert changed(before[i], agent), f"{precision}: agent_{i} did not change"
    for component in trainer.model_optimizers.values():
        states = [t for s in component.optimizer.state.values() for k, t in s.items() if k != "step"]
        assert states and {t.dtype for t in states} == {weights}, {t.dtype for t in states}
        assert {t.device.type for t in states} == {device_type}
    for log in logs:
        assert log.calls
        if precision == "bf16-mixed":
            sampling = [c for c in log.calls if c[0] == torch.bfloat16]
            forwards = [c for c in log.calls if c[0] == torch.float32]
            assert sampling and all(not autocast and not grad for _, autocast, grad in sampling)
            assert forwards and all(autocast for _, autocast, _ in forwards)
            assert any(grad for _, _, grad in forwards)
        else:
            assert all(dtype == weights and not autocast for dtype, autocast, _ in log.calls)


def weights_of(trainer) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {k: v.detach().clone() for k, v in module.state_dict().items()}
            for name, module in trainer.checkpoint_modules().items()}


def differing(a: dict, b: dict) -> list[str]:
    return [f"{m}.{k}" for m in a for k in a[m] if not torch.equal(a[m][k], b[m][k])]


@pytest.mark.parametrize("kind", ["magrpo", "maac"])
def test_resume_on_cuda_equals_an_uninterrupted_run(kind, tiny_llama, tmp_path):
    """4 steps (2 epochs of 2) straight, twice; then 1 epoch with a checkpoint and a new trainer resumed from it."""
    straight = build(kind, tiny_llama, num_train_epochs=2)
    history_a = straight.train()
    final_a = weights_of(straight)
    del straight
    again = build(kind, tiny_llama, num_train_epochs=2)
    history_again = again.train()
    final_again = weights_of(again)
    del again
    # CUDA determinism of two identical runs, which the resume comparison relies on.
    assert not differing(final_a, final_again), f"two uninterrupted CUDA runs differ: {differing(final_a, final_again)[:5]}"
    assert [r["reward_mean"] for r in history_a] == [r["reward_mean"] for r in history_again]

    first_half = build(kind, tiny_llama, num_train_epochs=1)
    first_half.train(checkpoint_dir=tmp_path / "ckpt", checkpoint_interval=1)
    assert [p.name for p in list_checkpoints(tmp_path / "ckpt")] == ["checkpoint-1"]
    state = torch.load(tmp_path / "ckpt" / "checkpoint-1" / "state.pt", weights_only=True, map_location="cpu")
    del first_half

    resumed = build(kind, tiny_llama, num_train_epochs=2)
    history_b = resumed.train(resume_from_checkpoint=tmp_path / "ckpt" / "checkpoint-1",
                              checkpoint_dir=tmp_path / "ckpt", checkpoint_interval=1)
    for name, module in resumed.checkpoint_modules().items():
        assert_on(module, "cuda", name)
    assert resumed.state.global_step == 4
    # the resumed run's history holds the restored steps 1-2 and its own 3-4
    assert [r["step"] for r in history_b] == [1, 2, 3, 4]
    assert [r["reward_mean"] for r in history_a] == [r["reward_mean"] for r in history_b]
    diff = differing(final_a, weights_of(resumed))
    assert not diff, f"resumed CUDA run differs from the uninterrupted one in {len(diff)} tensors: {diff[:5]}"
    if torch.device(DEVICE).type == "cuda":  # the CUDA generator's state travels in the checkpoint
        assert len(state["rng"]["cuda"]) == torch.cuda.device_count(), sorted(state["rng"])


def test_lora_on_cuda_trains_only_the_adapters(tiny_llama):
    trainer = build("magrpo", tiny_llama, lora_rank=4)
    before = snapshot(dict(enumerate(trainer.agents)))
    adapter_dtypes = set()
    for i, agent in enumerate(trainer.agents):
        assert_on(agent, "cuda", f"agent_{i}")
        trainable = {k for k, p in agent.named_parameters() if p.requires_grad}
        assert trainable and all("lora_" in k for k in trainable), sorted(trainable)[:5]
        adapter_dtypes |= {p.dtype for k, p in agent.named_parameters() if "lora_" in k}
        assert {p.dtype for k, p in agent.named_parameters() if "lora_" not in k} == {auto_dtype()}
    print(f"lora: adapter dtypes {adapter_dtypes}, base {auto_dtype()}")

    history = trainer.train()

    assert_finite_history(history, 2)
    for i, agent in enumerate(trainer.agents):
        assert_weights_finite(agent, f"agent_{i}")
        moved = changed(before[i], agent)
        assert moved, f"agent_{i}: nothing changed"
        assert all("lora_" in k for k in moved), [k for k in moved if "lora_" not in k][:5]
        assert any("lora_B" in k for k in moved) and any("lora_A" in k for k in moved), moved[:5]
