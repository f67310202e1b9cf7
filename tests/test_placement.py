"""Placement of agents and critics, per-device memory metrics, and the memory options
(precision, gradient checkpointing, LoRA)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.parallel.memory import is_checkpointing
from comlrl.parallel.placement import map_by_device, private_tokenizers, resolve_placement, runs_concurrently, spread_by_size
from comlrl.training.policy_update import backpropagate, policy_losses
from comlrl.trainers.actor_critic import IACConfig, IACTrainer
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

CPU = torch.device("cpu")


def build(model_dir, dataset, reward_func, **config):
    settings = dict(num_agents=2, num_generations=2, max_new_tokens=4, per_device_train_batch_size=2,
                    num_train_epochs=1, seed=3, disable_tqdm=True)
    settings.update(config)
    return MAGRPOTrainer(agent_model=model_dir, num_agents=2, reward_func=reward_func,
                         train_dataset=dataset, args=MAGRPOConfig(**settings))


# ----- placement ----------------------------------------------------------------------------------
def test_spread_by_size_balances_largest_first():
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    # 7B and 3B and 3B: the 7B alone on one GPU, both 3B on the other.
    assert spread_by_size([3, 7, 3], gpus) == [gpus[1], gpus[0], gpus[1]]
    assert spread_by_size([1, 1, 1, 1], gpus) == [gpus[0], gpus[1], gpus[0], gpus[1]]


def test_auto_without_gpus_is_cpu_and_lists_are_taken_as_given():
    assert resolve_placement("auto", ["a", "b"], "X.device", gpus=[]) == [CPU, CPU]
    assert resolve_placement(["cpu", "cpu"], ["a", "b"], "X.device", gpus=[]) == [CPU, CPU]
    one_gpu = [torch.device("cuda", 0)]
    assert resolve_placement(None, ["a", "b"], "X.device", gpus=one_gpu) == one_gpu * 2


def test_missing_cuda_device_fails_naming_the_entry_before_loading(tiny_llama, train_dataset, reward_func, monkeypatch):
    if torch.cuda.device_count() > 3:
        pytest.skip("this machine has a cuda:3")
    loads = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(a))
    with pytest.raises(ValueError, match=r"MAGRPOConfig\.device\[1\]='cuda:3' cannot be used: .*CUDA device"):
        build(tiny_llama, train_dataset, reward_func, device=["cpu", "cuda:3"])
    with pytest.raises(ValueError, match=r"agent_devices length \(3\) must be 1 or 2: MAGRPOConfig\.device lists"):
        MAGRPOConfig(num_agents=2, device=["cpu", "cpu", "cpu"])
    assert loads == []


def test_agents_and_critics_land_where_the_spec_says(tiny_llama, train_dataset, reward_func):
    trainer = build(tiny_llama, train_dataset, reward_func, device=["cpu", "cpu"])
    assert [next(a.parameters()).device for a in trainer.agents] == [CPU, CPU]
    assert trainer.agent_devices == [CPU, CPU]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    iac = IACTrainer(
        agents=[tiny_llama, tiny_llama], tokenizer=tokenizer, critic_model=tiny_llama, reward_func=reward_func,
        train_dataset=train_dataset,
        args=IACConfig(num_agents=2, max_new_tokens=4, per_device_train_batch_size=2, device="cpu",
                       critic_device=["cpu", "cpu"], disable_tqdm=True),
    )
    assert iac.critic_devices == [CPU, CPU]
    assert all(next(c.parameters()).device == CPU for c in iac.critics)
    with pytest.raises(ValueError, match=r"IACConfig\.critic_device\[0\]='cuda:7'"):
        IACTrainer(
            agents=[tiny_llama, tiny_llama], tokenizer=tokenizer, critic_model=tiny_llama, reward_func=reward_func,
            train_dataset=train_dataset,
            args=IACConfig(num_agents=2, device="cpu", critic_device=["cuda:7", "cpu"], disable_tqdm=True),
        )


def test_map_by_device_is_sequential_on_cpu_and_threads_across_gpus():
    order = []
    assert map_by_device(lambda i: order.append(i) or i * 10, [CPU, CPU, CPU]) == [0, 10, 20]
    assert order == [0, 1, 2]
    assert not runs_concurrently([CPU, CPU])
    assert not runs_concurrently([torch.device("cuda", 0)] * 2)
    assert runs_concurrently([torch.device("cuda", 0), torch.device("cuda", 1)])


def test_shared_tokenizer_objects_are_copied_for_threads(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    copies = private_tokenizers([tokenizer, tokenizer])
    assert copies[0] is tokenizer and copies[1] is not tokenizer
    assert copies[1]("the cat")["input_ids"] == tokenizer("the cat")["input_ids"]


def test_step_metrics_report_memory_per_device(tiny_llama, train_dataset, reward_func):
    history = build(tiny_llama, train_dataset, reward_func, device="cpu").train()
    assert all(step["memory/cpu/max_rss_gb"] > 0.05 for step in history)


# ----- memory options -----------------------------------------------------------------------------
def test_precision_field_sets_the_dtype(tiny_llama, train_dataset, reward_func):
    trainer = build(tiny_llama, train_dataset, reward_func, device="cpu", precision="bf16")
    assert trainer.dtype == torch.bfloat16
    assert {p.dtype for a in trainer.agents for p in a.parameters()} == {torch.bfloat16}
    assert build(tiny_llama, train_dataset, reward_func, device="cpu").dtype == torch.float32
    with pytest.raises(ValueError, match=r"MAGRPOConfig\.precision must be one of"):
        MAGRPOConfig(precision="fp8")


def _gradients(trainer):
    rows = [trainer.train_dataset[i] for i in range(2)]
    torch.manual_seed(0)
    rollout = trainer.rollout(rows)
    advantages = trainer.advantages(trainer.score(rollout))
    agent = trainer.agents[0]
    agent.train()
    loss = backpropagate(policy_losses(agent, [rollout.turns[0].generations[0]], advantages[0], 0.2, 0.7))
    grads = {name: p.grad.clone() for name, p in agent.named_parameters() if p.grad is not None}
    agent.zero_grad(set_to_none=True)
    return loss, grads


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny_llama, train_dataset, reward_func):
    plain = build(tiny_llama, train_dataset, reward_func, device="cpu")
    checkpointed = build(tiny_llama, train_dataset, reward_func, device="cpu", gradient_checkpointing=True)
    assert is_checkpointing(checkpointed.agents[0]) and not is_checkpointing(plain.agents[0])
    loss_a, grads_a = _gradients(plain)
    loss_b, grads_b = _gradients(checkpointed)
    assert loss_a == pytest.approx(loss_b, abs=1e-6)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-6, msg=name)


def test_lora_trains_only_adapters_and_saves_merged_or_adapter(tiny_llama, train_dataset, reward_func, tmp_path):
    pytest.importorskip("peft")
    trainer = build(tiny_llama, train_dataset, reward_func, device="cpu", lora_rank=4, agent_learning_rate=1e-2,
                    lora_target_modules=["q_proj", "v_proj"])
    agent = trainer.agents[0]
    before = {name: p.detach().clone() for name, p in agent.named_parameters()}
    trainer.train()
    changed = {name for name, p in agent.named_parameters() if not torch.equal(before[name], p)}
    trainable = {name for name, p in agent.named_parameters() if p.requires_grad}
    assert changed and changed <= trainable and all("lora_" in name for name in trainable)

    trainer.save_model(tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged" / "agent_0")
    ids = torch.tensor([[5, 9, 14, 20]])
    agent.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, agent(input_ids=ids).logits, rtol=1e-4, atol=1e-5)

    trainer.args.lora_save = "adapter"
    trainer.save_model(tmp_path / "adapter")
    files = {p.name for p in (tmp_path / "adapter" / "agent_0").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files
