"""Property test: whatever a reward function returns, the library gives rewards or a clear error."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comlrl.rollout.rewards import JointReward

values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**400, 10**400), st.booleans(), st.none(),
    st.text(max_size=3), st.lists(st.floats(), max_size=2),
)
returns = st.one_of(st.lists(values, max_size=6), values, st.dictionaries(st.text(max_size=2), values, max_size=3))


@settings(max_examples=300, deadline=None)
@given(returned=returns, mode=st.sampled_from(["raise", "drop"]), samples=st.integers(1, 4))
def test_reward_path_never_fails_deep_inside(returned, mode, samples):
    reward = JointReward(lambda c: returned, on_invalid=mode)
    try:
        result = reward([["x"] * samples], [{}] * samples)
    except ValueError as error:
        assert "reward function" in str(error)
        return
    assert isinstance(result, torch.Tensor) and result.shape == (samples,)
    for value in result.tolist():
        assert math.isfinite(value) or (mode == "drop" and math.isnan(value))
