"""The trainer configs as a user meets them: the values a config resolves to and each refusal word for word.

Every expected value and message is written out here (read from the user guide, docs/migrating.md and
comlrl 1.4.3's behaviour), never taken from the config under test. A refusal is compared whole: a config
that finds several problems names them all, in order, joined by "; ".
"""

from __future__ import annotations

import os
import types
import warnings

import pytest

from comlrl.algorithms.kl import TruncatedSamplingKLWarning
from comlrl.rollout.reward_calls import RewardCallPolicy
from comlrl.trainers import (
    CentralizedMAGRPOConfig,
    IACConfig,
    MAACConfig,
    MADPOConfig,
    MADPOIterConfig,
    MAGRPOConfig,
    MAREINFORCEConfig,
    MAReMaxConfig,
    MARLHFConfig,
    MARLHFIterConfig,
    MARLOOConfig,
)
from comlrl.trainers.actor_critic.config import ActorCriticConfig
from comlrl.trainers.config import original_parallel_training, reward_call_policy
from comlrl.trainers.preference.iterative_config import IterativeOptions, defaults, normalise_values, options_of


def refusal(config_class, **values) -> str:
    """The whole message of the ValueError that constructing ``config_class(**values)`` raises."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TruncatedSamplingKLWarning)
        with pytest.raises(ValueError) as error:
            config_class(**values)
    return str(error.value)


# ----- the shared fields (RolloutConfig) ------------------------------------------------------------------

@pytest.mark.parametrize("given, read", [
    (None, "none"), ("none", "none"), (" MP ", "mp"), ("Mp", "mp"), ("null", "none"), (" NULL ", "none"),
    ("None", "none"), (3, 3), (["mp"], ["mp"]),
])
def test_parallel_training_is_read_as_the_original_reads_it(given, read):
    assert original_parallel_training(given) == read


def test_parallel_training_spellings_construct_and_others_are_refused_in_the_originals_words():
    assert MAGRPOConfig(parallel_training=" Mp ", device="cpu").parallel_training == "mp"
    assert MAGRPOConfig(parallel_training=None).parallel_training == "none"
    assert MAGRPOConfig(parallel_training="Null").parallel_training == "none"
    assert refusal(MAGRPOConfig, parallel_training="ddp") == (
        "parallel_training only supports: none, mp (MAGRPOConfig.parallel_training must be one of: 'none', 'mp', "
        "got 'ddp')")


def test_mp_needs_explicit_agent_devices():
    assert refusal(MAGRPOConfig, parallel_training="mp") == (
        "parallel_training='mp' requires explicit agent_devices: MAGRPOConfig.device (alias agent_devices) was left "
        "at its default (give one device or one per agent)")
    assert MAGRPOConfig(parallel_training="mp", agent_devices=["cpu", "cpu"]).device == ["cpu", "cpu"]
    assert MAGRPOConfig(parallel_training="mp", device="auto").device == "auto"  # given, although the default


TRUNCATED = ("{owner}: the reference KL (k3 estimate) is computed from completions sampled with truncated sampling "
             "(truncated by {settings}): the tokens come from the policy's distribution cut to its top tokens and "
             "renormalised, not from the policy whose log-probabilities the estimate reads, so it is not an unbiased "
             "estimate of KL(policy || reference) (it reads the head of the distribution, re-weighted, and never the "
             "tail, where the policy may drift unseen); it still is >= 0 and 0 where the two agree on the sampled "
             "tokens. For an unbiased KL sample with top_p=1.0, top_k=None (docs/algorithms.md, 'Reference-model KL')")


def test_a_kl_from_truncated_sampling_warns_once_at_the_callers_line():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        MAGRPOConfig(reference_kl_enabled=True)
    assert len(seen) == 1
    assert seen[0].category is TruncatedSamplingKLWarning
    assert str(seen[0].message) == TRUNCATED.format(owner="MAGRPOConfig", settings="top_p=0.6, top_k=50")
    if "MUTANT_UNDER_TEST" not in os.environ:  # mutmut's trampolines add frames between a config and its caller
        assert seen[0].filename == __file__  # the user's line, not the config's
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        IACConfig(reference_kl_enabled=True, top_p=0.9)
    assert [str(w.message) for w in seen] == [TRUNCATED.format(owner="IACConfig", settings="top_p=0.9")]


@pytest.mark.parametrize("values", [
    dict(),                                                      # no KL term
    dict(reference_kl_enabled=False, reference_kl_coef=0.5),     # a coefficient without the term
    dict(reference_kl_enabled=True, reference_kl_coef=0.0),      # the term weighted 0
    dict(reference_kl_enabled=True, top_p=1.0, top_k=None),      # untruncated sampling
])
def test_no_warning_without_a_kl_estimated_from_truncated_sampling(values):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        MAGRPOConfig(**values)
    assert [w for w in seen if w.category is TruncatedSamplingKLWarning] == []


def test_reward_weights_must_be_numbers():
    assert MAGRPOConfig(reward_weights=[1, 0.5]).reward_weights == [1, 0.5]
    assert refusal(MAGRPOConfig, reward_weights=[1.0, True]) == (
        "MAGRPOConfig.reward_weights must hold numbers, got [1.0, True]")
    assert refusal(MAGRPOConfig, reward_weights=["2"]) == "MAGRPOConfig.reward_weights must hold numbers, got ['2']"


def test_agent_device_lists_one_per_agent_or_one():
    assert MAGRPOConfig(device=["cpu"]).device == ["cpu"]
    assert MAGRPOConfig(num_agents=3, device=["cpu", "cpu", "cpu"]).device == ["cpu", "cpu", "cpu"]
    assert refusal(MAGRPOConfig, device=["cpu", "cpu", "cpu"]) == (
        "agent_devices length (3) must be 1 or 2: MAGRPOConfig.device lists ['cpu', 'cpu', 'cpu'] for 2 models "
        "(give one device or 2)")
    assert refusal(MAGRPOConfig, device=[0, 1]) == (
        "MAGRPOConfig.device must be 'auto', a device string or a list of device strings, got [0, 1]")


def test_reference_models_and_devices_one_per_agent():
    assert MAGRPOConfig(reference_model=["a", "b"], reference_devices=["cpu", "cpu"]).reference_model == ["a", "b"]
    assert MAGRPOConfig(reference_model="a", reference_devices="cpu").reference_devices == "cpu"
    assert refusal(MAGRPOConfig, reference_model=["a"]) == (
        "MAGRPOConfig.reference_model lists 1 models for num_agents=2; give one per agent or a single source")
    assert refusal(MAGRPOConfig, reference_devices=["cpu", "cpu", "cpu"]) == (
        "reference_devices length (3) must be 1 or 2: MAGRPOConfig.reference_devices lists ['cpu', 'cpu', 'cpu'] "
        "for 2 models (give one device or 2)")


def test_every_shared_problem_is_named_in_order():
    assert refusal(MAGRPOConfig, reward_weights=[None], device=["cpu"] * 3, parallel_training="mp",
                   reference_model=["a", "b", "c"], reference_devices=[1], train_batch_size=5) == "; ".join([
        "MAGRPOConfig.reward_weights must hold numbers, got [None]",
        "agent_devices length (3) must be 1 or 2: MAGRPOConfig.device lists ['cpu', 'cpu', 'cpu'] for 2 models "
        "(give one device or 2)",
        "MAGRPOConfig.reference_model lists 3 models for num_agents=2; give one per agent or a single source",
        "MAGRPOConfig.reference_devices must be 'auto', a device string or a list of device strings, got [1]",
        "MAGRPOConfig.train_batch_size=5 is not supported yet: an update here uses per_device_train_batch_size x "
        "gradient_accumulation_steps = 2 samples per agent; set those instead (or give train_batch_size=2)",
    ])


def test_reward_call_policy_carries_the_three_fields():
    policy = reward_call_policy(MAGRPOConfig(reward_retries=2, reward_retry_backoff=0.25, reward_timeout=3.5))
    assert isinstance(policy, RewardCallPolicy)
    assert (policy.retries, policy.backoff, policy.timeout) == (2, 0.25, 3.5)
    default = reward_call_policy(MAGRPOConfig())
    assert (default.retries, default.backoff, default.timeout) == (0, 1.0, None)


# ----- comlrl 1.4.3's batching fields ---------------------------------------------------------------------

@pytest.mark.parametrize("values, batch", [
    (dict(rollout_buffer_size=6), 6),                      # one sample per prompt and agent: 6 prompts
    (dict(rollout_buffer_size=1), 1),
    (dict(rollout_buffer_size=6, per_device_train_batch_size=3, gradient_accumulation_steps=2), 3),
    (dict(rollout_buffer_size=2, train_batch_size=2), 2),
    (dict(train_batch_size=2), 2),                         # the default update: 2 prompts x 1 window
    (dict(train_batch_size=4, gradient_accumulation_steps=2), 2),
])
def test_a_rollout_buffer_maps_to_the_batch_of_one_update(values, batch):
    config = MAGRPOConfig(**values)
    assert config.per_device_train_batch_size == batch
    assert config.gradient_accumulation_steps == values.get("gradient_accumulation_steps", 1)


@pytest.mark.parametrize("config_class, values, message", [
    (MAGRPOConfig, dict(rollout_buffer_size=6, per_device_train_batch_size=3),
     "MAGRPOConfig.rollout_buffer_size=6 is not supported yet: an update here uses per_device_train_batch_size x "
     "gradient_accumulation_steps = 3 samples per agent; set those instead (or give rollout_buffer_size=3)"),
    (MAGRPOConfig, dict(rollout_buffer_size=6, gradient_accumulation_steps=2),
     "MAGRPOConfig.rollout_buffer_size=6 is not supported yet: an update here uses per_device_train_batch_size x "
     "gradient_accumulation_steps = 4 samples per agent; set those instead (or give rollout_buffer_size=4)"),
    (MAGRPOConfig, dict(num_turns=2, rollout_buffer_size=4),
     "MAGRPOConfig.rollout_buffer_size=4 is not supported yet: with num_turns=2 it has no equivalent here"),
    (MAGRPOConfig, dict(num_turns=3, train_batch_size=2),
     "MAGRPOConfig.train_batch_size=2 is not supported yet: with num_turns=3 it has no equivalent here"),
    (MAGRPOConfig, dict(rollout_buffer_size=3, train_batch_size=5, per_device_train_batch_size=3),
     "MAGRPOConfig.train_batch_size=5 is not supported yet: an update here uses per_device_train_batch_size x "
     "gradient_accumulation_steps = 3 samples per agent; set those instead (or give train_batch_size=3)"),
    (IACConfig, dict(rollout_buffer_size=6),  # not a multiple of the 4 completions per prompt: not adopted
     "IACConfig.rollout_buffer_size=6 is not supported yet: an update here uses per_device_train_batch_size x "
     "gradient_accumulation_steps = 4 samples per agent; set those instead (or give rollout_buffer_size=4)"),
    (MADPOConfig, dict(rollout_buffer_size=2),  # 1.4.3's MADPO buffer counts pairs: never adopted
     "MADPOConfig.rollout_buffer_size=2 is not supported yet: an update here uses per_device_train_batch_size x "
     "gradient_accumulation_steps = 1 samples per agent; set those instead (or give rollout_buffer_size=1)"),
])
def test_a_buffer_that_does_not_map_is_refused_with_the_samples_of_one_update(config_class, values, message):
    assert refusal(config_class, **values) == message


@pytest.mark.parametrize("values, message", [
    (dict(rollout_buffer_size=0), "MAGRPOConfig.rollout_buffer_size must be >= 1 or null (None), got 0"),
    (dict(rollout_buffer_size="4"), "MAGRPOConfig.rollout_buffer_size must be of type int, got '4'"),
    (dict(rollout_buffer_size=4.0), "MAGRPOConfig.rollout_buffer_size must be of type int, got 4.0"),
])
def test_a_bad_buffer_is_refused_alone_not_adopted(values, message):
    assert refusal(MAGRPOConfig, **values) == message


def test_actor_critic_buffers_count_each_completion():
    assert IACConfig(rollout_buffer_size=8).per_device_train_batch_size == 2  # 8 samples / 4 completions
    assert IACConfig(rollout_buffer_size=4).per_device_train_batch_size == 1
    assert MAACConfig(rollout_buffer_size=6, num_generations=3).per_device_train_batch_size == 2
    assert refusal(IACConfig, rollout_buffer_size=4, num_generations=0) == (
        "IACConfig.num_generations must be >= 1 or null (None), got 0")
    assert refusal(IACConfig, rollout_buffer_size=4, num_generations="2") == (
        "IACConfig.num_generations must be of type int, got '2'")


# ----- MAGRPO and its family ------------------------------------------------------------------------------

@pytest.mark.parametrize("config_class, mode", [
    (MAGRPOConfig, "mean"), (MAReMaxConfig, "max"), (MARLOOConfig, "rloo"),
])
def test_a_group_of_one_is_refused_for_every_baseline(config_class, mode):
    name = config_class.__name__
    assert refusal(config_class, num_generations=1) == (
        f"{name}.num_generations must be >= 2 for the {mode!r} group baseline, got 1")


def test_reinforce_takes_a_group_of_one_but_not_skipping_its_constant_groups():
    assert MAREINFORCEConfig(num_generations=1).num_generations == 1
    assert refusal(MAREINFORCEConfig, num_generations=1, skip_zero_variance_groups=True) == (
        "MAREINFORCEConfig.skip_zero_variance_groups=True needs num_generations >= 2, got num_generations=1 (a group "
        "of one sample is always constant, so every sample would be skipped): raise num_generations or leave the "
        "option False")
    assert MAGRPOConfig(num_generations=2, skip_zero_variance_groups=True).skip_zero_variance_groups is True


def test_centralized_collaboration_is_another_config():
    assert refusal(MAGRPOConfig, collaboration_mode="centralized", num_generations=1) == "; ".join([
        "MAGRPOConfig.collaboration_mode='centralized': one model writing every role is CentralizedMAGRPOConfig "
        "with CentralizedMAGRPOTrainer (run specs: algorithm: magrpo_centralized)",
        "MAGRPOConfig.num_generations must be >= 2 for the 'mean' group baseline, got 1",
    ])


@pytest.mark.parametrize("values, leaves", [
    (dict(joint_mode="cross", num_generations=64), 4096),
    (dict(joint_mode="aligned", num_generations=4096), 4096),
    (dict(joint_mode="aligned", num_generations=64, num_turns=2), 4096),
    (dict(joint_mode="cross", num_generations=8, num_turns=2), 4096),
    (dict(joint_mode="cross", num_generations=4, num_agents=3, num_turns=2), 4096),
])
def test_up_to_4096_leaf_samples_per_prompt_are_accepted(values, leaves):
    config = MAGRPOConfig(**values)
    joint = config.num_generations ** (config.num_agents if config.joint_mode == "cross" else 1)
    assert joint ** config.num_turns == leaves


@pytest.mark.parametrize("values, described, leaves", [
    (dict(joint_mode="cross", num_generations=65), "'cross' joints with num_generations=65, num_agents=2, num_turns=1",
     4225),
    (dict(joint_mode="aligned", num_generations=4097),
     "'aligned' joints with num_generations=4097, num_agents=2, num_turns=1", 4097),
    (dict(joint_mode="aligned", num_generations=65, num_turns=2),
     "'aligned' joints with num_generations=65, num_agents=2, num_turns=2", 4225),
    (dict(joint_mode="cross", num_generations=9, num_turns=2),
     "'cross' joints with num_generations=9, num_agents=2, num_turns=2", 6561),
    (dict(joint_mode="cross", num_generations=3, num_agents=8), "'cross' joints with num_generations=3, "
     "num_agents=8, num_turns=1", 6561),
])
def test_more_leaf_samples_are_refused_with_their_count(values, described, leaves):
    assert refusal(MAGRPOConfig, **values) == (
        f"MAGRPOConfig: {described} make {leaves} leaf samples per prompt (limit 4096); lower one of them")


# ----- centralized MAGRPO ---------------------------------------------------------------------------------

def test_the_centralized_config_counts_roles_and_trains_one_model():
    config = CentralizedMAGRPOConfig(num_agents=3, device=["cpu"], num_generations=64, joint_mode="cross")
    assert config.num_agents == 3 and config.num_roles == 3  # restored after the one-model checks
    assert config.collaboration_mode == "centralized"
    assert refusal(CentralizedMAGRPOConfig, num_agents=3, device=["cpu", "cpu"]) == (
        "agent_devices length (2) must be 1 or 1: CentralizedMAGRPOConfig.device lists ['cpu', 'cpu'] for 1 models "
        "(give one device or 1)")


def test_the_centralized_adapter_is_the_format_its_fields_name():
    separated = CentralizedMAGRPOConfig(num_agents=3, collaboration_format="separated", role_names=["a", "b", "c"],
                                        section_separator="\n--\n").collaboration_adapter()
    assert separated.describe() == {"format": "separated", "roles": ["a", "b", "c"], "separator": "\n--\n"}
    assert separated.format_completion(["x", "y", "z"]) == "x\n--\ny\n--\nz"
    tagged = CentralizedMAGRPOConfig(role_names=["coder", "tester"]).collaboration_adapter()
    assert tagged.describe() == {"format": "tagged", "roles": ["coder", "tester"]}
    assert tagged.format_completion(["x", "y"]) == "<coder>\nx\n</coder>\n<tester>\ny\n</tester>"
    default = CentralizedMAGRPOConfig(num_agents=2).collaboration_adapter()
    assert default.describe() == {"format": "tagged", "roles": ["agent_0", "agent_1"]}


def test_every_centralized_problem_is_named_in_order():
    assert refusal(CentralizedMAGRPOConfig, collaboration_mode="decentralized", num_turns=2, role_names=["a", "a"],
                   num_generations=1) == "; ".join([
        "CentralizedMAGRPOConfig requires centralized collaboration: CentralizedMAGRPOConfig.collaboration_mode must "
        "be 'centralized', got 'decentralized'; for one model per agent use MAGRPOConfig with MAGRPOTrainer",
        "Centralized MAGRPO currently supports num_turns=1 only: CentralizedMAGRPOConfig.num_turns=2 is not "
        "supported: centralized MAGRPO runs one-turn episodes (as comlrl 1.4.3's); use MAGRPOConfig for multi-turn "
        "training",
        "CentralizedMAGRPOConfig.role_names/section_separator: TaggedCollaboration.role_names must be distinct "
        "(ignoring case), got ['a', 'a']",
        "CentralizedMAGRPOConfig.num_generations must be >= 2 for the 'mean' group baseline, got 1",
    ])
    assert refusal(CentralizedMAGRPOConfig, collaboration_format="separated", section_separator=" ") == (
        "CentralizedMAGRPOConfig.role_names/section_separator: SeparatedCollaboration.separator must be a string "
        "with a visible character, got ' '")


# ----- the actor-critic configs ---------------------------------------------------------------------------

def test_actor_critic_defaults_resolve_from_the_turns_and_the_agent_rate():
    assert IACConfig().num_generations == 4
    assert IACConfig(num_turns=2).num_generations == 1
    assert MAACConfig(num_turns=3).num_generations == 1
    assert IACConfig(num_generations=2).num_generations == 2
    assert IACConfig(agent_learning_rate=1e-4).critic_learning_rate == 5e-6
    assert IACConfig(critic_learning_rate=None, agent_learning_rate=3e-6).critic_learning_rate == 3e-6
    assert MAACConfig(critic_learning_rate=2e-5).critic_learning_rate == 2e-5
    assert refusal(IACConfig, num_turns="2") == "IACConfig.num_turns must be of type int, got '2'"


@pytest.mark.parametrize("config_class, algorithm", [
    (IACConfig, "IAC"), (MAACConfig, "MAAC"), (ActorCriticConfig, "actor-critic"),
])
def test_multi_turn_actor_critic_follows_one_chain(config_class, algorithm):
    name = config_class.__name__
    assert refusal(config_class, num_turns=2, num_generations=2) == (
        f"Multi-turn {algorithm} currently supports num_generations == 1: {name}.num_generations must be 1 when "
        "num_turns > 1 (got num_generations=2, num_turns=2): multi-turn actor-critic follows one chain per prompt")


def test_critic_devices_one_per_critic():
    assert MAACConfig(critic_device=["cpu"]).critic_device == ["cpu"]
    assert refusal(MAACConfig, critic_device=["cpu", "cpu"]) == (
        "critic_devices length (2) must be 1 or 1: MAACConfig.critic_device lists ['cpu', 'cpu'] for 1 models "
        "(give one device or 1)")
    assert IACConfig(critic_devices=["cpu", "cpu"]).critic_device == ["cpu", "cpu"]
    assert refusal(IACConfig, critic_device=["cpu"] * 3) == (
        "critic_devices length (3) must be 1 or 2: IACConfig.critic_device lists ['cpu', 'cpu', 'cpu'] for 2 models "
        "(give one device or 2)")
    assert refusal(ActorCriticConfig, num_agents=3, critic_device=["cpu"] * 2) == (
        "critic_devices length (2) must be 1 or 3: ActorCriticConfig.critic_device lists ['cpu', 'cpu'] for 3 models "
        "(give one device or 3)")
    shared = IACConfig(use_separate_critic=False, critic_device=["cpu"] * 3)  # no separate critic to place
    assert shared.critic_device == ["cpu", "cpu", "cpu"]


def test_mp_needs_explicit_critic_devices_where_there_are_critics():
    assert refusal(MAACConfig, parallel_training="mp", device="cpu") == (
        "parallel_training='mp' requires explicit critic_devices: MAACConfig.critic_device (alias critic_devices) "
        "is None")
    assert refusal(IACConfig, parallel_training="mp", device="cpu") == (
        "parallel_training='mp' requires explicit critic_devices when use_separate_critic=True: "
        "IACConfig.critic_device (alias critic_devices) is None")
    assert IACConfig(parallel_training="mp", device="cpu", use_separate_critic=False).critic_device is None
    assert MAACConfig(parallel_training="mp", device="cpu", critic_devices="cpu").critic_device == "cpu"


def test_a_q_critic_needs_two_completions_per_prompt():
    assert IACConfig(critic_type="q", num_generations=2).critic_type == "q"
    tail = ("the baseline of a completion's advantage is the mean Q(h, a) of the other completions sampled for the "
            "same prompt (a baseline that depends on the completion itself would cancel its advantage as Q fits); "
            "multi-turn episodes are single chains, so use critic_type='v' there")
    assert refusal(MAACConfig, critic_type="q", num_generations=1) == (
        f"MAACConfig.critic_type='q' needs num_generations >= 2 (got num_generations=1, num_turns=1): {tail}")
    assert refusal(IACConfig, critic_type="q", num_turns=2) == (
        f"IACConfig.critic_type='q' needs num_generations >= 2 (got num_generations=1, num_turns=2): {tail}")


def test_iac_value_head_widths_and_passes_follow_the_critic_kind():
    assert IACConfig(critic_value_head_hidden_dim=8).critic_value_head_hidden_dim == 8
    assert IACConfig(use_separate_critic=False, value_head_hidden_dim=8, critic_update_epochs=1).value_head_hidden_dim == 8
    assert IACConfig(critic_update_epochs=3).critic_update_epochs == 3
    assert refusal(IACConfig, value_head_hidden_dim=8) == (
        "IACConfig.value_head_hidden_dim=8 sizes the shared actor head, but use_separate_critic=True; set "
        "critic_value_head_hidden_dim for separate critics instead")
    assert refusal(IACConfig, use_separate_critic=False, critic_value_head_hidden_dim=16, critic_update_epochs=2) == (
        "IACConfig.critic_value_head_hidden_dim=16 sizes separate critics, but use_separate_critic=False; set "
        "value_head_hidden_dim for the shared head instead; "
        "IACConfig.critic_update_epochs=2 needs use_separate_critic=True: a shared value head's extra passes would "
        "also step the actor")


# ----- MARLHF ----------------------------------------------------------------------------------------------

def test_marlhf_critic_rate_defaults_to_the_agent_rate():
    assert MARLHFConfig(agent_learning_rate=2e-5).critic_learning_rate == 2e-5
    assert MARLHFConfig(agent_learning_rate=2e-5, critic_learning_rate=7e-6).critic_learning_rate == 7e-6


def test_marlhf_group_of_one_names_the_policy_stage():
    assert refusal(MARLHFConfig, num_generations=1) == (
        "MARLHFConfig.num_generations must be >= 2 for MAGRPO-family MARLHF backends (the policy stage's 'mean' "
        "group baseline), got 1")


@pytest.mark.parametrize("values, batch", [
    (dict(rollout_buffer_size=4), 4),                                                   # MAGRPO: one per prompt
    (dict(rl_algorithm="maac", rollout_buffer_size=8), 2),                              # 4 completions per prompt
    (dict(rl_algorithm="iac", rollout_buffer_size=8, policy_overrides={"num_generations": 2}), 4),
    (dict(rl_algorithm="iac", rollout_buffer_size=8, policy_overrides={"num_generations": 1}), 8),
    (dict(rl_algorithm="iac", rollout_buffer_size=8, policy_overrides={"num_generations": 0}), 2),
    (dict(rl_algorithm="iac", rollout_buffer_size=8, policy_overrides={"num_generations": "2"}), 2),
    (dict(rl_algorithm="magrpo", rollout_buffer_size=8, policy_overrides={"num_generations": 2}), 8),
])
def test_marlhf_buffers_count_as_the_policy_stage_does(values, batch):
    assert MARLHFConfig(**values).per_device_train_batch_size == batch


def test_marlhf_policy_overrides_must_be_a_dict():
    assert refusal(MARLHFConfig, rl_algorithm="iac", rollout_buffer_size=8, policy_overrides=[1]) == (
        "MARLHFConfig.policy_overrides must be of type dict, got [1]")


def test_marlhf_fields_and_overrides_must_agree():
    assert MARLHFConfig(critic_type="q", policy_overrides={"critic_type": "q"}).critic_type == "q"
    assert MARLHFConfig(policy_overrides={"critic_type": "q", "entropy_coef": 0.1}).critic_type == "v"
    nested = MARLHFConfig(policy_overrides={"policy_overrides": {"a": 1}})  # not compared with itself
    assert nested.policy_overrides == {"policy_overrides": {"a": 1}}
    assert refusal(MARLHFConfig, critic_type="q", value_loss_coef=0.5,
                   policy_overrides={"critic_type": "v", "value_loss_coef": 0.6, "gae_lambda": 0.9}) == (
        "MARLHFConfig.critic_type='q' and policy_overrides['critic_type']='v' disagree; give one; "
        "MARLHFConfig.value_loss_coef=0.5 and policy_overrides['value_loss_coef']=0.6 disagree; give one")
    # A key MARLHFConfig does not have, or policy_overrides itself, is passed over and the next keys still compared.
    assert refusal(MARLHFConfig, critic_type="q",
                   policy_overrides={"entropy_coef": 0.1, "policy_overrides": {}, "critic_type": "v"}) == (
        "MARLHFConfig.critic_type='q' and policy_overrides['critic_type']='v' disagree; give one")
    assert refusal(MARLHFConfig, critic_type="q", policy_overrides={"policy_overrides": {}, "critic_type": "v"}) == (
        "MARLHFConfig.critic_type='q' and policy_overrides['critic_type']='v' disagree; give one")


def test_marlhf_all_pairs_need_no_cap():
    assert MARLHFConfig(pair_selection="all").max_pairs_per_prompt is None
    assert refusal(MARLHFConfig, pair_selection="all", max_pairs_per_prompt=3) == (
        "preference_pairs_per_sample must be null when pair_selection='all': MARLHFConfig.pair_selection='all' needs "
        "max_pairs_per_prompt=None, got 3")


def test_marlhf_iterative_reads_the_originals_spellings_and_pools_as_replay_all():
    config = MARLHFIterConfig(comparator_policy=" Previous ", output_dir="/tmp/x", preference_replay_mode="Nearest_K",
                              preference_replay_k=2)
    assert (config.comparator_policy, config.preference_replay_mode) == ("history", "last_k")
    assert MARLHFIterConfig(pool_preference_pairs=True, preference_replay_mode="all_history").pool_preference_pairs
    assert MARLHFIterConfig(pool_preference_pairs=True).preference_replay_mode == "none"
    assert refusal(MARLHFIterConfig, pool_preference_pairs=True, preference_replay_mode="last_k",
                   preference_replay_k=2, comparator_history_k=2) == (
        "comparator_history_k is only valid when comparator_policy='history': "
        "MARLHFIterConfig.comparator_policy='current'; "
        "MARLHFIterConfig.pool_preference_pairs=True is replay mode 'all' but preference_replay_mode='last_k'; give "
        "one of them")
    assert refusal(MARLHFIterConfig, pair_selection="all", max_pairs_per_prompt=2, comparator_policy="model") == (
        "preference_pairs_per_sample must be null when pair_selection='all': MARLHFIterConfig.pair_selection='all' "
        "needs max_pairs_per_prompt=None, got 2; "
        "comparator_model_name or comparator_agents is required when comparator_policy='model' (MARLHFIterConfig)")


# ----- MADPO -----------------------------------------------------------------------------------------------

def test_madpo_refusals_in_order():
    assert refusal(MADPOConfig, num_turns=2, reference_kl_enabled=True, pair_selection="all") == "; ".join([
        "MADPO currently supports num_turns=1 only: MADPOConfig.num_turns must be 1 (preference pairs compare "
        "single-turn joint responses), got 2",
        "MADPOConfig.reference_kl_enabled: DPO's own reference term is its KL control (dpo_beta, dpo_reference, "
        "reference_model); a second KL penalty is not supported",
        "preference_pairs_per_sample must be null when pair_selection='all': MADPOConfig.pair_selection='all' keeps "
        "every pair: set max_pairs_per_prompt=None, got 4",
    ])
    assert MADPOConfig(pair_selection="all", max_pairs_per_prompt=None).pair_selection == "all"


def test_madpo_reference_sources_need_the_initial_reference():
    message = "MADPOConfig.reference_model/reference_devices need dpo_reference='initial', got 'none'"
    assert refusal(MADPOConfig, dpo_reference="none", reference_model="m") == message
    assert refusal(MADPOConfig, dpo_reference="none", reference_devices="cpu") == message
    assert MADPOConfig(dpo_reference="none").reference_model is None
    assert MADPOConfig(reference_model="m", reference_devices="cpu").dpo_reference == "initial"


def test_iterative_madpo_counts_pairs_per_update_and_plans_no_decay():
    assert MADPOIterConfig(train_batch_size=8).dpo_batch_size == 8
    assert MADPOIterConfig(train_batch_size=12, dpo_batch_size=6, gradient_accumulation_steps=2).train_batch_size == 12
    assert MADPOIterConfig(lr_scheduler_type="constant_with_warmup").lr_scheduler_type == "constant_with_warmup"
    assert refusal(MADPOIterConfig, train_batch_size=4, lr_scheduler_type="cosine") == (
        "MADPOIterConfig.train_batch_size=4 is not supported yet: an update here uses per_device_train_batch_size x "
        "gradient_accumulation_steps = 8 samples per agent; set those instead (or give train_batch_size=8); "
        "MADPOIterConfig.lr_scheduler_type='cosine': how many DPO steps a run takes depends on how many pairs each "
        "iteration yields, so a decaying schedule has no length to plan over; use 'constant' or "
        "'constant_with_warmup'")
    assert refusal(MADPOIterConfig, lr_scheduler_type="linear", num_turns=2) == (
        "MADPO currently supports num_turns=1 only: MADPOIterConfig.num_turns must be 1 (preference pairs compare "
        "single-turn joint responses), got 2; "
        "MADPOIterConfig.lr_scheduler_type='linear': how many DPO steps a run takes depends on how many pairs each "
        "iteration yields, so a decaying schedule has no length to plan over; use 'constant' or "
        "'constant_with_warmup'")


# ----- the iterative options --------------------------------------------------------------------------------

@pytest.mark.parametrize("values, read", [
    (dict(comparator_policy=" Self "), dict(comparator_policy="current")),
    (dict(comparator_policy="API", comparator_api_url="http://h"), dict(comparator_policy="api")),
    (dict(comparator_policy="Checkpoint", output_dir="/tmp/x"), dict(comparator_policy="history")),
    (dict(preference_replay_mode="TD-Lambda", preference_replay_lambda=0.5),
     dict(preference_replay_mode="lambda_decay")),
    (dict(comparator_generation_mode="Centralised"), dict(comparator_generation_mode="centralized")),
    (dict(comparator_api_format=" OpenAI "), dict(comparator_api_format="chat")),
    (dict(preference_replay_mode="current", preference_replay_k=1),
     dict(preference_replay_mode="none", preference_replay_k=None)),
    (dict(preference_replay_k=1), dict(preference_replay_k=None)),
    (dict(preference_replay_mode="nearest_k", preference_replay_k=1),
     dict(preference_replay_mode="last_k", preference_replay_k=1)),
])
def test_the_originals_spellings_are_translated(values, read):
    for config_class in (MADPOIterConfig, MARLHFIterConfig):
        config = config_class(**values)
        assert {name: getattr(config, name) for name in read} == read


def test_a_value_that_is_not_a_string_is_left_for_its_field_to_refuse():
    assert refusal(MADPOIterConfig, comparator_policy=5) == (
        "comparator_policy must be one of: current, current_copy, model, history, api "
        "(MADPOIterConfig.comparator_policy must be of type str, got 5)")
    config = types.SimpleNamespace(comparator_policy="Self", preference_replay_mode="none", preference_replay_k=1,
                                   comparator_generation_mode=None, comparator_api_format=3)
    normalise_values(config)
    assert vars(config) == dict(comparator_policy="current", preference_replay_mode="none", preference_replay_k=None,
                                comparator_generation_mode=None, comparator_api_format=3)


@pytest.mark.parametrize("values, problems", [
    (dict(comparator_policy="model"),
     ["comparator_model_name or comparator_agents is required when comparator_policy='model' ({name})"]),
    (dict(comparator_model_name="m"),
     ["comparator_model_name and comparator_agents are only valid when comparator_policy='model': "
      "{name}.comparator_policy='current'"]),
    (dict(comparator_policy="api", comparator_api_url="http://h", comparator_agents=["a", "b"]),
     ["comparator_model_name and comparator_agents are only valid when comparator_policy='model': "
      "{name}.comparator_policy='api'"]),
    (dict(comparator_policy="model", comparator_model_name="m", comparator_agents=["a"]),
     ["{name}: give comparator_model_name or comparator_agents, not both",
      "{name}.comparator_agents has 1 entries for num_agents=2"]),
    (dict(comparator_history_k=2),
     ["comparator_history_k is only valid when comparator_policy='history': {name}.comparator_policy='current'"]),
    (dict(comparator_policy="history"),
     ["{name}.comparator_policy='history' keeps per-iteration policy snapshots on disk: set output_dir or "
      "policy_checkpoint_dir"]),
    (dict(comparator_policy="api", comparator_api_url="http://h", comparator_api_format="generic"),
     ["{name}.comparator_api_format='generic' is not supported yet: the comparator endpoint must speak OpenAI's "
      "'chat' or 'completions' format"]),
    (dict(comparator_policy="api"), ["comparator_api_url is required when comparator_policy='api' ({name})"]),
    (dict(comparator_policy="api", comparator_api_url=""),
     ["comparator_api_url is required when comparator_policy='api' ({name})"]),
    (dict(comparator_policy="api", comparator_api_url="https://h", comparator_api_key_env="COMLRL_TEST_UNSET_KEY"),
     ["{name}.comparator_api_key_env='COMLRL_TEST_UNSET_KEY': that environment variable is not set"]),
    (dict(comparator_api_url="http://h"),
     ["{name}.comparator_api_url applies only to comparator_policy='api', got comparator_policy='current'"]),
    (dict(comparator_policy="api", comparator_api_url="ftp://h"),
     ["{name}.comparator_api_url must start with http:// or https://, got 'ftp://h'"]),
    (dict(comparator_policy="model", comparator_model_name="m", comparator_api_url="h"),
     ["{name}.comparator_api_url applies only to comparator_policy='api', got comparator_policy='model'",
      "{name}.comparator_api_url must start with http:// or https://, got 'h'"]),
    (dict(comparator_generation_mode="centralized", comparator_centralized_agent_index=2),
     ["comparator_centralized_agent_index must be smaller than num_agents: {name}.comparator_centralized_agent_index=2 "
      "with num_agents=2 (agents 0..1)"]),
    (dict(comparator_parse_failure="raise"),
     ["{name}.comparator_parse_failure='raise' applies only to comparator_generation_mode='centralized', got "
      "'decentralized'"]),
    (dict(comparator_devices=["cpu"]), ["{name}.comparator_devices has 1 entries for num_agents=2"]),
    (dict(preference_replay_k=2),
     ["preference_replay_k must be null or 1 when preference_replay_mode='current' ({name}.preference_replay_mode="
      "'none', preference_replay_k=2, preference_replay_lambda=None)"]),
    (dict(preference_replay_mode="last_k"),
     ["preference_replay_k is required when preference_replay_mode='nearest_k' ({name}.preference_replay_mode="
      "'last_k', preference_replay_k=None, preference_replay_lambda=None)"]),
    (dict(preference_replay_mode="all", preference_replay_k=2, preference_replay_lambda=0.5),
     ["preference_replay_k is only valid when preference_replay_mode='nearest_k' ({name}.preference_replay_mode="
      "'all', preference_replay_k=2, preference_replay_lambda=0.5)",
      "preference_replay_lambda is only valid when preference_replay_mode='lambda_decay' ({name}."
      "preference_replay_mode='all', preference_replay_k=2, preference_replay_lambda=0.5)"]),
    (dict(preference_replay_mode="lambda_decay"),
     ["preference_replay_lambda is required when preference_replay_mode='lambda_decay' ({name}."
      "preference_replay_mode='lambda_decay', preference_replay_k=None, preference_replay_lambda=None)"]),
    (dict(preference_replay_sample_size=4),
     ["preference_replay_sample_size is only valid when preference_replay_mode is 'nearest_k', 'all_history', or "
      "'lambda_decay' ({name}: replay modes 'last_k', 'all' or 'lambda_decay' here, not 'none')"]),
])
def test_each_iterative_rule_is_refused_in_its_words(values, problems, monkeypatch):
    monkeypatch.delenv("COMLRL_TEST_UNSET_KEY", raising=False)
    for config_class in (MADPOIterConfig, MARLHFIterConfig):
        name = config_class.__name__
        assert refusal(config_class, **values) == "; ".join(problem.format(name=name) for problem in problems)


@pytest.mark.parametrize("values", [
    dict(comparator_policy="model", comparator_model_name="m"),
    dict(comparator_policy="model", comparator_agents=["a", "b"]),
    dict(comparator_policy="history", comparator_history_k=2, output_dir="/tmp/x"),
    dict(comparator_policy="history", policy_checkpoint_dir="/tmp/x"),
    dict(comparator_policy="api", comparator_api_url="http://h", comparator_api_format="completions",
         comparator_api_key_env="COMLRL_TEST_UNSET_KEY", comparator_api_key="k"),
    dict(comparator_policy="api", comparator_api_url="https://h", comparator_api_key_env=""),
    dict(comparator_api_format="generic"),  # the original's other formats, while no API is asked for
    dict(comparator_generation_mode="centralized", comparator_centralized_agent_index=1,
         comparator_parse_failure="raise"),
    dict(comparator_centralized_agent_index=5),  # only read in centralized mode
    dict(comparator_devices=["cpu", "cpu"]),
    dict(comparator_devices="cpu"),
    dict(preference_replay_mode="last_k", preference_replay_k=3, preference_replay_sample_size=4),
    dict(preference_replay_mode="lambda_decay", preference_replay_lambda=0.0),
    dict(preference_replay_mode="all", preference_replay_sample_size=4),
])
def test_iterative_settings_that_fit_together_construct(values, monkeypatch):
    monkeypatch.delenv("COMLRL_TEST_UNSET_KEY", raising=False)
    for config_class in (MADPOIterConfig, MARLHFIterConfig):
        config = config_class(**values)
        assert {name: getattr(config, name) for name in values} == values


def test_an_api_key_read_from_a_set_variable(monkeypatch):
    monkeypatch.setenv("COMLRL_TEST_SET_KEY", "secret")
    config = MADPOIterConfig(comparator_policy="api", comparator_api_url="http://h",
                             comparator_api_key_env="COMLRL_TEST_SET_KEY")
    assert config.comparator_api_key_env == "COMLRL_TEST_SET_KEY"


def test_configs_without_the_iterative_options_read_their_defaults():
    assert isinstance(defaults(), IterativeOptions)
    assert (defaults().comparator_policy, defaults().preference_replay_mode) == ("current", "none")
    iterative = MADPOIterConfig(comparator_policy="history", output_dir="/tmp/x")
    assert options_of(iterative) is iterative
    plain = options_of(MARLHFConfig())
    assert type(plain) is IterativeOptions and plain.comparator_policy == "current"
    partial = options_of(types.SimpleNamespace(comparator_policy="api"))  # some of the options only
    assert type(partial) is IterativeOptions and partial.comparator_policy == "current"
