"""The combination matrix's data-parallel cells: 2 gloo processes (torchrun, CPU) against 1 process
on the same global batches.

One launch of tests/distributed_worker.py (``--trainer matrix``) runs every cell:
- MAGRPO, 2 policy passes per batch, accumulation 3, linear schedule, 2 epochs of 2 global batches
  (4 micro-batches an epoch: a full window and a flushed partial one);
- the same run stopped by a SIGTERM on every rank after step 1, two micro-batches into a window;
- IAC with separate critics (2 critic passes per batch), accumulation 3, cosine schedule;
- MAGRPO with loss_type='dapo' and MADPO, whose losses divide by counts (completion tokens, pairs) that
  differ between the ranks: each rank divides by the mean count over the ranks;
- MARLHF (one iteration), and its preference stages as they ran before the stage gathered pairs
  and broadcast the fit (each rank alone).

The rollouts are the same in both set-ups because every prompt is sampled under its own seed
(``PerPromptSeeded`` in the worker), so only float summation order separates the runs: final
weights are compared within 1e-5 (as tests/test_distributed.py does), learning rates exactly.
The MARLHF cell is not compared with one process (its rollouts use each rank's own sampling
stream); it checks what data parallelism must keep equal across the ranks.

Those comparisons run the same trainer code on both sides. The maths cells (a second launch,
``run_maths_cells``) compare 2 processes with the maths instead: each rank records its completions,
rewards and pairs and the gradient its optimizer applies (averaged over the ranks), and the test computes,
in one process and by hand (tests/test_trainer_maths.py: plain forwards, the loss written out), the
gradient of the loss over the whole global batch: MAGRPO with 2 update passes (the second off-policy),
MAGRPO with loss_type='dapo' (normalised by every rank's completion tokens together) and MADPO (a mean
over every rank's pairs, each agent's loss coupled to the others'). Completions end early by hand
(``EndsEarlyPerPrompt``), so the ranks hold different numbers of tokens and a rank-local normaliser would
give another gradient.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from comlrl.trainers.reinforce import MAGRPOConfig
from distributed_worker import (FIXED_JOINT, MATHS_CELLS, MATRIX_GLOBAL_BATCH, build_matrix_iac, build_matrix_madpo,
                                build_matrix_magrpo, build_matrix_magrpo_dapo, letter_reward, plain_weights,
                                record_learning_rates)
from test_distributed import equal_length_prompts, launch_worker, launch_worker_function
from test_trainer_maths import FamilyMaths, assert_gradient_matches, gradient, model_at, token_logprobs

ATOL = 1e-5
# Optimizer steps per model over 2 epochs: ceil(2 batches x passes / 3) an epoch.
PLANNED = {"magrpo": {"agent_0": 4, "agent_1": 4}, "magrpo_dapo": {"agent_0": 2, "agent_1": 2},
           "madpo": {"agent_0": 2, "agent_1": 2},
           "iac": {"agent_0": 2, "agent_1": 2, "critic_0": 4, "critic_1": 4}}


@pytest.fixture(scope="module")
def matrix_run(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix_ddp")
    prompts = equal_length_prompts(tiny_llama)
    (out / "prompts.json").write_text(json.dumps(prompts))
    launch_worker(tiny_llama, out, "--trainer", "matrix")
    return out, prompts


def single_run(builder, model_dir, prompts, **train_options):
    """The 1-process reference over the same global batches, with its learning rates per step."""
    trainer = builder(model_dir, prompts, per_device_batch=MATRIX_GLOBAL_BATCH)
    assert not trainer.data_parallel.enabled
    rates = record_learning_rates(trainer.model_optimizers)
    trainer.train(**train_options)
    return trainer, rates


@pytest.fixture(scope="module")
def single_magrpo(matrix_run, tiny_llama):
    return single_run(build_matrix_magrpo, tiny_llama, matrix_run[1])


@pytest.fixture(scope="module")
def single_iac(matrix_run, tiny_llama):
    return single_run(build_matrix_iac, tiny_llama, matrix_run[1])


def per_rank(directory, name):
    if name.endswith(".pt"):
        return [torch.load(directory / name.format(rank=rank), weights_only=True) for rank in range(2)]
    return [json.loads((directory / name.format(rank=rank)).read_text()) for rank in range(2)]


def assert_modules_close(expected, actual, atol, what):
    assert expected.keys() == actual.keys(), what
    for module in expected:
        assert expected[module].keys() == actual[module].keys(), (what, module)
        for key, tensor in expected[module].items():
            torch.testing.assert_close(actual[module][key], tensor, rtol=0, atol=atol, msg=f"{what}: {module}.{key}")


def assert_modules_equal(expected, actual, what):
    assert expected.keys() == actual.keys(), what
    for module in expected:
        for key, tensor in expected[module].items():
            assert torch.equal(actual[module][key], tensor), f"{what}: {module}.{key} differs"


def assert_every_module_trained(final, model_dir, initial_weights=None):
    """Every module moved from where it started (so equal weights are not equal by standing still)."""
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    for module, tensors in final.items():
        start = initial_weights[module] if initial_weights and module in initial_weights else initial
        moved = max(float((tensor - start[key]).abs().max()) for key, tensor in tensors.items() if key in start)
        assert moved > 1e-4, f"{module} did not train (moved {moved})"


def assert_nothing_left(directory):
    for rank, left in enumerate(per_rank(directory, "leftovers_{rank}.json")):
        for name, entry in left.items():
            assert entry["pending"] == 0, f"rank {rank}, {name}: {entry['pending']} micro-batches never applied"
            assert entry["grads"] == [], f"rank {rank}, {name}: gradients left on {entry['grads'][:3]}"


def check_cell(kind, directory, single, rates):
    """Weights, learning rates and leftovers of a 2-process cell against its 1-process run."""
    # Learning rates: the same planned schedule on both ranks and in one process, step by step.
    rank_rates = per_rank(directory, "lrs_{rank}.json")
    assert rank_rates[0] == rank_rates[1]
    assert rank_rates[0] == rates
    for name, steps in rates.items():
        component = single.model_optimizers[name]
        assert len(steps) == component.planned_steps == PLANNED[kind][name], (name, steps)
        assert all(a > b > 0 for a, b in zip(steps, steps[1:])), f"{name}: the schedule did not advance: {steps}"
    # The same samples (per-prompt seeds): the same rewards at every step; the same averaged gradient (its
    # norm: under clipping and AdamW a wrongly scaled mean would leave the weights alike) and losses.
    single_rewards = [step["reward_mean"] for step in single.state.history]
    tracked = ("/grad_norm", "/loss", "/policy_loss", "/value_loss")
    for history in per_rank(directory, "history_{rank}.json"):
        assert [step["reward_mean"] for step in history] == pytest.approx(single_rewards, rel=1e-6, abs=1e-9)
        for step, (mine, reference) in enumerate(zip(history, single.state.history, strict=True)):
            keys = {key for key in reference if key.endswith(tracked)}
            assert keys == {key for key in mine if key.endswith(tracked)}, step
            for key in keys:
                assert mine[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), (step, key)
    assert any(key.endswith("/grad_norm") for step in single.state.history for key in step)
    # Every rank ends with the same weights, those of the 1-process run.
    weights = per_rank(directory, "weights_{rank}.pt")
    assert_modules_equal(weights[0], weights[1], "rank 1 vs rank 0")
    expected = plain_weights(single)
    assert_modules_close(expected, weights[0], ATOL, "2 processes vs 1")
    # No gradient is left anywhere, nothing is pending (both set-ups).
    assert_nothing_left(directory)
    for name, component in single.model_optimizers.items():
        assert component.pending == 0, name
        assert all(p.grad is None for p in component.module.parameters()), name
    return expected


def test_magrpo_passes_accumulation_linear_two_processes_equal_one(matrix_run, single_magrpo, tiny_llama):
    out, _ = matrix_run
    single, rates = single_magrpo
    final = check_cell("magrpo", out / "magrpo", single, rates)
    assert_every_module_trained(final, tiny_llama)


@pytest.mark.parametrize("kind, builder", [("magrpo_dapo", build_matrix_magrpo_dapo), ("madpo", build_matrix_madpo)])
def test_per_token_and_per_pair_losses_two_processes_equal_one(kind, builder, matrix_run, tiny_llama):
    """DAPO normalises by the batch's completion tokens and MADPO's DPO loss is a mean over the batch's pairs;
    both counts differ between the ranks, so each rank must divide by the count over all ranks."""
    out, prompts = matrix_run
    single, rates = single_run(builder, tiny_llama, prompts)
    final = check_cell(kind, out / kind, single, rates)
    assert_every_module_trained(final, tiny_llama)


def test_iac_separate_critics_accumulation_cosine_two_processes_equal_one(matrix_run, single_iac, tiny_llama):
    out, _ = matrix_run
    single, rates = single_iac
    final = check_cell("iac", out / "iac", single, rates)
    # Actors and critic backbones moved; the value heads moved from their (seeded) initial weights.
    fresh = build_matrix_iac(tiny_llama, matrix_run[1], per_device_batch=MATRIX_GLOBAL_BATCH)
    assert_every_module_trained(final, tiny_llama, initial_weights=plain_weights(fresh))


def test_marlhf_ranks_hold_the_same_pairs_and_reward_model(matrix_run):
    out, prompts = matrix_run
    rows = per_rank(out / "marlhf", "rows_{rank}.json")
    assert rows == [[0, 2], [1, 3]]  # each rank collected its own share of the prompts
    pairs = per_rank(out / "marlhf", "pairs_{rank}.json")
    assert pairs[0] == pairs[1]
    collected = [pair["row_index"] for pair in pairs[0]]
    assert collected == sorted(collected), "pairs are not in prompt order"
    assert set(collected) & set(rows[0]) and set(collected) & set(rows[1]), "a rank's pairs are missing"
    assert all(pair["prompt"] == prompts[pair["row_index"]] for pair in pairs[0])

    rewards = per_rank(out / "marlhf", "reward_{rank}.pt")
    assert_modules_equal({"reward_model": rewards[0]["reward_model"]}, {"reward_model": rewards[1]["reward_model"]},
                         "reward model, rank 1 vs rank 0")
    assert torch.equal(rewards[0]["score"], rewards[1]["score"]), (rewards[0]["score"], rewards[1]["score"])
    # The policy stage optimised the same learned reward on every rank: the same agents at the end.
    weights = per_rank(out / "marlhf", "weights_{rank}.pt")
    assert_modules_equal(weights[0], weights[1], "MARLHF agents, rank 1 vs rank 0")

    # As it was before (each rank collected every prompt with its own sampling stream, kept its pairs and
    # its fit), the ranks held different pairs and reward models, which scored the same text differently.
    local_pairs = per_rank(out / "marlhf_local", "pairs_{rank}.json")
    assert local_pairs[0] and local_pairs[1] and local_pairs[0] != local_pairs[1]
    local = per_rank(out / "marlhf_local", "reward_{rank}.pt")
    fitted = [state["reward_model"] for state in local]
    assert any(not torch.equal(fitted[0][key], fitted[1][key]) for key in fitted[0])
    assert not torch.equal(local[0]["score"], local[1]["score"]), FIXED_JOINT


def test_two_process_checkpoint_resumes_in_one_process(matrix_run, single_magrpo, tiny_llama):
    """Epoch-boundary checkpoint (after the flush) of the accumulation-3 cell: the 1-process resume ends
    as the uninterrupted 1-process run, with its learning rates at the remaining steps."""
    out, prompts = matrix_run
    single, rates = single_magrpo
    resumed, resumed_rates = single_run(build_matrix_magrpo, tiny_llama, prompts,
                                        resume_from_checkpoint=out / "magrpo" / "checkpoints" / "checkpoint-1")
    assert resumed.state.global_step == single.state.global_step == 4
    for name, steps in resumed_rates.items():
        assert len(steps) == 2 and steps == rates[name][-2:], name
    assert_modules_close(plain_weights(single), plain_weights(resumed), ATOL, "resumed vs uninterrupted")


def stopped_checkpoint(out):
    """Where the 2-process run stopped by a SIGTERM on every rank after step 1 checkpointed (both ranks agree)."""
    stopped = per_rank(out / "magrpo_stop", "stopped_{rank}.json")
    assert stopped[0] == stopped[1]
    return stopped[0]


def test_two_process_stop_checkpoints_a_pending_window(matrix_run):
    """After step 1 of the accumulation-3 cell (2 policy passes: 2 micro-batches) the window is pending."""
    out, _ = matrix_run
    stopped = stopped_checkpoint(out)
    assert stopped["global_step"] == 1 and stopped["pending"] == {"agent_0": 2, "agent_1": 2}
    state = torch.load(f"{stopped['checkpoint']}/state.pt", weights_only=True)
    for name in ("agent_0", "agent_1"):
        assert state["optimizers"][name]["pending"] == 2 and state["optimizers"][name]["pending_grads"], name
    assert per_rank(out / "magrpo_stop", "lrs_{rank}.json") == [{"agent_0": [], "agent_1": []}] * 2  # no step yet


def test_two_process_mid_window_checkpoint_resumes_in_one_process(matrix_run, single_magrpo, tiny_llama):
    """That checkpoint, resumed in one process, must end as the uninterrupted 1-process run."""
    out, prompts = matrix_run
    single, rates = single_magrpo
    resumed, resumed_rates = single_run(build_matrix_magrpo, tiny_llama, prompts,
                                        resume_from_checkpoint=stopped_checkpoint(out)["checkpoint"])
    assert resumed.state.global_step == 4
    for name, steps in resumed_rates.items():
        assert steps == rates[name], name  # no optimizer step had been taken before the stop
    assert [s["reward_mean"] for s in resumed.state.history] == pytest.approx(
        [s["reward_mean"] for s in single.state.history], rel=1e-6, abs=1e-9)
    assert_modules_close(plain_weights(single), plain_weights(resumed), ATOL, "mid-window resume vs uninterrupted")


# ----- the maths cells: 2 processes against the one-process maths, by hand -------------------------------
@pytest.fixture(scope="module")
def maths_run(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix_ddp_maths")
    (out / "prompts.json").write_text(json.dumps(equal_length_prompts(tiny_llama)))
    launch_worker_function("run_maths_cells", tiny_llama, str(out / "prompts.json"), str(out))
    return out


def load_ranks(out, cell):
    ranks = [torch.load(out / cell / f"rank_{rank}.pt", weights_only=True) for rank in range(2)]
    assert ranks[0]["rows"] != ranks[1]["rows"], "both ranks rolled out the same prompts"
    for rank in ranks:  # the rewards are the task reward of what the rank sampled (letter_reward, aligned joints)
        texts = [generation["texts"] for generation in rank["generations"]]
        assert rank["rewards"].reshape(-1).tolist() == pytest.approx(letter_reward(*texts), abs=1e-6)
    return ranks


def batch_of(parts: list[dict]) -> SimpleNamespace:
    """Completions of several ranks as one batch, in rank order, right-padded to one width (equal-length prompts)."""
    width = max(part["completion_ids"].shape[1] for part in parts)

    def padded(key):
        return torch.cat([torch.nn.functional.pad(part[key], (0, width - part[key].shape[1])) for part in parts])

    return SimpleNamespace(prompt_ids=torch.cat([part["prompt_ids"] for part in parts]),
                           prompt_mask=torch.cat([part["prompt_mask"] for part in parts]),
                           completion_ids=padded("completion_ids"), completion_mask=padded("completion_mask"))


def applied_steps(ranks, agent):
    """The agent's optimizer steps as applied (averaged over the ranks: equal on both)."""
    steps = [rank["steps"][agent] for rank in ranks]
    assert len(steps[0]) == len(steps[1])
    for mine, other in zip(*steps):
        for name, tensor in mine["applied"].items():
            torch.testing.assert_close(other["applied"][name], tensor, rtol=0, atol=1e-7, msg=name)
    return steps[0]


def cell_config(cell) -> MAGRPOConfig:
    kind, fields = MATHS_CELLS[cell]
    return MAGRPOConfig(num_agents=2, num_generations=4, max_new_tokens=6, temperature=1.0, **fields)


def test_two_processes_apply_the_token_level_gradient_of_the_global_batch(maths_run, tiny_llama):
    """loss_type='dapo': sum of every token's loss over every rank's completions / all their tokens. Each rank's
    own token count would weight the ranks' halves differently (the counts differ: completions end early)."""
    ranks = load_ranks(maths_run, "magrpo_dapo")
    args = cell_config("magrpo_dapo")
    rewards = torch.cat([rank["rewards"] for rank in ranks])
    for agent in range(2):
        [step] = applied_steps(ranks, agent)
        parts = [rank["generations"][agent] for rank in ranks]
        assert int(parts[0]["completion_mask"].sum()) != int(parts[1]["completion_mask"].sum())
        maths = FamilyMaths(tiny_llama, batch_of(parts), rewards, step["parameters"], args)
        expected = maths.gradient(step["parameters"], maths.advantages())
        per_rank = [FamilyMaths(tiny_llama, batch_of([part]), rank["rewards"], step["parameters"], args)
                    for part, rank in zip(parts, ranks)]
        rank_local = [m.gradient(step["parameters"], m.advantages()) for m in per_rank]
        averaged = {name: (rank_local[0][name] + rank_local[1][name]) / 2 for name in expected}
        assert_gradient_matches(step["applied"], expected, {"each rank normalising by its own tokens": averaged})


def test_two_processes_apply_the_off_policy_second_pass_of_the_global_batch(maths_run, tiny_llama):
    """policy_update_epochs=2: the first step is the on-policy GRPO gradient over all 16 completions; the second
    runs at the stepped weights with the ratio to the sampling policy (not 1)."""
    ranks = load_ranks(maths_run, "magrpo_passes2")
    args = cell_config("magrpo_passes2")
    rewards = torch.cat([rank["rewards"] for rank in ranks])
    for agent in range(2):
        first, second = applied_steps(ranks, agent)
        parts = [rank["generations"][agent] for rank in ranks]
        maths = FamilyMaths(tiny_llama, batch_of(parts), rewards, first["parameters"], args)
        advantages = maths.advantages()
        assert_gradient_matches(first["applied"], maths.gradient(first["parameters"], advantages), {})
        assert_gradient_matches(second["applied"], maths.gradient(second["parameters"], advantages),
                                {"ratio 1": maths.gradient(second["parameters"], advantages, ratio_one=True)})


def test_two_processes_apply_the_joint_dpo_gradient_of_every_pair(maths_run, tiny_llama):
    """MADPO without a reference: agent a's gradient is that of (1 / all pairs) sum_p -log sigmoid(beta (delta_a
    + sg(delta_b))), over both ranks' pairs; each rank's own pair count, or independent per-agent DPO, differ."""
    ranks = load_ranks(maths_run, "madpo")
    beta = MATHS_CELLS["madpo"][1]["dpo_beta"]
    # Every ordered pair with a reward gap, per prompt (max_pairs_per_prompt=None); rows: prompt * 4 + sample.
    chosen, rejected, owner = [], [], []
    for rank_index, rank in enumerate(ranks):
        offset = 8 * rank_index
        kept = []
        for prompt, rewards in enumerate(rank["rewards"].tolist()):
            pairs = {(w, l) for w in range(4) for l in range(4) if rewards[w] > rewards[l]}
            kept.append(pairs)
            for w, l in sorted(pairs):
                chosen.append(offset + 4 * prompt + w)
                rejected.append(offset + 4 * prompt + l)
                owner.append(rank_index)
        assert [set(map(tuple, pairs)) for pairs in rank["pairs"]] == kept
    owner = torch.tensor(owner)
    counts = [int((owner == r).sum()) for r in range(2)]
    models, deltas = [], []
    for agent in range(2):
        [step] = applied_steps(ranks, agent)
        generation = batch_of([rank["generations"][agent] for rank in ranks])
        model = model_at(tiny_llama, step["parameters"])
        sequence = (token_logprobs(model, generation, 1.0) * generation.completion_mask.float()).sum(dim=1)
        models.append(model)
        deltas.append(sequence[chosen] - sequence[rejected])
    for agent in range(2):
        joint = -torch.nn.functional.logsigmoid(beta * (deltas[agent] + deltas[1 - agent].detach()))
        expected = gradient(joint.mean(), models[agent], keep_graph=True)
        wrong = {"independent per-agent DPO": gradient(
            -torch.nn.functional.logsigmoid(beta * deltas[agent]).mean(), models[agent], keep_graph=True)}
        if counts[0] != counts[1]:  # a rank-local mean weighs the ranks' pairs differently
            wrong["each rank's own pair count"] = gradient(
                sum(joint[owner == r].mean() for r in range(2)) / 2, models[agent], keep_graph=True)
        assert_gradient_matches(ranks[0]["steps"][agent][0]["applied"], expected, wrong)


def test_a_dpo_stage_reports_the_rewards_every_process_dropped_in_its_collection(tiny_llama, tmp_path):
    """MADPOIter over 2 processes with ``invalid_reward="drop"``: only the second process's prompts get NaN rewards,
    dropped in its preference collection (no online step counts them). Every DPO step's ``reward/dropped`` on
    every rank is the total the reward functions gave (4 here), not each process's own count averaged (2)."""
    launch_worker_function("madpo_iter_drops", tiny_llama, str(tmp_path))
    nans = [json.loads((tmp_path / f"nans_{rank}.json").read_text()) for rank in range(2)]
    assert nans[0] == 0 and nans[1] > 0
    for rank in range(2):
        dropped = json.loads((tmp_path / f"dropped_{rank}.json").read_text())
        assert dropped and dropped == [float(sum(nans))] * len(dropped), (rank, dropped)
