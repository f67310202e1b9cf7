"""FSDP: a 2-process torchrun (gloo) MAGRPO step with sharded agents equals a 1-process step over the
same global batch; checkpoints move between sharded and unsharded runs in both directions;
sharded agents sample without waiting on each other and export ordinary model directories;
the same holds for MAAC and IAC with sharded critics and value heads, and for MAAC when every reward of
one process's prompts is dropped; and the launch settings
are read (or refused) as accelerate's FSDP config sets them.

The worker is tests/distributed_worker.py, launched with the variables ``accelerate launch
--config_file infra/accelerate/fsdp.yaml`` sets.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from comlrl.parallel.distributed import check_launch
from comlrl.rollout.generation import generate_completions
from comlrl.rollout.sampling import SamplingParams
from comlrl.parallel.sharding import FSDPSettings, check_shardable
from comlrl.trainers.preference import MARLHFTrainer
from distributed_worker import build, build_actor_critic, uneven_lengths
from test_distributed import (assert_weights_close, checkpoint_weights, equal_length_prompts, launch_worker,
                              launch_worker_function)

FSDP_LAUNCH = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true",
               "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_OFFLOAD_PARAMS": "false",
               "FSDP_CPU_RAM_EFFICIENT_LOADING": "false"}


@pytest.fixture(scope="module")
def runs(tiny_llama, tmp_path_factory):
    """A 1-process run of two steps (checkpoint after each), then the 2-process FSDP worker, which also
    resumes the 1-process checkpoint-1 for step 2."""
    out = tmp_path_factory.mktemp("fsdp")
    prompts = equal_length_prompts(tiny_llama)
    (out / "prompts.json").write_text(json.dumps(prompts))
    single = build(tiny_llama, prompts, per_device_batch=4, epochs=2)
    single_history = single.train(checkpoint_dir=out / "single")
    launch_worker(tiny_llama, out, str(out / "single" / "checkpoint-1"), env=FSDP_LAUNCH)
    return out, prompts, single, single_history


def test_sharded_step_equals_one_process_step(runs):
    out, _, _, single_history = runs
    shards = [json.loads((out / f"shard_{rank}.json").read_text()) for rank in range(2)]
    assert sorted(shards[0] + shards[1]) == [0, 1, 2, 3]
    first, parallel = single_history[0], json.loads((out / "history.json").read_text())[0]
    for key in ("agent_0/grad_norm", "agent_1/grad_norm", "agent_0/loss", "agent_1/loss", "reward_mean"):
        assert parallel[key] == pytest.approx(first[key], rel=1e-5, abs=1e-7), key
    assert first["agent_0/grad_norm"] > 0
    # The checkpoint holds full weights, gathered from the shards, in the 1-process layout.
    sharded_checkpoint = checkpoint_weights(out / "checkpoints" / "checkpoint-1")
    single_checkpoint = checkpoint_weights(out / "single" / "checkpoint-1")
    assert [w.keys() for w in sharded_checkpoint] == [w.keys() for w in single_checkpoint]
    assert_weights_close(single_checkpoint, sharded_checkpoint, atol=1e-5)
    assert_weights_close(torch.load(out / "weights.pt", weights_only=True), sharded_checkpoint, atol=0)


def test_checkpoints_cross_between_sharded_and_unsharded_runs(runs, tiny_llama):
    out, prompts, single, single_history = runs
    # 1 process -> 2 sharded processes: step 2 as the uninterrupted 1-process run took it.
    resumed_history = json.loads((out / "resumed_history.json").read_text())
    assert resumed_history[0] == single_history[0] and len(resumed_history) == 2
    assert resumed_history[1]["agent_0/grad_norm"] == pytest.approx(single_history[1]["agent_0/grad_norm"], rel=1e-4)
    final = [agent.state_dict() for agent in single.agents]
    assert_weights_close(final, torch.load(out / "resumed_weights.pt", weights_only=True), atol=1e-5)
    # 2 sharded processes -> 1 process: weights, optimizer state and progress continue.
    resumed = build(tiny_llama, prompts, per_device_batch=4, epochs=2)
    history = resumed.train(resume_from_checkpoint=out / "checkpoints" / "checkpoint-1")
    assert resumed.state.global_step == 2
    assert history[1]["agent_0/grad_norm"] == pytest.approx(single_history[1]["agent_0/grad_norm"], rel=1e-4)
    assert_weights_close(final, [agent.state_dict() for agent in resumed.agents], atol=1e-5)


def test_sharded_agents_sample_unevenly_and_export_plain_models(runs):
    out, prompts, _, _ = runs
    exported = AutoModelForCausalLM.from_pretrained(out / "export" / "agent_0")
    gathered = torch.load(out / "weights.pt", weights_only=True)[0]
    for name, tensor in exported.state_dict().items():
        torch.testing.assert_close(tensor, gathered[name], rtol=0, atol=0, msg=name)
    # Each rank sampled its own number of tokens; an unsharded copy draws the same ones.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out / "export" / "agent_0")
    for backend in ("comlrl", "transformers"):
        for rank in range(2):
            sampling = SamplingParams(max_new_tokens=uneven_lengths(rank), backend=backend)
            expected = generate_completions(exported, tokenizer, [prompts[0]], 2, sampling,
                                            generator=torch.Generator().manual_seed(5)).completion_ids
            sampled = torch.load(out / f"sampled_{backend}_{rank}.pt", weights_only=True)
            assert sampled.shape[1] <= uneven_lengths(rank)
            assert torch.equal(sampled, expected), (backend, rank)


# ----- launch settings ----------------------------------------------------------------------------
def test_fsdp_settings_follow_accelerate_variables():
    assert FSDPSettings.from_environment({}) is None
    assert FSDPSettings.from_environment(FSDP_LAUNCH) == FSDPSettings(reshard_after_forward=True, wrap_layers=True)
    settings = FSDPSettings.from_environment({**FSDP_LAUNCH, "FSDP_RESHARD_AFTER_FORWARD": "false",
                                              "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer, Block"})
    assert settings == FSDPSettings(reshard_after_forward=False, layer_classes=("LlamaDecoderLayer", "Block"))
    assert not FSDPSettings.from_environment({**FSDP_LAUNCH, "FSDP_AUTO_WRAP_POLICY": "NO_WRAP"}).wrap_layers


@pytest.mark.parametrize("variable, value, message", [
    ("FSDP_VERSION", "1", "FSDP_VERSION='1'.*fsdp_version: 2"),
    ("FSDP_OFFLOAD_PARAMS", "true", "FSDP_OFFLOAD_PARAMS=true.*set it to false"),
    ("FSDP_CPU_RAM_EFFICIENT_LOADING", "true", "fsdp_cpu_ram_efficient_loading is not supported"),
    ("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP", "'SIZE_BASED_WRAP' is not supported"),
    ("FSDP_RESHARD_AFTER_FORWARD", "FULL_SHARD", "FSDP_RESHARD_AFTER_FORWARD='FULL_SHARD' is not a boolean"),
])
def test_unsupported_fsdp_settings_are_refused_before_loading(monkeypatch, variable, value, message):
    for name, setting in {**FSDP_LAUNCH, variable: value}.items():
        monkeypatch.setenv(name, setting)
    with pytest.raises(ValueError, match=message):
        check_launch()


def test_what_fsdp_cannot_shard_is_refused_before_loading():
    cpu = torch.device("cpu")
    check_shardable("MAGRPOTrainer", None, None, [cpu, cpu])
    with pytest.raises(ValueError, match="MARLHFTrainer cannot shard its models with FSDP: the joint reward.*multi_gpu"):
        check_shardable("MARLHFTrainer", MARLHFTrainer.fsdp_refusal, None, [cpu])
    with pytest.raises(ValueError, match="lora_rank=8 cannot be combined with FSDP"):
        check_shardable("MAGRPOTrainer", None, 8, [cpu])
    with pytest.raises(ValueError, match=r"placed on \['cpu', 'meta'\]; use device='auto' with one GPU per process"):
        check_shardable("MAGRPOTrainer", None, None, [cpu, torch.device("meta")])


def test_what_an_fsdp_launch_cannot_do_is_refused_by_the_trainers_in_their_words(tiny_llama, tmp_path):
    """A 2-process FSDP launch: the trainer, not only the check, names what it refuses and why."""
    launch_worker_function("fsdp_refusals", tiny_llama, str(tmp_path), env=FSDP_LAUNCH)
    advice = "or launch with infra/accelerate/multi_gpu.yaml (every process holds whole agents)"
    assert json.loads((tmp_path / "refusals.json").read_text()) == {
        "lora_rank": f"lora_rank=2 cannot be combined with FSDP yet; drop lora_rank, {advice}",
        "bf16-mixed": "precision='bf16-mixed' cannot be combined with FSDP yet (its bf16 sampling copies are whole "
                      f"models); use precision='bf16', {advice}",
        "madpo": "MADPOTrainer cannot shard its models with FSDP: the DPO reference copies are not sharded yet; "
                 f"launch with DDP instead; {advice}",
        "reference_kl": "MAGRPOConfig.reference_kl_enabled is not supported yet under an FSDP launch; use data "
                        "parallelism without FSDP or LoRA",
        "critic_device": "FSDP shards every agent over the processes, each on its own device (cpu here), but the "
                         "agents are placed on ['cpu', 'meta']; use device='auto' with one GPU per process "
                         "(accelerate's num_processes = GPUs)",
    }


# ----- actor-critic: sharded critics and value heads ----------------------------------------------
# Per trainer kind (tests/distributed_worker.py): the models carrying value heads (iac_shared: the actors).
# maac_drop: invalid_reward="drop" with every reward of the second process's prompts dropped, so its critic joins
# the sharded backward with a zero loss (the 1-process run drops the same rewards).
VALUE_MODELS = {"maac": ["critic"], "maac_drop": ["critic"], "iac": ["critic_0", "critic_1"],
                "iac_shared": ["agent_0", "agent_1"]}


@pytest.fixture(scope="module", params=sorted(VALUE_MODELS))
def actor_critic_runs(request, tiny_llama, tmp_path_factory):
    """A 1-process run of two steps, then the 2-process FSDP worker over the same global batches."""
    kind = request.param
    out = tmp_path_factory.mktemp(f"fsdp_{kind}")
    prompts = equal_length_prompts(tiny_llama)
    (out / "prompts.json").write_text(json.dumps(prompts))
    single = build_actor_critic(kind, tiny_llama, prompts, per_device_batch=4, epochs=2)
    single_history = single.train(checkpoint_dir=out / "single")
    launch_worker(tiny_llama, out, "--trainer", kind, env=FSDP_LAUNCH)
    return kind, out, prompts, single, single_history


def full_modules(trainer):
    return {name: module.state_dict() for name, module in trainer.checkpoint_modules().items()}


def assert_modules_close(expected, actual, atol):
    assert expected.keys() == actual.keys()
    for name in expected:
        assert_weights_close([expected[name]], [actual[name]], atol)


def test_sharded_actor_critic_steps_equal_one_process_steps(actor_critic_runs, tiny_llama):
    kind, out, _, single, single_history = actor_critic_runs
    parallel = json.loads((out / "history.json").read_text())
    critics = VALUE_MODELS[kind]
    for step in range(2):
        for key in ["agent_0/grad_norm", "agent_1/grad_norm", "reward_mean", "reward_std", "reward/dropped",
                    *(f"{c}/{name}" for c in critics for name in ("grad_norm", "value_mean", "value_error"))]:
            assert parallel[step][key] == pytest.approx(single_history[step][key], rel=1e-4, abs=1e-6), (step, key)
        for key in [f"{c}/value_loss" for c in critics]:
            assert parallel[step][key] == pytest.approx(single_history[step][key], rel=1e-4, abs=1e-7), (step, key)
    assert single_history[1][f"{critics[0]}/grad_norm"] > 0
    assert [step["reward/dropped"] for step in single_history] == ([4.0, 8.0] if kind == "maac_drop" else [0.0, 0.0])
    weights = torch.load(out / "weights.pt", weights_only=True)
    expected = full_modules(single)
    assert set(expected) == {"agent_0", "agent_1", *critics, *(f"{c}_value_head" for c in critics)}
    assert_modules_close(expected, weights, atol=1e-5)
    # The critic's backbone trained (its head's output layer starts at zero, so from step 2).
    initial = AutoModelForCausalLM.from_pretrained(tiny_llama).state_dict()
    moved = max(float((weights[critics[0]][name] - tensor).abs().max()) for name, tensor in initial.items()
                if name in weights[critics[0]])
    assert moved > 1e-4
    exported_head = torch.load(out / "export" / critics[0] / "value_head.pt", weights_only=True)
    for name, tensor in exported_head.items():
        torch.testing.assert_close(tensor, weights[f"{critics[0]}_value_head"][name], rtol=0, atol=0)
    exported = AutoModelForCausalLM.from_pretrained(out / "export" / critics[0])
    for name, tensor in exported.state_dict().items():
        torch.testing.assert_close(tensor, weights[critics[0]][name], rtol=0, atol=0, msg=name)


def test_sharded_actor_critic_checkpoint_resumes_in_one_process(actor_critic_runs, tiny_llama):
    kind, out, prompts, single, single_history = actor_critic_runs
    resumed = build_actor_critic(kind, tiny_llama, prompts, per_device_batch=4, epochs=2)
    history = resumed.train(resume_from_checkpoint=out / "checkpoints" / "checkpoint-1")
    assert resumed.state.global_step == 2
    critic = VALUE_MODELS[kind][0]
    assert history[1][f"{critic}/grad_norm"] == pytest.approx(single_history[1][f"{critic}/grad_norm"], rel=1e-4)
    assert_modules_close(full_modules(single), full_modules(resumed), atol=1e-5)
