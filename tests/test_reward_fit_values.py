"""The joint reward model's fit (comlrl/training/reward_fit.py) against numbers computed in the test: the first
epochs' losses from the Bradley-Terry loss and an AdamW step taken here, accuracy pair by pair, the result's
metrics written out, and what a fit without train pairs, without patience or with identical pairs reports."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn.functional as F

from comlrl.models.reward_model import JointRewardModel
from comlrl.rollout import preferences
from comlrl.training.reward_fit import RewardFitResult, fit_reward_model, patience_spent, preference_accuracy
from test_preference import marker_pairs


@pytest.fixture
def model(tiny_llama):
    torch.manual_seed(0)
    return JointRewardModel.load(tiny_llama, torch.device("cpu"), torch.float32)


def bradley_terry(model, pairs, indices):
    """Mean -log sigmoid(chosen - rejected), each pair scored on its own (batch of one)."""
    terms = []
    for index in indices:
        row = pairs[index]
        ids, mask = model.encode_joint([row["prompt"]] * 2, [row["chosen"], row["rejected"]])
        chosen, rejected = model(ids, mask)
        terms.append(-F.logsigmoid(chosen - rejected))
    return torch.stack(terms).mean()


def test_two_epochs_are_two_adamw_steps_on_the_bradley_terry_loss(model):
    pairs, train = marker_pairs(6), [0, 2, 3, 5]
    with torch.no_grad():
        model.value_head.layers[-1].weight.normal_(0.0, 0.5)  # a head that scores pairs apart: a loss other than log 2
    reference = copy.deepcopy(model)
    learning_rate = 2e-3
    result = fit_reward_model(model, pairs, train, [], epochs=2, batch_size=len(train), learning_rate=learning_rate,
                              seed=0)
    # One batch per epoch (the whole train set, in any order: the loss is a mean) and one optimizer step after it:
    # AdamW at this rate with weight decay 0.01, a constant schedule and no gradient clipping.
    optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=learning_rate,
                                  weight_decay=0.01)
    first = bradley_terry(reference, pairs, train)
    first.backward()
    optimizer.step()
    optimizer.zero_grad()
    second = bradley_terry(reference, pairs, train)
    second.backward()
    optimizer.step()  # the second epoch's step: the weights the fit ends with
    assert result.losses == pytest.approx([float(first), float(second)], rel=1e-3, abs=1e-6)
    assert result.losses[1] < result.losses[0] != pytest.approx(math.log(2))
    # The model keeps the last epoch's weights (no patience). The head's weight gradients are dense, so its first
    # Adam step (about lr x the gradient's sign) is the same here; near-zero gradients (embeddings of unused
    # tokens, the head's bias, which the loss's difference cancels) may flip sign between batchings.
    torch.testing.assert_close(model.value_head.layers[-1].weight, reference.value_head.layers[-1].weight, rtol=0,
                               atol=1e-5)
    assert result.best_epoch == 1 and result.heldout_curve == [] and result.heldout_accuracy is None
    assert (result.num_train_pairs, result.num_heldout_pairs) == (4, 0)


def test_accuracy_counts_pairs_scored_strictly_higher_whatever_the_batch(model):
    records = [dict(marker_pairs(7)[i]) for i in range(7)]
    for index in (1, 4):  # these pairs the other way round: the same head scores them the other way
        records[index]["chosen"], records[index]["rejected"] = records[index]["rejected"], records[index]["chosen"]
    pairs = preferences.pairs_dataset(records)
    with torch.no_grad():
        model.value_head.layers[-1].weight.normal_(0.0, 0.5)
    expected = []
    with torch.no_grad():
        for index in range(len(pairs)):
            row = pairs[index]
            ids, mask = model.encode_joint([row["prompt"]] * 2, [row["chosen"], row["rejected"]])
            chosen, rejected = model(ids, mask)
            expected.append(bool(chosen > rejected))
    assert 0 < sum(expected) < len(expected), "the test needs pairs either way"
    indices = [6, 0, 3, 1, 5]
    want = sum(expected[i] for i in indices) / len(indices)
    for batch_size in (1, 2, 5, 64):
        assert preference_accuracy(model, pairs, indices, batch_size) == pytest.approx(want)
    assert math.isnan(preference_accuracy(model, pairs, [], 4))


def test_the_fit_result_as_metrics():
    result = RewardFitResult(losses=[0.9, 0.4], train_accuracy=0.75, heldout_accuracy=0.5, num_train_pairs=12,
                             num_heldout_pairs=4, identical_pairs=1, heldout_curve=[0.25, 0.5], best_epoch=1)
    assert result.metrics() == {
        "reward_model/loss": 0.4, "reward_model/train_accuracy": 0.75, "reward_model/train_pairs": 12.0,
        "reward_model/heldout_pairs": 4.0, "reward_model/identical_pairs": 1.0, "reward_model/epochs": 2.0,
        "reward_model/best_epoch": 1.0, "reward_model/heldout_accuracy": 0.5}
    empty = RewardFitResult(losses=[], train_accuracy=float("nan"), heldout_accuracy=None, num_train_pairs=0,
                            num_heldout_pairs=0)
    metrics = empty.metrics()
    assert "reward_model/heldout_accuracy" not in metrics and math.isnan(metrics["reward_model/loss"])
    assert (metrics["reward_model/epochs"], metrics["reward_model/best_epoch"], metrics["reward_model/identical_pairs"]) \
        == (0.0, -1.0, 0.0)


def test_without_train_pairs_nothing_is_fitted_and_the_heldout_pairs_are_still_scored(model):
    pairs = marker_pairs(4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = fit_reward_model(model, pairs, [], [0, 1], epochs=3, batch_size=2, learning_rate=1e-2, seed=0, patience=1)
    assert result.losses == [] and result.best_epoch == -1 and result.heldout_curve == []
    assert math.isnan(result.train_accuracy) and result.heldout_accuracy == 0.0  # a zero head ties every pair
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_patience_judges_every_epoch_on_the_heldout_pairs_and_keeps_the_best(model):
    pairs = marker_pairs(24)
    train, heldout = preferences.split_heldout(len(pairs), 0.25, seed=0)
    result = fit_reward_model(model, pairs, train, heldout, epochs=3, batch_size=8, learning_rate=3e-3, seed=0,
                              patience=5)  # never runs out: every epoch is judged
    assert len(result.heldout_curve) == len(result.losses) == 3
    assert result.best_epoch == result.heldout_curve.index(max(result.heldout_curve))
    assert result.heldout_accuracy == pytest.approx(max(result.heldout_curve))
    assert result.num_train_pairs == len(train) and result.num_heldout_pairs == len(heldout)


def test_identical_pairs_are_counted_over_train_and_heldout_and_warned(model, caplog):
    records = [dict(marker_pairs(6)[i]) for i in range(6)]
    for index in (1, 4):  # chosen and rejected the same joint response
        records[index]["rejected"] = list(records[index]["chosen"])
    pairs = preferences.pairs_dataset(records)
    with caplog.at_level(logging.WARNING, logger="comlrl.training.reward_fit"):
        result = fit_reward_model(model, pairs, [0, 1, 2], [3, 4, 5], epochs=1, batch_size=2, learning_rate=1e-3,
                                  seed=0)
    assert result.identical_pairs == 2
    assert any("1 of 3 preference pairs encode chosen and rejected to identical ids" in r.message
               for r in caplog.records)


def test_the_fits_pair_order_comes_from_its_seed_alone(tiny_llama):
    pairs = marker_pairs(8)
    runs = []
    for global_seed in (1, 2):  # whatever the global RNG says, the seed decides the batches
        torch.manual_seed(0)
        model = JointRewardModel.load(tiny_llama, torch.device("cpu"), torch.float32)
        torch.manual_seed(global_seed)
        runs.append(fit_reward_model(model, pairs, list(range(8)), [], epochs=2, batch_size=3, learning_rate=1e-2,
                                     seed=5).losses)
    assert runs[0] == runs[1]


def test_an_epochs_loss_is_the_mean_of_its_batches(model):
    pairs = marker_pairs(6)
    with torch.no_grad():
        model.value_head.layers[-1].weight.normal_(0.0, 0.5)
        expected = float(bradley_terry(model, pairs, range(6)))
    # A rate so small that no batch moves the weights: every batch's loss is the initial model's, so the epoch's
    # mean over its three batches is the mean over all pairs, whatever their order.
    result = fit_reward_model(model, pairs, list(range(6)), [], epochs=1, batch_size=2, learning_rate=1e-12, seed=0)
    assert result.losses == pytest.approx([expected], rel=1e-4)


def test_without_patience_the_heldout_pairs_are_scored_once_and_the_last_epoch_is_kept(model):
    pairs = marker_pairs(8)
    result = fit_reward_model(model, pairs, [0, 1, 2, 3, 4, 5], [6, 7], epochs=2, batch_size=3, learning_rate=1e-2,
                              seed=0)
    assert result.heldout_curve == [] and result.best_epoch == 1 and len(result.losses) == 2
    assert result.heldout_accuracy == preference_accuracy(model, pairs, [6, 7], 2)


@pytest.mark.parametrize("epoch, best, patience, spent", [
    (4, 1, 3, True),    # three epochs after the best one without improving on it
    (3, 1, 3, False),   # two
    (2, 0, 2, True),
    (5, 5, 1, False),   # the best epoch itself
    (7, 2, 6, False),
])
def test_patience_is_counted_from_the_best_epoch(epoch, best, patience, spent):
    assert patience_spent(epoch, best, patience) is spent
