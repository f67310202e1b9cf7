"""``precision="bf16-mixed"``: bf16 sampling copies and bf16 autocast of the log-prob forwards, fp32 everything kept.

Checked: what each model forward ran with (a real forward hook records the weights' dtype, autocast and
grad mode), that weights, gradients and AdamW state stay float32, the numerics against float32, that the
trainer still learns the letters task, and the refusal under FSDP. Resume equality and the planned LR
under mixed precision are cells of the combination matrix (tests/test_matrix.py).
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.parallel import sharding
from comlrl.tasks.letters import letters_reward, rows
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl.training.logprobs import completion_logprobs
from comlrl.training.mixed_precision import compute_dtype, sampling_copy, sampling_models

ALL_ROWS = rows(48)
COMMON = dict(num_agents=2, num_generations=4, max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=None,
              agent_learning_rate=3e-3, per_device_train_batch_size=2, disable_tqdm=True, seed=0)


def trainer_for(model: str, precision: str, epochs: int = 1, rows_: int = 4, **options) -> MAGRPOTrainer:
    config = MAGRPOConfig(precision=precision, num_train_epochs=epochs, **dict(COMMON, **options))
    return MAGRPOTrainer(agent_model=model, args=config, reward_func=letters_reward,
                         train_dataset=Dataset.from_list(ALL_ROWS[:rows_]),
                         eval_dataset=Dataset.from_list(ALL_ROWS[40:48]))


def test_compute_dtype():
    assert compute_dtype("bf16-mixed") is torch.bfloat16
    assert all(compute_dtype(p) is None for p in ("auto", "fp32", "bf16", "fp16"))


def test_a_sampling_copy_is_the_model_in_bf16_and_leaves_the_model_alone(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copy = sampling_copy(model, torch.bfloat16)
    assert copy is not model and not copy.training
    for name, tensor in copy.state_dict().items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, before[name].to(torch.bfloat16)), name
    assert all(not p.requires_grad for p in copy.parameters())
    for name, tensor in model.state_dict().items():  # the trained model: same dtype and values
        assert tensor.dtype == torch.float32 and torch.equal(tensor, before[name]), name
    assert sampling_models([model], None)[0] is model


def test_a_lora_agent_is_copied_with_its_adapters(tiny_llama):
    trainer = trainer_for(tiny_llama, "bf16-mixed", lora_rank=2)
    agent = trainer.agents[0]
    with torch.no_grad():  # give the adapters weights of their own (B starts at zero)
        for name, parameter in agent.named_parameters():
            if "lora_B" in name:
                parameter.normal_()
    copy = trainer.sampling_agents()[0]
    adapters = {n: p for n, p in copy.named_parameters() if "lora_" in n}
    assert adapters and all(p.dtype == torch.bfloat16 for p in adapters.values())
    ids = torch.tensor([[5, 9, 13, 17]])
    with torch.no_grad():
        expected = agent(input_ids=ids).logits
        got = copy(input_ids=ids).logits.float()
    assert torch.allclose(got, expected, atol=0.1)  # the adapters are in the copy: bf16 rounding only
    with torch.no_grad(), agent.disable_adapter():
        assert not torch.allclose(agent(input_ids=ids).logits, expected, atol=0.1)


class ForwardLog:
    """Records, per forward of a model (or of a copy made of it: a copy keeps the same hook function),
    the dtype of its weights, whether autocast was on and whether gradients were being recorded."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[tuple[torch.dtype, bool, bool]] = []
        calls = self.calls

        def hook(module, args, kwargs):  # a function: deepcopy shares it, and so the list it appends to
            weight = module.get_input_embeddings().weight
            calls.append((weight.dtype, torch.is_autocast_enabled("cpu"), torch.is_grad_enabled()))

        model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("kl", [False, True], ids=["no-kl", "reference-kl"])
def test_what_each_forward_ran_with(kl, tiny_llama):
    trainer = trainer_for(tiny_llama, "bf16-mixed", reference_kl_enabled=kl, reference_kl_mode="loss")
    logs = [ForwardLog(agent) for agent in trainer.agents]  # the hook travels into the sampling copies
    trainer.train()
    for log in logs:
        sampling = [call for call in log.calls if call[0] == torch.bfloat16]
        forwards = [call for call in log.calls if call[0] == torch.float32]
        assert sampling and all(not autocast and not grad for _, autocast, grad in sampling)  # bf16 weights decode
        assert forwards and all(autocast for _, autocast, _ in forwards)  # every fp32-weight forward: autocast
        assert any(grad for _, _, grad in forwards)  # ... the update's among them
        if kl:  # the behaviour log-probs: an fp32-weight forward without a graph, under autocast too
            assert any(not grad for _, _, grad in forwards)


def test_fp32_runs_no_autocast_and_samples_from_the_agents(tiny_llama):
    trainer = trainer_for(tiny_llama, "fp32")
    log = ForwardLog(trainer.agents[0])
    assert trainer.sampling_agents()[0] is trainer.agents[0]
    trainer.train()
    assert log.calls and all(dtype == torch.float32 and not autocast for dtype, autocast, _ in log.calls)


def test_weights_gradients_and_optimizer_state_stay_float32(tiny_llama):
    trainer = trainer_for(tiny_llama, "bf16-mixed")
    initial = [{k: v.clone() for k, v in agent.state_dict().items()} for agent in trainer.agents]
    grads: list[torch.dtype] = []
    for agent in trainer.agents:
        for parameter in agent.parameters():
            parameter.register_hook(lambda grad: grads.append(grad.dtype))
    trainer.train()
    assert grads and set(grads) == {torch.float32}
    for agent, start in zip(trainer.agents, initial):
        assert all(p.dtype == torch.float32 for p in agent.parameters())
        assert any(not torch.equal(v, start[k]) for k, v in agent.state_dict().items())  # it trained
    for component in trainer.model_optimizers.values():
        states = [s for s in component.optimizer.state.values() if s]
        assert states and all(t.dtype == torch.float32 for s in states for k, t in s.items() if k != "step")


def test_autocast_logprobs_are_close_to_float32_but_not_equal(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = tokenizer(["write about the cat", "write about the cat"], return_tensors="pt")
    completion = torch.tensor([[7, 11, 19, 23], [29, 31, 37, 41]])
    mask = torch.ones_like(completion)
    args = (model, prompt["input_ids"], prompt["attention_mask"], completion, mask, 1.0)
    exact = completion_logprobs(*args)
    mixed = completion_logprobs(*args, torch.bfloat16)
    assert mixed.dtype == torch.float32
    difference = (mixed - exact).abs()
    assert 0 < float(difference.detach().max()) < 0.1, difference
    exact.sum().backward()
    exact_grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    mixed.sum().backward()
    mixed_grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert mixed_grads.dtype == torch.float32
    assert float(torch.nn.functional.cosine_similarity(exact_grads, mixed_grads, dim=0)) > 0.99


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_magrpo_learns_in_mixed_precision(seed, tiny_llama):
    """The letters task (as tests/test_learning.py): the held-out reward rises by the fp32 run's margin."""
    trainer = trainer_for(tiny_llama, "bf16-mixed", epochs=3, rows_=32, seed=seed, max_new_tokens=16,
                          eval_num_samples=8)
    before = trainer.evaluate()["eval/reward_mean"]
    trainer.train()
    after = trainer.evaluate()["eval/reward_mean"]
    assert after >= before + 0.15, (before, after)


def test_fsdp_refuses_mixed_precision_before_loading():
    with pytest.raises(ValueError, match="precision='bf16-mixed' cannot be combined with FSDP"):
        sharding.check_shardable("MAGRPOTrainer", None, None, [torch.device("cpu")], "bf16-mixed")


def test_an_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision"):
        MAGRPOConfig(precision="bf16_mixed")
