"""Property test: any run-spec input yields a validated spec or a SpecError listing problems."""

from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flows.spec import RunSpec, SpecError, load_spec, parse_spec

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ["name", "algorithm", "models", "dataset", "reward", "reward_processor", "formatters", "transition",
            "config", "model_options", "checkpoint", "registry"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["magrpo", "maac", "marlhf", "comlrl.tasks.letters:letters_reward",
                                                           "data/letters/train.parquet", "../etc/passwd", "models:/x@champion",
                                                           "os:system", "!!python/object:os.system"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.sampled_from(SECTIONS + ["tiny", "path", "train",
                                                                                                   "temperature", "agent_model"]),
                                                                       inner, max_size=4)), max_leaves=12)
specs = st.dictionaries(st.sampled_from(SECTIONS), values, max_size=8)


def check(outcome):
    if isinstance(outcome, SpecError):
        assert outcome.problems and all(isinstance(p, tuple) and len(p) == 2 for p in outcome.problems)
    else:
        assert isinstance(outcome, RunSpec)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.one_of(specs, values))
def test_any_parsed_data_gives_a_spec_or_a_spec_error(data):
    try:
        outcome = parse_spec(data, "fuzz.yaml", ROOT)
    except SpecError as error:
        outcome = error
    check(outcome)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(text=st.one_of(st.text(max_size=80), specs.map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
                      st.just("!!python/object/apply:os.system ['echo hacked']")))
def test_any_file_gives_a_spec_or_a_spec_error(text, tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    try:
        outcome = load_spec(path, ROOT)
    except SpecError as error:
        outcome = error
    check(outcome)
