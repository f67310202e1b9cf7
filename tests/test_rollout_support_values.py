"""Issue 39: the rollout's supporting modules, each result checked against values worked out in the test.

- ``comlrl.rollout.reward_calls``: a user's reward function called through :class:`JointReward` with retries,
  a timeout and a stop request (the attempts counted, the backoff each retry logs, each refusal's words);
- ``comlrl.rollout.sampling``: the warpers and the decode loop on a tiny model, against the logits of plain
  forwards taken in the test;
- ``comlrl.rollout.packed_weights``: when weights are packed and what a packed layer computes;
- ``comlrl.training.metrics``: a logging window's means and totals by hand;
- ``comlrl.training.mixed_precision``: the bf16 sampling copies and the autocast block.
"""

from __future__ import annotations

import inspect
import logging
import math
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, BloomConfig, BloomForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import comlrl.rollout.packed_weights as packed_weights_module
from comlrl.errors import TrainingInterrupted
from comlrl.models.lora import add_adapters
from comlrl.rollout.generation import generate_completions
from comlrl.rollout.packed_weights import packed_linears, packing_supported
from comlrl.rollout.reward_calls import RewardCallError, RewardCallPolicy, RewardWaitInterrupted
from comlrl.rollout.rewards import JointReward
from comlrl.rollout.sampling import (BACKENDS, SamplingParams, cache_argument, check_scores, decode, forward_parameters,
                                     next_tokens, sample_one, temperature_scale, top_k_filter, top_p_filter,
                                     warp_logits)
from comlrl.training.metrics import COUNTERS, MetricWindow, update_measurement
from comlrl.training.mixed_precision import autocast, compute_dtype, sampling_copy, sampling_models
from comlrl.training.signals import StopRequest

COMPLETIONS = [["aa", "b"], ["c", "dd"]]
ROWS = [{"prompt": "p"}, {"prompt": "q"}]


# --- reward_calls: the user's reward function, retried, timed out, stopped -------------------------------------


def flaky(failures: int, fault=None):
    """A reward function, ``judge``, that fails (``fault()``) on its first ``failures`` calls and then answers each
    sample's total length; ``judge.calls`` counts its calls."""

    def judge(completions_0, completions_1):
        judge.calls += 1
        if judge.calls <= failures:
            (fault or down)()
        return [float(len(a) + len(b)) for a, b in zip(completions_0, completions_1)]

    judge.calls = 0
    return judge


def down():
    raise ValueError("the judge is down")


JUDGE = "flaky.<locals>.judge"


def reward_with(func, **policy) -> JointReward:
    return JointReward(func, num_agents=2, call_policy=RewardCallPolicy(**policy) if policy else None)


def retry_delays(caplog) -> list[tuple]:
    return [record.args for record in caplog.records if record.name == "comlrl.rollout.reward_calls"]


def test_a_reward_that_fails_then_answers_is_called_once_per_attempt_and_logs_each_backoff(caplog):
    judge = flaky(failures=2)
    caplog.set_level(logging.WARNING, logger="comlrl.rollout.reward_calls")
    rewards = reward_with(judge, retries=2, backoff=0.1)(COMPLETIONS, ROWS)
    assert rewards.tolist() == [3.0, 3.0] and judge.calls == 3
    # retry k+1 waits backoff * 2**k: 0.1 s, then 0.2 s
    assert retry_delays(caplog) == [(JUDGE, "raised ValueError: the judge is down", 1, 2, 0.1),
                                    (JUDGE, "raised ValueError: the judge is down", 2, 2, 0.2)]
    assert caplog.records[0].getMessage() == f"reward function {JUDGE} raised ValueError: the judge is down; " \
                                             "retry 1 of 2 in 0.1 s"


def test_spent_retries_name_the_function_the_attempts_and_the_last_error():
    judge = flaky(failures=3)
    with pytest.raises(RewardCallError) as raised:
        reward_with(judge, retries=2, backoff=0.0)(COMPLETIONS, ROWS)
    assert str(raised.value) == f"reward function {JUDGE} raised ValueError: the judge is down (after 3 attempts)"
    assert judge.calls == 3 and isinstance(raised.value.__cause__, ValueError)


def test_without_retries_one_failure_is_the_error_without_a_count():
    judge = flaky(failures=1)
    with pytest.raises(RewardCallError) as raised:
        reward_with(judge)(COMPLETIONS, ROWS)
    assert str(raised.value) == f"reward function {JUDGE} raised ValueError: the judge is down"
    assert judge.calls == 1


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_sys_exit_in_a_reward_is_an_error_naming_the_exit_code(timeout):
    judge = flaky(failures=5, fault=lambda: sys.exit(3))
    with pytest.raises(RewardCallError) as raised:
        reward_with(judge, retries=1, backoff=0.0, timeout=timeout)(COMPLETIONS, ROWS)
    assert str(raised.value) == f"reward function {JUDGE} called sys.exit(3) (after 2 attempts)"
    assert judge.calls == 2 and isinstance(raised.value.__cause__, SystemExit)


def test_a_keyboard_interrupt_in_a_reward_is_not_retried():
    def interrupt():
        raise KeyboardInterrupt

    judge = flaky(failures=5, fault=interrupt)
    with pytest.raises(KeyboardInterrupt):
        reward_with(judge, retries=3, backoff=0.0)(COMPLETIONS, ROWS)
    assert judge.calls == 1


def test_with_a_timeout_a_call_answers_from_its_thread_and_its_error_is_retried():
    judge = flaky(failures=1)
    reward = reward_with(judge, retries=1, backoff=0.0, timeout=5.0)
    assert reward(COMPLETIONS, ROWS).tolist() == [3.0, 3.0] and judge.calls == 2
    # the reward ran outside the training thread, in a daemon thread named after it (a hung one never blocks exit)
    seen = []

    def where(completions_0, completions_1):
        thread = threading.current_thread()
        seen.append((thread.name, thread.daemon))
        return [0.0, 0.0]

    reward_with(where, timeout=5.0)(COMPLETIONS, ROWS)
    assert seen == [("reward test_with_a_timeout_a_call_answers_from_its_thread_and_its_error_is_retried.<locals>"
                     ".where", True)]
    # without a timeout, in the training thread
    seen.clear()
    reward_with(where)(COMPLETIONS, ROWS)
    assert seen == [(threading.current_thread().name, threading.current_thread().daemon)]


def test_a_call_is_given_its_whole_timeout():
    judge = flaky(failures=1, fault=lambda: threading.Event().wait(1.2))  # slow, then it answers
    assert reward_with(judge, timeout=2.0)(COMPLETIONS, ROWS).tolist() == [3.0, 3.0] and judge.calls == 1


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_the_rows_reach_a_reward_that_takes_them_by_keyword_in_either_thread(timeout):
    def by_row(completions_0, completions_1, batch_items=None):
        return [10.0 * len(row["prompt"]) + len(a) for row, a in zip(batch_items, completions_0)]

    rows = [{"prompt": "p"}, {"prompt": "qqq"}]
    assert reward_with(by_row, timeout=timeout)(COMPLETIONS, rows).tolist() == [12.0, 31.0]  # 10 + 2, 30 + 1


def test_a_hung_call_times_out_on_every_attempt_with_the_timeout_named():
    release = threading.Event()
    judge = flaky(failures=5, fault=lambda: release.wait(30))
    try:
        with pytest.raises(RewardCallError) as raised:
            reward_with(judge, retries=1, backoff=0.0, timeout=0.15)(COMPLETIONS, ROWS)
    finally:
        release.set()
    assert str(raised.value) == f"reward function {JUDGE} did not return within reward_timeout=0.15 s " \
                                "(after 2 attempts)"
    assert judge.calls == 2 and isinstance(raised.value.__cause__, TimeoutError)


def test_a_stop_request_ends_the_wait_for_a_hung_call():
    stop, release = StopRequest(), threading.Event()

    def hang():
        stop.signal_name = "SIGTERM"  # the signal arrives while the call runs
        release.wait(30)

    judge = flaky(failures=5, fault=hang)
    reward = reward_with(judge, retries=3, backoff=0.0, timeout=60.0)
    reward.watch_stop(stop)
    try:
        with pytest.raises(RewardWaitInterrupted) as raised:
            reward(COMPLETIONS, ROWS)
    finally:
        release.set()
    assert str(raised.value) == f"SIGTERM received while waiting for a call of reward function {JUDGE}: the step was " \
                                "not finished"
    assert judge.calls == 1 and isinstance(raised.value, TrainingInterrupted) and raised.value.mid_step is True


def test_a_stop_request_ends_the_wait_for_a_retry():
    stop = StopRequest()

    def fail():
        stop.signal_name = "SIGINT"
        raise ValueError("the judge is down")

    judge = flaky(failures=5, fault=fail)
    reward = reward_with(judge, retries=3, backoff=0.5)  # the wait's first look sees the request
    reward.watch_stop(stop)
    with pytest.raises(RewardWaitInterrupted) as raised:
        reward(COMPLETIONS, ROWS)
    assert str(raised.value) == f"SIGINT received while waiting for a retry of reward function {JUDGE}: the step was " \
                                "not finished"
    assert judge.calls == 1


def test_a_stop_request_not_yet_made_lets_calls_and_retries_run():
    judge = flaky(failures=1)
    reward = reward_with(judge, retries=1, backoff=0.01, timeout=5.0)
    reward.watch_stop(StopRequest())
    assert reward(COMPLETIONS, ROWS).tolist() == [3.0, 3.0] and judge.calls == 2


def test_the_default_policy_is_one_attempt_without_a_timeout():
    reward = JointReward(flaky(failures=0), num_agents=2)
    assert reward.caller.policy == RewardCallPolicy(retries=0, backoff=1.0, timeout=None)


@pytest.mark.parametrize("policy, words", [
    (dict(retries=-1), "reward_retries must be >= 0, got -1"),
    (dict(backoff=-0.5), "reward_retry_backoff must be >= 0, got -0.5"),
    (dict(timeout=0), "reward_timeout must be > 0 seconds or None, got 0"),
    (dict(timeout=-1.0), "reward_timeout must be > 0 seconds or None, got -1.0"),
])
def test_a_bad_call_policy_is_refused_naming_the_setting(policy, words):
    with pytest.raises(ValueError) as raised:
        RewardCallPolicy(**policy)
    assert str(raised.value) == words


def test_the_limits_of_a_call_policy_are_accepted():
    assert RewardCallPolicy(retries=0, backoff=0.0, timeout=0.001).timeout == 0.001


# --- metrics: a logging window ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, expected", [
    ("agent_0/loss", True), ("agent_0/policy_loss", True), ("critic/value_loss", True), ("agent_1/grad_norm", True),
    ("agent_0/reward", False), ("agent_0/loss_scale", False), ("agent_0/grad_norm_clip", False),
    ("agent_2/loss", False), ("loss", False), ("agent_0/x/loss", False), ("agent_0/x_loss/y", False),
    ("agent_0/eval/policy_loss", True),  # the model is named before the first slash
])
def test_which_metrics_an_update_measured(name, expected):
    assert update_measurement(name, ["agent_0", "agent_1", "critic"]) is expected


def test_a_window_averages_each_metric_over_the_steps_that_reported_it():
    window = MetricWindow()
    window.add({"reward": 1.0, "agent_0/loss": 2.0, "dpo/steps_without_pairs": 1})
    window.add({"reward": torch.tensor(4.0), "dpo/steps_without_pairs": 1, "only_nan": math.nan},
               models=["agent_0"])
    window.add({"reward": 7.0, "agent_0/loss": math.nan, "dpo/steps_without_pairs": 0, "agent_0/reward": math.nan},
               models=["agent_0"])
    means = window.flush()
    assert means.keys() == {"reward", "agent_0/loss", "dpo/steps_without_pairs"}
    assert means["reward"] == 4.0 and type(means["reward"]) is float
    assert math.isnan(means["agent_0/loss"])  # a trained model's NaN loss is a value
    assert means["dpo/steps_without_pairs"] == 2.0  # a counter's total, not its mean
    assert window.flush() == {}
    window.add({"reward": 3.0})
    assert window.flush() == {"reward": 3.0}


def test_a_nan_loss_of_a_model_not_trained_is_left_out():
    window = MetricWindow()
    window.add({"agent_1/loss": math.nan, "agent_1/grad_norm": 3.0}, models=["agent_0"])
    window.add({"agent_1/loss": 5.0, "agent_1/grad_norm": math.nan}, models=["agent_0"])
    assert window.flush() == {"agent_1/loss": 5.0, "agent_1/grad_norm": 3.0}


def test_a_window_totals_the_counters_it_is_given():
    assert COUNTERS == frozenset({"dpo/steps_without_pairs"})
    window = MetricWindow(counters=["drops"])
    for value in (2.0, 3.0, 0.0):
        window.add({"drops": value, "dpo/steps_without_pairs": 1.0})
    assert window.flush() == {"drops": 5.0, "dpo/steps_without_pairs": 1.0}


# --- mixed precision ------------------------------------------------------------------------------------------------


@pytest.fixture
def model(tiny_llama):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_llama)


def test_bf16_mixed_computes_in_bf16_and_every_other_precision_in_the_weights_dtype():
    assert compute_dtype("bf16-mixed") is torch.bfloat16
    assert compute_dtype("fp32") is None and compute_dtype("bf16-mixed ") is None


def test_the_autocast_block_runs_the_models_linear_layers_in_bf16(model):
    ids = torch.tensor([[5, 9, 11, 3]])
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with autocast(model, torch.bfloat16):
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is torch.bfloat16
            mixed = model(input_ids=ids).logits
        with autocast(model, None):
            assert not torch.is_autocast_enabled("cpu")
            unchanged = model(input_ids=ids).logits
    assert not torch.is_autocast_enabled("cpu")
    assert plain.dtype is torch.float32 and unchanged.dtype is torch.float32 and mixed.dtype is torch.bfloat16
    assert torch.equal(unchanged, plain)
    torch.testing.assert_close(mixed.float(), plain, rtol=0.05, atol=0.05)


def test_a_sampling_copy_is_the_model_rounded_to_bf16_frozen_in_eval_mode(model):
    model.train()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    copy = sampling_copy(model, torch.bfloat16)
    assert copy is not model and not copy.training and all(not m.training for m in copy.modules())
    copied = copy.state_dict()
    for name, value in before.items():
        expected = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert copied[name].dtype == expected.dtype and torch.equal(copied[name], expected), name
    assert all(not p.requires_grad for p in copy.parameters())
    # the model is left as it was: float32, training, trainable, same values
    assert model.training and all(p.requires_grad for p in model.parameters())
    assert all(torch.equal(model.state_dict()[name], value) for name, value in before.items())
    with torch.no_grad():
        next(copy.parameters()).add_(1.0)
    assert torch.equal(next(model.parameters()), next(iter(before.values())))


def test_sampling_models_are_the_agents_or_their_bf16_copies(model, tiny_llama):
    other = AutoModelForCausalLM.from_pretrained(tiny_llama)
    same = sampling_models((model, other), None)
    assert type(same) is list and len(same) == 2 and same[0] is model and same[1] is other
    copies = sampling_models([model, other], torch.bfloat16)
    assert len(copies) == 2 and all(c is not m for c, m in zip(copies, (model, other)))
    assert all(p.dtype is torch.bfloat16 and not p.requires_grad for c in copies for p in c.parameters())
    assert torch.equal(next(copies[1].parameters()), next(other.parameters()).to(torch.bfloat16))


# --- sampling: the warpers and the decode loop ------------------------------------------------------------------


def test_the_default_sampling_is_plain_sampling_of_32_tokens():
    assert SamplingParams() == SamplingParams(temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=32,
                                              do_sample=True, backend="comlrl")
    assert BACKENDS == ("comlrl", "transformers")
    with pytest.raises(ValueError) as raised:
        SamplingParams(backend="vllm")
    assert str(raised.value) == "SamplingParams.backend must be one of ('comlrl', 'transformers'), got 'vllm'"


def test_temperature_divides_the_logits():
    logits = torch.tensor([[2.0, -4.0, 1.0]])
    assert temperature_scale(logits, 1.0) is logits
    assert temperature_scale(logits, 0.5).tolist() == [[4.0, -8.0, 2.0]]
    assert temperature_scale(logits, 2.0).tolist() == [[1.0, -2.0, 0.5]]


def test_top_k_keeps_the_k_largest_with_ties_and_all_of_a_row_when_k_covers_it():
    logits = torch.tensor([[1.0, 5.0, 3.0, 3.0, 0.0], [4.0, 2.0, 9.0, 7.0, 8.0]])
    inf = float("-inf")
    assert top_k_filter(logits, 2).tolist() == [[inf, 5.0, 3.0, 3.0, inf], [inf, inf, 9.0, inf, 8.0]]
    assert top_k_filter(logits, 1).tolist() == [[inf, 5.0, inf, inf, inf], [inf, inf, 9.0, inf, inf]]
    for k in (None, 0, 5, 6):
        assert top_k_filter(logits, k) is logits


def test_top_p_drops_tokens_whose_mass_below_reaches_one_minus_top_p_exactly():
    # four equal logits: probabilities 1/4 each, masses below 0.25, 0.5, 0.75, 1 (exact in binary)
    uniform = torch.zeros(1, 4)
    assert int(torch.isfinite(top_p_filter(uniform, 0.5)).sum()) == 2  # 0.25 and 0.5 are <= 1 - 0.5
    assert int(torch.isfinite(top_p_filter(uniform, 0.75)).sum()) == 3
    assert int(torch.isfinite(top_p_filter(uniform, 0.7)).sum()) == 3
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    kept = top_p_filter(logits, 0.6)  # probabilities of the likeliest: 0.84 and 0.67, over 0.6 alone
    assert torch.isfinite(kept).tolist() == [[False, True, False], [True, False, False]]
    assert torch.equal(kept[torch.isfinite(kept)], torch.tensor([3.0, 2.0]))
    assert top_p_filter(logits, 1.0) is logits


def test_the_filters_work_along_the_last_dimension_whatever_comes_before():
    logits = torch.tensor([[[0.0, 3.0, 1.0, 2.0]], [[4.0, 0.0, 0.0, 1.0]]])  # [2, 1, 4]
    inf = float("-inf")
    assert top_k_filter(logits, 2).tolist() == [[[inf, 3.0, inf, 2.0]], [[4.0, inf, inf, 1.0]]]
    # probabilities 0.03, 0.64, 0.09, 0.24 and 0.92, 0.02, 0.02, 0.05: the mass below a kept token is over 0.3
    assert top_p_filter(logits, 0.7).tolist() == [[[inf, 3.0, inf, 2.0]], [[4.0, inf, inf, inf]]]


def test_warping_scales_then_cuts_to_top_k_then_to_top_p():
    logits = torch.tensor([[4.0, 2.0, 0.0, -2.0]])
    # temperature 2: [2, 1, 0, -1]; top-3: [2, 1, 0, -inf]; softmax of those: 0.665, 0.245, 0.090;
    # top_p 0.85: the mass below 0 is 0.090 <= 0.15 (dropped), below 1 is 0.335 (kept)
    warped = warp_logits(logits, SamplingParams(temperature=2.0, top_k=3, top_p=0.85))
    assert warped.tolist() == [[2.0, 1.0, float("-inf"), float("-inf")]]


def test_nan_probabilities_are_refused_in_words():
    check_scores([])
    check_scores([torch.tensor([0.5, 2.0])])
    with pytest.raises(RuntimeError) as raised:
        check_scores([torch.tensor([0.5, 2.0]), torch.tensor([float("nan"), 1.0])])
    assert str(raised.value) == ("sampling: the next-token probabilities of a row hold NaN (the model's logits are not "
                                 "finite; check the weights and the learning rate)")
    with pytest.raises(RuntimeError):
        next_tokens(torch.tensor([[float("nan"), 0.0]]), SamplingParams(), torch.Generator().manual_seed(0))


def test_a_draw_scores_its_token_by_probability_over_the_same_exponential_noise():
    probabilities = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.25, 0.25]])
    noise = torch.empty(2, 3).exponential_(1, generator=torch.Generator().manual_seed(8))
    expected_scores, expected_tokens = (probabilities / noise).max(dim=-1)
    tokens, scores = sample_one(probabilities, torch.Generator().manual_seed(8))
    assert torch.equal(tokens, expected_tokens) and torch.equal(scores, expected_scores)


def test_nan_logits_are_refused_once_after_the_whole_decode(tiny_llama):
    """The check waits for the last step (one synchronisation per call): every step's forward runs first."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.fill_(float("nan"))
    forwards = []
    model.register_forward_hook(lambda module, args, output: forwards.append(1))
    with pytest.raises(RuntimeError, match="hold NaN"):
        decode(model, torch.tensor([[5, 9, 11]]), torch.ones(1, 3, dtype=torch.long), SamplingParams(max_new_tokens=4),
               [], 0, torch.Generator().manual_seed(0))
    assert len(forwards) == 4  # the prefill and three steps


def test_greedy_next_tokens_are_each_rows_argmax_and_sampled_scores_are_collected():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    assert next_tokens(logits, SamplingParams(do_sample=False), None).tolist() == [1, 0]
    scores = []
    probabilities = logits.softmax(dim=-1)
    expected = torch.multinomial(probabilities, 1, generator=torch.Generator().manual_seed(4)).squeeze(1)
    drawn = next_tokens(logits, SamplingParams(), torch.Generator().manual_seed(4), scores)
    assert torch.equal(drawn, expected) and len(scores) == 1 and scores[0].shape == (2,)


def reference_decode(model, ids, mask, sampling, eos, pad, generator, num_generations):
    """The decode written plainly: every step re-runs the whole sequence (no cache), float32 logits, the
    transformers warpers and ``torch.multinomial``; rows that ended are padded. Positions are passed to a model
    whose forward takes them (a peft model forwards them to its base)."""
    ids, mask = ids.repeat_interleave(num_generations, 0), mask.repeat_interleave(num_generations, 0)
    finished = torch.zeros(ids.shape[0], dtype=torch.bool)
    out = []
    for _ in range(sampling.max_new_tokens):
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        given = {"position_ids": positions} if "position_ids" in inspect.signature(model.forward).parameters else {}
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, **given).logits[:, -1].float()
        if sampling.do_sample:
            if sampling.temperature != 1.0:
                logits = TemperatureLogitsWarper(sampling.temperature)(None, logits)
            if sampling.top_k:
                logits = TopKLogitsWarper(sampling.top_k)(None, logits)
            if sampling.top_p < 1.0:
                logits = TopPLogitsWarper(sampling.top_p)(None, logits)
            token = torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)
        else:
            token = logits.argmax(-1)
        token = torch.where(finished, torch.full_like(token, pad), token)
        out.append(token)
        finished |= torch.isin(token, torch.tensor(eos))
        if bool(finished.all()):
            break
        ids, mask = torch.cat([ids, token[:, None]], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return torch.stack(out, 1)


def left_padded(tokenizer, prompts):
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    return encoded["input_ids"], encoded["attention_mask"]


@pytest.mark.parametrize("sampling, num_generations", [
    (SamplingParams(max_new_tokens=7), 3),
    (SamplingParams(max_new_tokens=6, temperature=0.6, top_k=9, top_p=0.8), 2),
    (SamplingParams(max_new_tokens=5, do_sample=False), 1),
])
def test_decode_draws_what_the_plain_loop_draws_padding_the_rows_that_ended(tiny_llama, sampling, num_generations):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ids, mask = left_padded(tokenizer, ["the", "a story about the moon and the sun"])
    eos = [8, 52, 41, 5]  # tokens some rows draw early (seed 11 on this tiny model): rows end at different steps
    pad = 1
    ours = decode(model, ids, mask, sampling, eos, pad, torch.Generator().manual_seed(11), num_generations)
    theirs = reference_decode(model, ids, mask, sampling, eos, pad, torch.Generator().manual_seed(11),
                              num_generations)
    assert torch.equal(ours, theirs)
    assert ours.shape[0] == 2 * num_generations and not ours.requires_grad and not ours.is_inference()


def test_a_lora_agent_decodes_through_its_base_models_signature(tiny_llama):
    """peft's forward takes ``**kwargs``: the positions and the cache are passed under the base model's names."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    base_parameters = forward_parameters(model)
    assert {"position_ids", "cache", "logits_to_keep"} <= base_parameters and cache_argument(model) == "cache"
    torch.manual_seed(2)
    wrapped = add_adapters(model, rank=4, alpha=8, dropout=0.0, target_modules=None).eval()
    with torch.no_grad():  # adapters that change the logits
        for name, parameter in wrapped.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)
    assert forward_parameters(wrapped) == base_parameters and cache_argument(wrapped) == "cache"
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ids, mask = left_padded(tokenizer, ["the", "a story about the moon and the sun"])
    sampling = SamplingParams(max_new_tokens=6)
    ours = decode(wrapped, ids, mask, sampling, [], 0, torch.Generator().manual_seed(5), 2)
    theirs = reference_decode(wrapped, ids, mask, sampling, [], 0, torch.Generator().manual_seed(5), 2)
    assert torch.equal(ours, theirs)


def test_a_model_without_position_ids_decodes_from_its_attention_mask():
    """Bloom's forward takes no ``position_ids`` (its ALiBi biases come from the attention mask)."""
    torch.manual_seed(4)
    # initializer_range 0.5: logits of a few units, so that a wrong mask moves the draws
    config = BloomConfig(vocab_size=96, hidden_size=16, n_layer=2, n_head=2, initializer_range=0.5)
    model = BloomForCausalLM(config).eval()
    assert "position_ids" not in forward_parameters(model)
    ids = torch.tensor([[0, 0, 0, 17, 40], [23, 5, 61, 8, 30]])
    mask = (torch.arange(5) >= torch.tensor([[3], [0]])).long()
    sampling = SamplingParams(max_new_tokens=6)
    ours = decode(model, ids, mask, sampling, [], 0, torch.Generator().manual_seed(6), 2)
    theirs = reference_decode(model, ids, mask, sampling, [], 0, torch.Generator().manual_seed(6), 2)
    assert ours.shape == (4, 6) and torch.equal(ours, theirs)


def test_a_bf16_sampling_copy_draws_from_float32_probabilities_as_generate_does(tiny_llama):
    """A bf16 model's logits are bf16; both backends sample from them cast to float32 (generate's own rule), so the
    draws agree. 32 prompts of 16 tokens: bf16 probabilities (rounded to 3 digits) would move some of the 512 draws."""
    copy = sampling_copy(AutoModelForCausalLM.from_pretrained(tiny_llama), torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    words = "cat dog sun moon tree river hill road".split()
    prompts = [f"{c} story about the {a} and the {b}" for a in words[:4] for b in words[4:] for c in ("a", "one")]
    draws = []
    for backend in BACKENDS:
        torch.manual_seed(9)  # generate draws from the global RNG
        sampling = SamplingParams(max_new_tokens=16, backend=backend)
        draws.append(generate_completions(copy, tokenizer, prompts, 1, sampling).completion_ids)
    assert torch.equal(draws[0], draws[1])


# --- packed decode weights ------------------------------------------------------------------------------------------

needs_packing = pytest.mark.skipif(not packing_supported(), reason="this torch build has no oneDNN packed linear")


def big_linear(out_features: int) -> torch.nn.Module:
    """One float32 linear layer of 4096 inputs: ``out_features * 4096 * 4`` bytes of weights (4096: 64 MiB)."""
    return torch.nn.Sequential(torch.nn.utils.skip_init(torch.nn.Linear, 4096, out_features, bias=False))


@needs_packing
def test_weights_are_packed_from_64_mib_on_by_default():
    with torch.inference_mode(), packed_linears(big_linear(4096), rows=2) as count:
        assert count == 1  # 4096 x 4096 x 4 bytes = 64 MiB: at the threshold
    with torch.inference_mode(), packed_linears(big_linear(4095), rows=2) as count:
        assert count == 0  # 16 KiB under it
    assert packed_weights_module.PACK_MIN_BYTES == 64 * 2**20


@needs_packing
def test_weights_are_packed_only_with_twice_their_size_free(monkeypatch, caplog):
    layer = big_linear(4096)
    size = 64 * 2**20
    caplog.set_level(logging.DEBUG, logger="comlrl.rollout.packed_weights")
    for available, expected in ((2 * size, 1), (2 * size - 1, 0)):
        monkeypatch.setattr(packed_weights_module.psutil, "virtual_memory",
                            lambda: SimpleNamespace(available=available))
        with torch.inference_mode(), packed_linears(layer, rows=2) as count:
            assert count == expected
    assert [record.getMessage() for record in caplog.records] == [
        "decode weights not packed: 64 MiB would leave too little memory free"]


@needs_packing
def test_a_packed_layer_adds_its_bias_and_restores_its_forward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    inputs, wide = torch.randn(3, 16), torch.randn(4, 16)

    def by_hand(x):
        return F.linear(F.linear(x, model[0].weight, model[0].bias).relu(), model[2].weight, model[2].bias)

    with torch.inference_mode():
        with packed_linears(model, rows=3, min_bytes=0) as count:
            assert count == 2 and "forward" in vars(model[0])
            packed = model(inputs)
            wider = model(wide)  # over the row count: the usual product
        torch.testing.assert_close(packed, by_hand(inputs), rtol=1e-5, atol=1e-6)
        assert torch.equal(wider, by_hand(wide))
    assert not any("forward" in vars(module) for module in model.modules())


@needs_packing
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
def test_a_weight_the_build_cannot_pack_leaves_every_layer_to_the_usual_product(caplog):
    """oneDNN refuses to pack a weight without rows (a linear layer of 0 outputs): no layer is packed, the model
    runs as it is, and the reason is logged."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 0))
    inputs = torch.randn(2, 8)
    caplog.set_level(logging.DEBUG, logger="comlrl.rollout.packed_weights")
    with torch.inference_mode(), packed_linears(model, rows=2, min_bytes=0) as count:
        assert count == 0 and not any("forward" in vars(module) for module in model)
        assert model(inputs).shape == (2, 0)
    with pytest.raises(RuntimeError) as refused:  # oneDNN's own words for that weight
        torch.ops.mkldnn._reorder_linear_weight(model[1].weight, 2)
    assert [record.getMessage() for record in caplog.records] == [
        f"decode weights not packed ({refused.value}); decoding with the usual matrix products"]
