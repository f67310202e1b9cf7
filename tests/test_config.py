import pytest

from comlrl.trainers import MAGRPOConfig


def test_defaults_are_valid_and_have_help():
    config = MAGRPOConfig()
    assert config.num_agents == 2 and config.top_k == 50  # comlrl 1.4.3's default (test_compat_defaults.py)
    help_texts = MAGRPOConfig.help()
    assert all(help_texts[name] for name in ("num_generations", "temperature", "joint_mode", "discount"))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("temperature", 0.0, "MAGRPOConfig.temperature must be > 0, got 0.0"),
        ("top_p", 1.5, "MAGRPOConfig.top_p must be <= 1, got 1.5"),
        ("top_k", 0, "MAGRPOConfig.top_k must be >= 1 or null (None), got 0"),
        ("num_agents", 0, "MAGRPOConfig.num_agents must be >= 1, got 0"),
        ("joint_mode", "zip", "MAGRPOConfig.joint_mode must be one of: 'aligned', 'cross', got 'zip'"),
        ("discount", 1.2, "MAGRPOConfig.discount must be <= 1, got 1.2"),
        ("max_new_tokens", "32", "MAGRPOConfig.max_new_tokens must be of type int, got '32'"),
        ("agent_learning_rate", float("nan"), "MAGRPOConfig.agent_learning_rate must be finite"),
        ("num_generations", 1, "MAGRPOConfig.num_generations must be >= 2 for the 'mean' group baseline, got 1"),
        ("seed", True, "MAGRPOConfig.seed must be a number, got True"),
    ],
)
def test_bad_values_name_the_field(field, value, message):
    with pytest.raises(ValueError) as error:
        MAGRPOConfig(**{field: value})
    assert message in str(error.value)


def test_cross_joint_explosion_is_rejected():
    with pytest.raises(ValueError, match="leaf samples per prompt"):
        MAGRPOConfig(num_agents=4, num_generations=8, joint_mode="cross", num_turns=2)

