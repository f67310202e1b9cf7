"""One trainer update against the maths written out by hand (docs/algorithms.md).

Each test runs a real trainer's stages on tiny models (MAGRPO family: rollout -> reference ->
advantages -> update; MADPO: rollout -> select_pairs -> update) with fixed rewards, captures every
agent's gradient at its optimizer step (an optimizer step pre-hook; ``max_grad_norm=None``, so the
gradient is not clipped) and compares it with the gradient of the loss written out here, for every
loss type and KL mode, a second (off-policy) update pass, an accumulation window, the REINFORCE
variants' baselines, MADPO's joint coupling, and ``policy_losses`` itself over turns with the entropy
bonus (what IAC/MAAC use); advantages of a pruned multi-turn rollout are checked the same way. Token
log-probabilities from a plain forward of a fresh copy of the model on the recorded ids
(``log_softmax`` and ``gather``), then advantages, the k3 KL, the clipped ratio, the loss
normalisation and the joint DPO coupling in a few lines of torch. Nothing of comlrl's maths
(``comlrl.algorithms``, ``comlrl.training``) is called on the expected side.

Completion lengths are set by hand (the completion masks of the sampled rollout are cut to the lengths in
``LENGTHS``): a random tiny model rarely samples EOS, and with equal lengths the loss types coincide.

Tolerance. Both sides run the same float32 forward on the same ids, summed in a different order (the
library keeps only the completion logits); measured, the gradients agree to a relative distance (norm of
the difference over the larger norm, all parameters together) below 1e-6. ``RTOL = 1e-4`` leaves two orders
of magnitude for other CPUs and BLAS builds. Each test also checks that the wrong maths it stands against
(another loss type, ratio 1 on the second pass, no KL term, independent per-agent DPO) would be more than
``SEPARATION`` (10 x RTOL) away, so a pass is not a near miss (measured: 7.7e-3 at the least, in a matrix
cell whose window holds one off-policy pass of three; 4e-2 and more here).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.trainers.preference import MADPOConfig, MADPOTrainer
from comlrl.trainers.reinforce import (MAGRPOConfig, MAGRPOTrainer, MAREINFORCEConfig, MAREINFORCETrainer,
                                       MAReMaxConfig, MAReMaxTrainer, MARLOOConfig, MARLOOTrainer)

RTOL = 1e-4
SEPARATION = 10 * RTOL
# Two prompts of different token lengths (the shorter is left-padded), 4 samples each.
ROWS = [{"prompt": "write about the cat"}, {"prompt": "write a long story about the river and the hill"}]
NUM_GENERATIONS = 4
MAX_NEW_TOKENS = 6
# Joint rewards per prompt (one row per prompt, one column per joint sample): distinct, so every baseline differs.
REWARDS = torch.tensor([[0.1, 0.4, 0.2, 0.9], [0.5, 0.5, 0.3, 0.0]])
# Completion lengths per agent and generation row (prompt p, sample g: row p * 4 + g).
LENGTHS = [[6, 1, 3, 4, 2, 5, 6, 3], [2, 6, 5, 1, 4, 4, 3, 6]]
TEMPERATURE = 0.8
KL_COEF = 0.2


# ----- the expected side: plain torch --------------------------------------------------------------------
def model_at(source, parameters: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A fresh copy of the model (loaded from a directory, or a deep copy of a module kept from before training)
    with the given values of its trained parameters, in eval mode (no dropout)."""
    model = (AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32) if isinstance(source, str)
             else copy.deepcopy(source))
    model.eval()
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in parameters.items():
            named[name].copy_(value)
    return model


def token_logprobs(model: torch.nn.Module, generation, temperature: float) -> torch.Tensor:
    """log pi(o_t | prompt, o_<t) of every completion token, ``[rows, tokens]``: one forward over prompt +
    completion (positions skip the prompts' left padding), the logits before each completion token over the
    temperature, log_softmax, gather."""
    ids = torch.cat([generation.prompt_ids, generation.completion_ids], dim=1)
    mask = torch.cat([generation.prompt_mask, generation.completion_mask.to(generation.prompt_mask.dtype)], dim=1)
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    prompt_length, completion_length = generation.prompt_ids.shape[1], generation.completion_ids.shape[1]
    before_each = logits[:, prompt_length - 1:prompt_length + completion_length - 1].float() / temperature
    return torch.log_softmax(before_each, dim=-1).gather(-1, generation.completion_ids.unsqueeze(-1)).squeeze(-1)


def k3(policy: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 per token: exp(d) - d - 1 with d = log pi_ref - log pi."""
    d = reference - policy
    return torch.exp(d) - d - 1


def advantages_by_hand(returns: list[list[float]], mode: str, normalize: bool) -> torch.Tensor:
    """A_i = R_i - b_i per group (docs/algorithms.md's table), over the group's sample std when normalising;
    flattened to generation rows (aligned joints: row p * G + g is joint sample g of prompt p)."""
    out = []
    for group in returns:
        n = len(group)
        mean = sum(group) / n
        if mode == "mean":
            baselines = [mean] * n
        elif mode == "raw":
            baselines = [0.0] * n
        elif mode == "max":
            baselines = [max(group)] * n
        else:  # rloo
            baselines = [(sum(group) - r) / (n - 1) for r in group]
        values = [r - b for r, b in zip(group, baselines)]
        if normalize:
            std = (sum((r - mean) ** 2 for r in group) / (n - 1)) ** 0.5
            if std > 1e-6:
                values = [v / (std + 1e-6) for v in values]
        out += values
    return torch.tensor(out)


def reduce_by_loss_type(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_new_tokens: int) -> torch.Tensor:
    """docs/algorithms.md, "Loss normalisation": over an agent's N completions o_i."""
    mask = mask.float()
    lengths = mask.sum(dim=1)
    summed = (per_token * mask).sum(dim=1)
    if loss_type == "grpo":
        return (summed / lengths).mean()
    if loss_type in ("bnpo", "dapo"):
        return summed.sum() / lengths.sum()
    assert loss_type == "dr_grpo"
    return summed.sum() / (per_token.shape[0] * max_new_tokens)


def gradient(loss: torch.Tensor, model: torch.nn.Module, keep_graph: bool = False) -> dict[str, torch.Tensor]:
    """d loss / d every trained parameter (those that require gradients), by name."""
    names, parameters = zip(*((n, p) for n, p in model.named_parameters() if p.requires_grad))
    return dict(zip(names, torch.autograd.grad(loss, parameters, retain_graph=keep_graph)))


def relative_distance(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """||actual - expected|| over the larger of their norms, all parameters together (0 when both are 0)."""
    assert actual.keys() == expected.keys()

    def norm(tensors) -> float:
        return sum(float(t.double().pow(2).sum()) for t in tensors) ** 0.5

    larger = max(norm(actual.values()), norm(expected.values()))
    return norm(actual[k] - expected[k] for k in expected) / larger if larger > 0 else 0.0


def assert_gradient_matches(actual, expected, wrong: dict[str, dict[str, torch.Tensor]]) -> None:
    distance = relative_distance(actual, expected)
    assert distance < RTOL, f"the update's gradient is {distance:.2e} (relative) from the maths"
    for what, gradient_if_wrong in wrong.items():  # (a zero gradient is right only if no wrong one is zero too)
        apart = relative_distance(gradient_if_wrong, expected)
        assert apart > SEPARATION, f"{what} is only {apart:.2e} from the right gradient: the test cannot tell them apart"


# ----- the trainer side --------------------------------------------------------------------------------
@dataclasses.dataclass
class Step:
    """One optimizer step of one agent: its trained parameters before the step, the gradient the optimizer
    applies (after data-parallel averaging and clipping) and the gradient the backward passes accumulated."""

    parameters: dict[str, torch.Tensor]
    applied: dict[str, torch.Tensor]
    accumulated: dict[str, torch.Tensor]


class OptimizerSteps:
    """Every optimizer step of each agent (:class:`Step`): a hook after each gradient accumulation into a trained
    parameter keeps its ``.grad`` (so the last one before a step is the window's unclipped sum), an optimizer step
    pre-hook the parameters and the gradient about to be applied."""

    def __init__(self, trainer) -> None:
        self.steps: list[list[Step]] = [[] for _ in trainer.agents]
        for index, agent in enumerate(trainer.agents):
            trained = {n: p for n, p in agent.named_parameters() if p.requires_grad}
            accumulated: dict[str, torch.Tensor] = {}
            for name, parameter in trained.items():
                parameter.register_post_accumulate_grad_hook(
                    lambda p, name=name, seen=accumulated: seen.__setitem__(name, p.grad.detach().clone()))
            optimizer = trainer.model_optimizers[f"agent_{index}"].optimizer
            optimizer.register_step_pre_hook(
                lambda opt, args, kwargs, trained=trained, seen=accumulated, log=self.steps[index]:
                self.record(trained, seen, log))

    @staticmethod
    def record(trained: dict[str, torch.Tensor], accumulated: dict[str, torch.Tensor], log: list[Step]) -> None:
        zeros = {n: torch.zeros_like(p) for n, p in trained.items()}
        log.append(Step({n: p.detach().clone() for n, p in trained.items()},
                        {n: p.grad.detach().clone() if p.grad is not None else zeros[n] for n, p in trained.items()},
                        {n: accumulated.get(n, zeros[n]) for n in trained}))
        accumulated.clear()


def cut_to_lengths(rollout) -> None:
    """Every agent's completions end after LENGTHS[agent][row] tokens (as if EOS came there)."""
    turn = rollout.turns[0]
    for agent, generation in enumerate(turn.generations):
        width = generation.completion_ids.shape[1]
        lengths = torch.tensor(LENGTHS[agent]).clamp(max=width)
        mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(generation.completion_mask.dtype)
        turn.generations[agent] = dataclasses.replace(generation, completion_mask=mask)


@pytest.fixture(scope="module")
def perturbed_reference(tiny_llama, tmp_path_factory) -> str:
    """tiny_llama with every weight moved by N(0, 0.02^2) noise (seeded): a reference policy whose KL to the
    initial policy is not 0 at the first step, so the KL terms reach the gradient."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
    directory = tmp_path_factory.mktemp("models") / "tiny-llama-reference"
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(directory)
    return str(directory)


FAMILY = {"mean": (MAGRPOTrainer, MAGRPOConfig), "raw": (MAREINFORCETrainer, MAREINFORCEConfig),
          "max": (MAReMaxTrainer, MAReMaxConfig), "rloo": (MARLOOTrainer, MARLOOConfig)}


def build_family(model_dir: str, mode: str = "mean", **options):
    trainer_class, config_class = FAMILY[mode]
    args = config_class(num_agents=2, num_generations=NUM_GENERATIONS, max_new_tokens=MAX_NEW_TOKENS,
                        temperature=TEMPERATURE, top_p=1.0, top_k=None, max_grad_norm=None,
                        per_device_train_batch_size=2, num_train_epochs=1, seed=7, disable_tqdm=True, **options)
    return trainer_class(agent_model=model_dir, reward_func=lambda completions_0, completions_1: [0.0] * len(completions_0),
                         train_dataset=Dataset.from_list(ROWS), args=args)


def family_update(trainer):
    """The stages of one step with the fixed rewards and lengths; returns what the expected side needs."""
    rollout = trainer.rollout(ROWS)
    cut_to_lengths(rollout)
    reference = trainer.reference(rollout)
    advantages = trainer.advantages([REWARDS.clone()], reference, rollout)
    recorded = OptimizerSteps(trainer)
    trainer.update(rollout, advantages, reference)
    return rollout, advantages, recorded.steps


class FamilyMaths:
    """The expected side of one agent's update on one rollout batch of a MAGRPO-family trainer.

    ``source`` is the model (a directory, or a module from before training), ``generation`` the agent's
    completions, ``rewards`` the batch's joint rewards ``[prompts, joint samples]`` (aligned joints),
    ``behaviour`` the trained parameters that sampled them, ``reference`` the frozen reference model or None.
    """

    def __init__(self, source, generation, rewards: torch.Tensor, behaviour: dict, args,
                 reference: torch.nn.Module | None = None) -> None:
        self.source, self.generation, self.rewards, self.args = source, generation, rewards, args
        with torch.no_grad():
            self.behaviour = token_logprobs(model_at(source, behaviour), generation, args.temperature)
            self.reference = token_logprobs(reference, generation, args.temperature) if reference is not None else None
        self.mask = generation.completion_mask.float()

    def completion_kl(self) -> torch.Tensor:
        """Each completion's KL to the reference: the sum of its tokens' k3 under the sampling policy."""
        return (k3(self.behaviour, self.reference) * self.mask).sum(dim=1)

    def advantages(self, shaped: bool | None = None) -> torch.Tensor:
        """The joint rewards -> advantages; shaped (by default under reference_kl_mode='reward') by this agent's
        coef x KL of the completion it put in each joint sample."""
        args = self.args
        if shaped is None:
            shaped = args.reference_kl_enabled and args.reference_kl_mode == "reward"
        rewards = self.rewards.clone().float()
        if shaped:
            rewards = rewards - args.reference_kl_coef * self.completion_kl().reshape(rewards.shape)
        return advantages_by_hand(rewards.tolist(), args.advantage_mode, args.normalize_advantages)

    def loss(self, model: torch.nn.Module, advantages: torch.Tensor, loss_type: str | None = None,
             kl_loss: bool | None = None, clip: bool = True, ratio_one: bool = False) -> torch.Tensor:
        """The clipped surrogate under ``model`` (plus coef x k3 per token with ``kl_loss``, by default under
        reference_kl_mode='loss'), reduced by ``loss_type``, with ratio pi / pi_old where pi_old is the sampling
        policy (``ratio_one``: the current policy, detached, as if the behaviour log-probabilities were ignored)."""
        args = self.args
        if kl_loss is None:
            kl_loss = args.reference_kl_enabled and args.reference_kl_mode == "loss"
        logprobs = token_logprobs(model, self.generation, args.temperature)
        ratio = torch.exp(logprobs - (logprobs.detach() if ratio_one else self.behaviour))
        eps = args.clip_epsilon
        a = advantages.unsqueeze(1)
        per_token = -torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a) if clip else -ratio * a
        if kl_loss:
            per_token = per_token + args.reference_kl_coef * k3(logprobs, self.reference)
        return reduce_by_loss_type(per_token, self.mask, loss_type or args.loss_type, args.max_new_tokens)

    def gradient(self, parameters: dict, advantages: torch.Tensor, **options) -> dict[str, torch.Tensor]:
        """d :meth:`loss` / d the trained parameters, at ``parameters``."""
        model = model_at(self.source, parameters)
        return gradient(self.loss(model, advantages, **options), model)


LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
KL_MODES = ("off", "reward", "loss")


def reference_model(kl: str, reference_dir: str) -> torch.nn.Module | None:
    return None if kl == "off" else AutoModelForCausalLM.from_pretrained(reference_dir).eval()


def kl_options(kl: str, reference_dir: str) -> dict:
    if kl == "off":
        return {}
    return dict(reference_kl_enabled=True, reference_kl_mode=kl, reference_kl_coef=KL_COEF,
                reference_model=reference_dir)


@pytest.mark.parametrize("kl", KL_MODES, ids=[f"kl_{k}" for k in KL_MODES])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_magrpo_update_is_the_loss_type_by_hand(loss_type, kl, tiny_llama, perturbed_reference):
    """One MAGRPO update per loss type and KL mode: each agent's gradient is that of
    sum_i sum_t l_it / normaliser (docs' table), with the KL shaping the rewards or added per token."""
    trainer = build_family(tiny_llama, loss_type=loss_type, agent_learning_rate=1e-3, **kl_options(kl, perturbed_reference))
    rollout, advantages, steps = family_update(trainer)
    for agent in range(2):
        [step] = steps[agent]
        initial, actual = step.parameters, step.applied
        maths = FamilyMaths(tiny_llama, rollout.turns[0].generations[agent], REWARDS, initial, trainer.args,
                            reference_model(kl, perturbed_reference))
        expected_advantages = maths.advantages()
        torch.testing.assert_close(advantages[agent][0], expected_advantages, rtol=1e-5, atol=1e-6)
        expected = {t: maths.gradient(initial, expected_advantages, loss_type=t) for t in LOSS_TYPES}
        same = {"bnpo", "dapo"} if loss_type in ("bnpo", "dapo") else {loss_type}  # bnpo and dapo: one formula
        wrong = {f"loss_type={t!r}": expected[t] for t in LOSS_TYPES if t not in same}
        if kl == "reward":  # the shaping must be there, and per agent
            wrong["no KL shaping"] = maths.gradient(initial, maths.advantages(shaped=False))
        if kl == "loss":
            wrong["no KL term"] = maths.gradient(initial, expected_advantages, kl_loss=False)
        assert_gradient_matches(actual, expected[loss_type], wrong)


@pytest.mark.parametrize("mode", ["raw", "max", "rloo"])
def test_reinforce_variants_update_on_their_own_baselines(mode, tiny_llama):
    """MAREINFORCE / MAReMax / MARLOO: the update's gradient is the surrogate's with A = R - b, b the mode's
    baseline (docs' table), not normalised by default; MAGRPO's group-mean advantages would give another one."""
    trainer = build_family(tiny_llama, mode, agent_learning_rate=1e-3)
    rollout, advantages, steps = family_update(trainer)
    for agent in range(2):
        [step] = steps[agent]
        maths = FamilyMaths(tiny_llama, rollout.turns[0].generations[agent], REWARDS, step.parameters, trainer.args)
        expected_advantages = maths.advantages()
        torch.testing.assert_close(advantages[agent][0], expected_advantages, rtol=1e-5, atol=1e-6)
        group_mean = advantages_by_hand(REWARDS.tolist(), "mean", False)
        assert_gradient_matches(step.applied, maths.gradient(step.parameters, expected_advantages),
                                {"the group-mean baseline": maths.gradient(step.parameters, group_mean)})


@pytest.mark.parametrize("loss_type, kl", [("grpo", "off"), ("bnpo", "reward"), ("dr_grpo", "loss")],
                         ids=["grpo-kl_off", "bnpo-kl_reward", "dr_grpo-kl_loss"])
def test_second_update_pass_uses_the_behaviour_logprobs(loss_type, kl, tiny_llama, perturbed_reference):
    """policy_update_epochs=2 (each pass one optimizer step): the first pass has ratio 1; the second runs at the
    stepped weights with pi_old the sampling policy's log-probabilities, so its ratios leave 1 and the clip acts
    (tokens past 1 +- eps in the advantage's direction get no gradient from the surrogate)."""
    trainer = build_family(tiny_llama, loss_type=loss_type, policy_update_epochs=2, agent_learning_rate=1e-2,
                           clip_epsilon=0.2, **kl_options(kl, perturbed_reference))
    rollout, advantages, steps = family_update(trainer)
    for agent in range(2):
        [(initial, first), (stepped, second)] = [(step.parameters, step.applied) for step in steps[agent]]
        maths = FamilyMaths(tiny_llama, rollout.turns[0].generations[agent], REWARDS, initial, trainer.args,
                            reference_model(kl, perturbed_reference))
        expected_advantages = maths.advantages()
        torch.testing.assert_close(advantages[agent][0], expected_advantages, rtol=1e-5, atol=1e-6)
        assert_gradient_matches(first, maths.gradient(initial, expected_advantages), {})

        with torch.no_grad():
            current = token_logprobs(model_at(tiny_llama, stepped), maths.generation, TEMPERATURE)
        ratio = torch.exp(current - maths.behaviour)[maths.mask.bool()]
        signs = expected_advantages.unsqueeze(1).expand_as(maths.mask)[maths.mask.bool()].sign()
        eps = trainer.args.clip_epsilon
        clipped = ((signs > 0) & (ratio > 1 + eps)) | ((signs < 0) & (ratio < 1 - eps))
        assert clipped.any() and (~clipped).any(), ratio  # some tokens clipped, some not
        assert_gradient_matches(second, maths.gradient(stepped, expected_advantages), {
            "ratio 1 (pi_old = the current policy)": maths.gradient(stepped, expected_advantages, ratio_one=True),
            "no clipping": maths.gradient(stepped, expected_advantages, clip=False),
        })


# ----- MADPO -----------------------------------------------------------------------------------------------
def pairs_by_hand(rewards: list[float], keep: int) -> set[tuple[int, int]]:
    """The ``keep`` ordered pairs (w, l) with the widest reward gaps R_w - R_l > 0 (no ties at the cut here)."""
    gaps = sorted(((rewards[w] - rewards[l], w, l) for w in range(len(rewards)) for l in range(len(rewards))
                   if rewards[w] > rewards[l]), reverse=True)
    return {(w, l) for _, w, l in gaps[:keep]}


@pytest.mark.parametrize("reference, accumulation", [("none", 1), ("model", 1), ("model", 2)],
                         ids=["no_reference", "reference_model", "reference_model-acc2"])
def test_madpo_update_is_the_joint_dpo_loss_by_hand(reference, accumulation, tiny_llama, perturbed_reference):
    """Agent a's gradient is that of mean_p -log sigmoid(beta (delta_a + sum_{b != a} sg(delta_b))), with
    delta = [log pi(y_w) - log pi_ref(y_w)] - [log pi(y_l) - log pi_ref(y_l)] over sequence log-probabilities at
    temperature 1 (not the sampling temperature). Without a reference, or with one other than the initial
    weights, the other agents' delta is not 0 at the first step, so independent per-agent DPO differs. With
    accumulation 2 the same pairs twice make one window, whose step applies their mean: that gradient again."""
    options = dict(dpo_reference="none") if reference == "none" else dict(reference_model=perturbed_reference)
    options["gradient_accumulation_steps"] = accumulation
    args = MADPOConfig(num_agents=2, num_generations=NUM_GENERATIONS, max_new_tokens=MAX_NEW_TOKENS,
                       temperature=TEMPERATURE, top_p=1.0, top_k=None, agent_learning_rate=1e-3, max_grad_norm=None,
                       per_device_train_batch_size=2, num_train_epochs=1, dpo_beta=0.5, max_pairs_per_prompt=3,
                       pair_selection="reward_gap", seed=7, disable_tqdm=True, **options)
    trainer = MADPOTrainer(agent_model=tiny_llama, reward_func=lambda completions_0, completions_1: [0.0] * len(completions_0),
                           train_dataset=Dataset.from_list(ROWS), args=args)
    rollout = trainer.rollout(ROWS)
    cut_to_lengths(rollout)
    pairs = trainer.select_pairs([REWARDS.clone()])
    hand_pairs = [pairs_by_hand(group, 3) for group in REWARDS.tolist()]
    assert [{(p.chosen, p.rejected) for p in kept} for kept in pairs] == hand_pairs
    initial = [{n: p.detach().clone() for n, p in agent.named_parameters()} for agent in trainer.agents]
    recorded = OptimizerSteps(trainer)
    for _ in range(accumulation):  # with accumulation 2 the same pairs twice: one window, at the initial weights
        trainer.update(rollout, pairs)
    applied = [steps[0].applied for steps in recorded.steps]

    # Rows of the pairs' chosen and rejected completions (aligned joints: joint sample g is row p * G + g).
    chosen = torch.tensor([p * NUM_GENERATIONS + w for p, kept in enumerate(hand_pairs) for w, _ in sorted(kept)])
    rejected = torch.tensor([p * NUM_GENERATIONS + l for p, kept in enumerate(hand_pairs) for _, l in sorted(kept)])
    generations = rollout.turns[0].generations
    models, deltas = [], []
    for agent in range(2):
        model = model_at(tiny_llama, initial[agent])
        mask = generations[agent].completion_mask.float()
        sequence = (token_logprobs(model, generations[agent], 1.0) * mask).sum(dim=1)
        if reference == "model":
            with torch.no_grad():
                reference_model = AutoModelForCausalLM.from_pretrained(perturbed_reference).eval()
                reference_sequence = (token_logprobs(reference_model, generations[agent], 1.0) * mask).sum(dim=1)
            sequence = sequence - reference_sequence
        models.append(model)
        deltas.append(sequence[chosen] - sequence[rejected])
    beta = args.dpo_beta
    for agent in range(2):
        other = deltas[1 - agent].detach()
        joint_loss = -torch.nn.functional.logsigmoid(beta * (deltas[agent] + other)).mean()
        independent_loss = -torch.nn.functional.logsigmoid(beta * deltas[agent]).mean()
        expected = gradient(joint_loss, models[agent], keep_graph=True)
        wrong = {"independent per-agent DPO": gradient(independent_loss, models[agent])}
        if accumulation > 1:
            wrong["the micro-batches' sum"] = {n: accumulation * g for n, g in expected.items()}
        assert_gradient_matches(applied[agent], expected, wrong)


# ----- gradient accumulation ---------------------------------------------------------------------------------
def test_a_window_of_update_passes_applies_their_mean_gradient(tiny_llama):
    """policy_update_epochs=2 with gradient_accumulation_steps=2: both passes are micro-batches of one window,
    run at the sampling weights (ratio 1) over the same completions, and the one step applies their mean: the
    gradient of one pass (not their sum)."""
    trainer = build_family(tiny_llama, loss_type="dapo", policy_update_epochs=2, gradient_accumulation_steps=2,
                           agent_learning_rate=1e-3)
    initial = [{n: p.detach().clone() for n, p in agent.named_parameters()} for agent in trainer.agents]
    rollout, _, steps = family_update(trainer)
    for agent in range(2):
        [step] = steps[agent]
        maths = FamilyMaths(tiny_llama, rollout.turns[0].generations[agent], REWARDS, initial[agent], trainer.args)
        expected = maths.gradient(initial[agent], maths.advantages())
        assert_gradient_matches(step.applied, expected, {"the passes' sum": {n: 2 * g for n, g in expected.items()}})


# ----- policy_losses itself: several turns, the entropy bonus, given counts ------------------------------------
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_policy_losses_over_turns_with_entropy_and_given_counts(loss_type, tiny_llama, perturbed_reference):
    """comlrl.training.policy_update.policy_losses (what IAC/MAAC and MAGRPO call) over two turns (here: the two
    prompts' completions as two generations): the turns' losses sum to the surrogate normalised over all turns'
    completions, less entropy_coef x the sum over completions of each one's mean token entropy over the
    completion count (of the
    sampling distribution, logits / temperature). ``counts`` replaces the completion and token counts of both
    normalisers; reference log-probabilities without a kl_coef add nothing."""
    from comlrl.training.policy_update import policy_losses

    trainer = build_family(tiny_llama, loss_type=loss_type)
    rollout = trainer.rollout(ROWS)
    cut_to_lengths(rollout)
    whole = rollout.turns[0].generations[0]
    turns = [dataclasses.replace(whole, **{key: getattr(whole, key)[rows] for key in
                                           ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")})
             for rows in (slice(0, 4), slice(4, 8))]
    advantages = advantages_by_hand(REWARDS.tolist(), "mean", True)
    parameters = {n: p.detach().clone() for n, p in trainer.agents[0].named_parameters()}
    entropy_coef, counts = 0.3, (16.0, 2.0 * float(whole.completion_mask.sum()))
    with torch.no_grad():
        reference = [token_logprobs(AutoModelForCausalLM.from_pretrained(perturbed_reference).eval(), turn, TEMPERATURE)
                     for turn in turns]

    model = model_at(tiny_llama, parameters)
    losses = policy_losses(model, turns, [advantages[:4], advantages[4:]], 0.2, TEMPERATURE, entropy_coef=entropy_coef,
                           loss_type=loss_type, max_completion_length=MAX_NEW_TOKENS, reference_logprobs=reference,
                           counts=counts)
    actual = gradient(sum(losses), model)

    hand = model_at(tiny_llama, parameters)
    ids = torch.cat([whole.prompt_ids, whole.completion_ids], dim=1)
    mask = torch.cat([whole.prompt_mask, whole.completion_mask.to(whole.prompt_mask.dtype)], dim=1)
    logits = hand(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0)).logits
    width = whole.prompt_ids.shape[1]
    log_p = torch.log_softmax(logits[:, width - 1:-1].float() / TEMPERATURE, dim=-1)
    logprobs = log_p.gather(-1, whole.completion_ids.unsqueeze(-1)).squeeze(-1)
    completion_mask = whole.completion_mask.float()
    per_token = -logprobs.exp() / logprobs.exp().detach() * advantages.unsqueeze(1)  # ratio 1, clip inactive
    summed = (per_token * completion_mask).sum(dim=1)
    lengths = completion_mask.sum(dim=1)
    # the normaliser from the given counts: 16 completions (grpo) or twice the tokens (dapo)
    surrogate = (summed / lengths).sum() / counts[0] if loss_type == "grpo" else summed.sum() / counts[1]
    entropy = -(log_p.exp() * log_p).sum(dim=-1)
    # each completion's mean token entropy, summed and divided by the same completion count (under data
    # parallelism the processes' mean: their average is then the mean over every completion)
    entropy_term = ((entropy * completion_mask).sum(dim=1) / lengths).sum() / counts[0]
    expected = gradient(surrogate - entropy_coef * entropy_term, hand, keep_graph=True)
    own_counts = 2 * (surrogate - entropy_coef * entropy_term)  # the completions' own counts: half the given ones
    assert_gradient_matches(actual, expected, {
        "no entropy bonus": gradient(surrogate, hand, keep_graph=True),
        "the completions' own counts": gradient(own_counts, hand, keep_graph=True)})
    # a KL coefficient without reference log-probabilities adds nothing either
    without_reference = gradient(sum(policy_losses(model, turns, [advantages[:4], advantages[4:]], 0.2, TEMPERATURE,
                                                   loss_type=loss_type, max_completion_length=MAX_NEW_TOKENS,
                                                   kl_coef=0.5, counts=counts)), model)
    assert_gradient_matches(without_reference, gradient(surrogate, hand), {})


def test_the_entropy_bonus_reads_the_same_forward_under_mixed_precision(tiny_llama):
    """With autocast (precision='bf16-mixed') the entropy path's forward runs under the same autocast as the plain
    one: a vanishing entropy_coef leaves the gradient as it is (a forward in float32 would move it by the bf16
    rounding: 5e-3 measured)."""
    from comlrl.training.policy_update import policy_losses

    trainer = build_family(tiny_llama)
    rollout = trainer.rollout(ROWS)
    cut_to_lengths(rollout)
    generation = rollout.turns[0].generations[0]
    advantages = advantages_by_hand(REWARDS.tolist(), "mean", True)
    model = trainer.agents[0]
    gradients = [gradient(sum(policy_losses(model, [generation], [advantages], 0.2, TEMPERATURE, entropy_coef=coef,
                                            autocast_dtype=torch.bfloat16)), model) for coef in (0.0, 1e-12)]
    assert relative_distance(gradients[1], gradients[0]) < 1e-6


def test_first_of_several_passes_is_the_on_policy_step_under_mixed_precision(tiny_llama):
    """precision='bf16-mixed': the behaviour log-probabilities and the update's forward run under the same
    autocast, so the first of two passes has ratio 1 exactly and takes the one-pass trainer's gradient. Both
    trainers run the same float operations (measured: bit-identical gradients), hence the tight 1e-6; a pass
    whose behaviour or update forward left the autocast is 9e-4 or more away."""
    one, two = (build_family(tiny_llama, precision="bf16-mixed", policy_update_epochs=passes, agent_learning_rate=1e-3)
                for passes in (1, 2))
    rollout = one.rollout(ROWS)
    cut_to_lengths(rollout)
    steps = []
    for trainer in (one, two):
        recorded = OptimizerSteps(trainer)
        trainer.update(rollout, trainer.advantages([REWARDS.clone()]), None)
        steps.append(recorded.steps)
    for agent in range(2):
        assert relative_distance(steps[1][agent][0].applied, steps[0][agent][0].applied) < 1e-6


# ----- advantages of a pruned multi-turn rollout ------------------------------------------------------------------
@pytest.mark.parametrize("kl", ["off", "reward"], ids=["kl_off", "kl_reward"])
def test_advantages_of_a_pruned_multi_turn_rollout_by_hand(kl, tiny_llama, perturbed_reference):
    """Two turns, early termination: the 'cat' prompt's node (mean reward 1 > 0.5) spawns nothing, the other's two
    joint samples spawn turn 2's two nodes. Returns: an ended sample's reward; otherwise reward + discount x the
    mean return of its child node; then each node's mean baseline. With the KL as reward shaping each agent's
    rewards at every turn are first less coef x the KL of its own completion."""
    def reward(completions_0, completions_1, batch_items):
        return [1.0 if "cat" in item["prompt"] else 0.0 for item in batch_items]

    options = kl_options(kl, perturbed_reference)
    args = MAGRPOConfig(num_agents=2, num_turns=2, num_generations=2, max_new_tokens=4, temperature=TEMPERATURE,
                        top_p=1.0, top_k=None, discount=0.5, normalize_advantages=False,
                        early_termination_threshold=0.5, disable_tqdm=True, **options)
    trainer = MAGRPOTrainer(agent_model=tiny_llama, reward_func=reward, train_dataset=Dataset.from_list(ROWS),
                            external_transition=lambda prompt, agent_completions, num_agents, **_: ["go on"] * num_agents,
                            args=args)
    rows = [{"prompt": "write about the cat"}, {"prompt": "write about the sun"}]
    rollout = trainer.rollout(rows)
    assert [turn.num_nodes for turn in rollout.turns] == [2, 2] and rollout.turns[1].parents == [2, 3]
    rewards = [torch.tensor([[0.2, 0.6], [0.0, 1.0]]), torch.tensor([[1.0, 3.0], [0.0, 2.0]])]
    reference = trainer.reference(rollout)
    advantages = trainer.advantages(rewards, reference, rollout)

    initial = {n: p.detach().clone() for n, p in trainer.agents[0].named_parameters()}  # both agents start equal
    for agent in range(2):
        shaped = [r.clone() for r in rewards]
        if kl == "reward":
            for turn, turn_rewards in enumerate(shaped):
                maths = FamilyMaths(tiny_llama, rollout.turns[turn].generations[agent], turn_rewards, initial, args,
                                    reference_model(kl, perturbed_reference))
                shaped[turn] = turn_rewards - KL_COEF * maths.completion_kl().reshape(turn_rewards.shape)
        late, early = shaped[1].tolist(), shaped[0].tolist()
        returns_0 = [early[0], [early[1][j] + 0.5 * sum(late[j]) / 2 for j in range(2)]]  # node 0 ended
        expected_0 = [r - sum(node) / 2 for node in returns_0 for r in node]
        expected_1 = [r - sum(node) / 2 for node in late for r in node]
        assert advantages[agent][0].tolist() == pytest.approx(expected_0, abs=1e-5), agent
        assert advantages[agent][1].tolist() == pytest.approx(expected_1, abs=1e-5), agent
    if kl == "reward":  # the shaping reached the advantages (agents' completions differ, so do their KLs)
        assert advantages[0][0].tolist() != pytest.approx([-0.2, 0.2, -0.25, 0.25], abs=1e-3)


def test_backpropagate_scales_each_loss_and_returns_their_sum():
    from comlrl.training.policy_update import backpropagate

    weight = torch.tensor(2.0, requires_grad=True)
    total = backpropagate([3 * weight, weight ** 2], scale=0.5)
    assert total == pytest.approx(6.0 + 4.0)
    assert weight.grad.item() == pytest.approx(0.5 * (3 + 2 * 2.0))
    weight.grad = None
    assert backpropagate([3 * weight]) == pytest.approx(6.0) and weight.grad.item() == pytest.approx(3.0)  # scale 1
