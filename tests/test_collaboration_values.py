"""The centralized collaboration formats written out: the joint prompt, the completion a format writes, what a
parse reads back and what a failed one keeps, each refusal's exact words, a comlrl 1.4.3 adapter's calls, and what
the role callbacks pass on (``comlrl/rollout/collaboration.py``)."""

from __future__ import annotations

import pytest
import torch

from comlrl.rollout.collaboration import (CollaborationAdapter, CollaborationParseError, SeparatedCollaboration,
                                          TaggedCollaboration, as_adapter, build_adapter, role_eval_logger,
                                          role_samples_callback, split_completions)
from comlrl.trainers.base import CallbackSample

TWO = "['agent_0', 'agent_1']"


def refusal(error_type, call, *args, **kwargs) -> str:
    with pytest.raises(error_type) as raised:
        call(*args, **kwargs)
    return str(raised.value)


def parse_failure(adapter, completion) -> CollaborationParseError:
    with pytest.raises(CollaborationParseError) as raised:
        adapter.parse_completion(completion)
    return raised.value


class Original:
    """A comlrl 1.4.3 adapter: records its calls, splits on '/' and answers what it is told to."""

    def __init__(self, answer=None, error=None):
        self.calls, self.answer, self.error = [], answer, error

    def build_prompt(self, batch_item, agent_prompts):
        self.calls.append(("build", batch_item, agent_prompts))
        return self.answer if self.answer is not None else " | ".join(agent_prompts)

    def parse_completion(self, completion, batch_item, num_agents):
        self.calls.append(("parse", completion, batch_item, num_agents))
        if self.error is not None:
            raise self.error
        if self.answer is not None:
            return self.answer
        if "/" not in completion:
            raise ValueError("no slash")
        return completion.split("/", 1)


class Recording(CollaborationAdapter):
    """A user's own format (a subclass): responses are the completion's words; records what a parse is given."""

    format_name = "words"

    def __init__(self, num_roles):
        super().__init__(num_roles)
        object.__setattr__(self, "calls", [])

    def parse_completion(self, completion, row=None, num_roles=None):
        self.calls.append((completion, row, num_roles))
        words = completion.split()
        if len(words) != self.num_roles:
            raise CollaborationParseError("not one word per role", (words + [""] * self.num_roles)[:self.num_roles])
        return words


# ----- the roles ----------------------------------------------------------------------------------
def test_role_counts_and_names_are_checked_with_the_owner_in_the_words():
    assert TaggedCollaboration(1).names == ("agent_0",)  # one role is a valid collaboration
    for bad in (0, -1, True, "2", 2.0):
        message = refusal(ValueError, TaggedCollaboration, bad)
        assert message == f"TaggedCollaboration.num_roles must be a positive integer, got {bad!r}"
    assert refusal(ValueError, SeparatedCollaboration, 0) == "SeparatedCollaboration.num_roles must be a positive integer, got 0"
    assert refusal(ValueError, TaggedCollaboration, 2, ("w",)) == "TaggedCollaboration.role_names has 1 names ['w'] for 2 roles"
    assert refusal(ValueError, TaggedCollaboration, 2, ("w", "2c")) == (
        "TaggedCollaboration.role_names: '2c' is not a valid role name (letters, digits, '_', '.', '-'; "
        "not starting with a digit)")
    assert refusal(ValueError, TaggedCollaboration, 2, ("w", 3)).startswith("TaggedCollaboration.role_names: 3 is not")
    assert refusal(ValueError, TaggedCollaboration, 2, ("Critic", "cRITIC")) == (
        "TaggedCollaboration.role_names must be distinct (ignoring case), got ['Critic', 'cRITIC']")
    assert refusal(ValueError, SeparatedCollaboration, 2, None, " \n") == (
        "SeparatedCollaboration.separator must be a string with a visible character, got ' \\n'")
    # Names given as a list are kept as a tuple: the adapter stays hashable and its names compare as a tuple.
    named = TaggedCollaboration(2, ["writer", "critic"])
    assert named.role_names == ("writer", "critic") and named.names == ("writer", "critic")
    assert hash(named) == hash(TaggedCollaboration(2, ("writer", "critic")))


def test_a_checkpoint_records_the_format_and_the_roles():
    assert TaggedCollaboration(2).describe() == {"format": "tagged", "roles": ["agent_0", "agent_1"]}
    assert SeparatedCollaboration(2, ("w", "c"), "|").describe() == {"format": "separated", "roles": ["w", "c"],
                                                                    "separator": "|"}
    assert as_adapter(Original(), 2).describe() == {"format": "custom:Original", "roles": ["agent_0", "agent_1"]}


# ----- the joint prompt and the completion a format writes -----------------------------------------
def test_the_joint_prompt_written_out():
    tagged = TaggedCollaboration(2, ["writer", "critic"]).build_prompt({"prompt": "unused"}, ["w task", "c task"])
    assert tagged == ("Write the responses of 2 roles in one reply. Each role has its own task.\n\n"
                      "writer: w task\n\ncritic: c task\n\n"
                      "Put each role's response between its tags, each role exactly once:\n"
                      "<writer>\nresponse of writer\n</writer>\n<critic>\nresponse of critic\n</critic>\n")
    separated = SeparatedCollaboration(3, separator="\n===\n").build_prompt({}, ["p", "q", "r"])
    assert separated == ("Write the responses of 3 roles in one reply. Each role has its own task.\n\n"
                         "agent_0: p\n\nagent_1: q\n\nagent_2: r\n\n"
                         "Write the responses in role order (agent_0, agent_1, agent_2), separating each from the next "
                         "with ===\n")
    assert refusal(ValueError, TaggedCollaboration(2).build_prompt, {}, ["only one"]) == (
        f"TaggedCollaboration: role_prompts must hold one entry per role (2: {TWO}), got ['only one']")


def test_the_completion_each_format_writes():
    assert TaggedCollaboration(2).format_completion(["x", "y z"]) == "<agent_0>\nx\n</agent_0>\n<agent_1>\ny z\n</agent_1>"
    assert SeparatedCollaboration(3, separator="|").format_completion(["a", "", "c"]) == "a||c"
    # A string of two characters is not two responses.
    assert refusal(ValueError, TaggedCollaboration(2).format_completion, "ab") == (
        f"TaggedCollaboration: responses must hold one entry per role (2: {TWO}), got 'ab'")
    assert refusal(ValueError, SeparatedCollaboration(2).format_completion, ["a", "b", "c"]) == (
        f"SeparatedCollaboration: responses must hold one entry per role (2: {TWO}), got ['a', 'b', 'c']")


# ----- parsing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("adapter", [TaggedCollaboration(2), SeparatedCollaboration(2), as_adapter(Original(), 2)],
                         ids=["tagged", "separated", "custom"])
def test_a_parse_for_another_number_of_roles_is_refused(adapter):
    owner = type(adapter).__name__
    completion = {"tagged": "<agent_0>a</agent_0><agent_1>b</agent_1>", "separated": "a\n===\nb"}.get(
        adapter.format_name, "a/b")
    assert refusal(ValueError, adapter.parse_completion, completion, None, 3) == f"{owner} parses 2 roles, asked for 3"
    assert adapter.parse_completion(completion, None, 2) == ["a", "b"]


def test_the_tagged_failure_message_written_out():
    error = parse_failure(TaggedCollaboration(2), "x</agent_0><agent_1>b")
    # Both roles are spoiled (a stray closing tag, an unclosed section): neither is reported missing.
    assert str(error) == (f"joint completion does not split into the 2 roles {TWO} (tagged format): "
                          "</agent_0> without its opening <agent_0>; <agent_1> is never closed; "
                          "completion: 'x</agent_0><agent_1>b'")
    assert error.responses == ["", ""]
    unknown = parse_failure(TaggedCollaboration(2, ("w", "c")), "<w>1</w><c>2</c><zz>")
    assert "unknown role tag <zz> (roles: w, c); completion:" in str(unknown) and unknown.responses == ["1", "2"]


def test_a_role_opened_again_inside_its_own_section_spoils_it():
    error = parse_failure(TaggedCollaboration(2), "<agent_0>a<agent_0>b</agent_0><agent_1>c</agent_1>")
    assert str(error) == (f"joint completion does not split into the 2 roles {TWO} (tagged format): "
                          "<agent_0> inside the section of agent_0 (close </agent_0> first); completion: "
                          "'<agent_0>a<agent_0>b</agent_0><agent_1>c</agent_1>'")
    assert error.responses == ["", "c"]
    # Another role's closing tag inside a section is no close either.
    crossed = parse_failure(TaggedCollaboration(2), "<agent_0>a</agent_1>b</agent_0>")
    assert "</agent_1> inside the section of agent_0 (close </agent_0> first)" in str(crossed)
    assert crossed.responses == ["", ""]


def test_a_long_completion_is_cut_at_120_characters_in_the_message():
    adapter = SeparatedCollaboration(2, separator="|")
    exact = "e" * 120
    assert str(parse_failure(adapter, exact)).endswith(f"completion: '{exact}'")
    longer = "e" * 121
    assert str(parse_failure(adapter, longer)).endswith(f"completion: '{exact}...'")


def test_the_separated_failure_messages_written_out():
    adapter = SeparatedCollaboration(3, separator="|")
    few = parse_failure(adapter, "a")
    assert str(few) == ("joint completion does not split into the 3 roles ['agent_0', 'agent_1', 'agent_2'] "
                        "(separated format): missing role(s) agent_1, agent_2: 1 section(s) for 3 roles, separated by "
                        "'|'; completion: 'a'")
    assert few.responses == ["a", "", ""]
    many = parse_failure(adapter, "a|b|c|d|e")
    assert ("2 section(s) beyond the last role agent_2 (the separator '|' appears 4 times); completion: 'a|b|c|d|e'"
            in str(many))
    assert many.responses == ["a", "b", "c"]


# ----- the built-in adapters a config names, and the adapters a user passes ---------------------------
def test_build_adapter_gives_the_named_format_with_its_roles():
    separated = build_adapter(2, "separated", ["w", "c"])
    assert isinstance(separated, SeparatedCollaboration)
    assert separated.names == ("w", "c") and separated.separator == "\n===\n"
    tagged = build_adapter(2, role_names=["w", "c"])
    assert isinstance(tagged, TaggedCollaboration) and tagged.names == ("w", "c")
    assert build_adapter(2, "separated", separator="|").parse_completion("a|b") == ["a", "b"]
    assert refusal(ValueError, build_adapter, 2, "json") == (
        "collaboration_format must be one of ['tagged', 'separated'], got 'json'")


def test_as_adapter_keeps_an_adapter_of_the_right_size_and_refuses_another():
    adapter = TaggedCollaboration(2)
    assert as_adapter(adapter, 2) is adapter
    assert refusal(ValueError, as_adapter, adapter, 3) == (
        "the collaboration adapter has 2 roles but the config has num_agents=3 roles")


def test_an_original_adapter_is_called_with_the_row_and_the_role_count():
    inner = Original()
    adapter = as_adapter(inner, 2)
    row = {"prompt": "the row"}
    assert adapter.build_prompt(row, ("a", "b")) == "a | b"
    assert adapter.parse_completion("x/y", row) == ["x", "y"]
    assert inner.calls == [("build", row, ["a", "b"]), ("parse", "x/y", row, 2)]
    for answer in ("", "   "):
        assert refusal(ValueError, as_adapter(Original(answer=answer), 2).build_prompt, row, ["a", "b"]) == (
            f"Original.build_prompt must return a non-empty string, got {answer!r}")


def test_an_original_adapters_refusals():
    failed = parse_failure(as_adapter(Original(), 2), "none")
    assert str(failed) == (f"joint completion does not split into the 2 roles {TWO} (custom format): "
                           "Original.parse_completion raised ValueError: no slash; completion: 'none'")
    assert failed.responses == ["", ""]
    # Its own parse error with what it could read is passed on as it is.
    own = CollaborationParseError("half read", ["a", ""])
    assert parse_failure(as_adapter(Original(error=own), 2), "a") is own
    assert split_completions(as_adapter(Original(error=own), 2), ["a"], [{}]) == ([["a"], [""]], [True])
    # One string is one output, not its characters; every output must be a string.
    for answer in ("ab", ["a", 3], ["a"]):
        assert refusal(TypeError, as_adapter(Original(answer=answer), 2).parse_completion, "x") == (
            f"Original.parse_completion must return 2 strings, got {list(answer) if answer != 'ab' else ['ab']!r}")


# ----- splitting a batch --------------------------------------------------------------------------
def test_split_completions_gives_each_parse_its_row_and_the_role_count():
    adapter = Recording(2)
    rows = [{"id": 0}, {"id": 1}]
    per_role, failed = split_completions(adapter, ["a b", "c"], rows)
    assert per_role == [["a", "c"], ["b", ""]] and failed == [False, True]
    assert adapter.calls == [("a b", rows[0], 2), ("c", rows[1], 2)]
    assert split_completions(adapter, ["a b", "c"], rows, on_failure="empty") == ([["a", ""], ["b", ""]], [False, True])
    assert refusal(ValueError, split_completions, adapter, ["a b"], rows) == "1 completions but 2 rows"
    assert refusal(ValueError, split_completions, adapter, ["a b"], rows[:1], "skip") == (
        "on_failure must be one of ['partial', 'empty', 'raise'], got 'skip'")


def test_the_role_callbacks_pass_on_the_row_and_the_failure_policy():
    adapter = Recording(2)
    row = {"id": 7}
    sample = CallbackSample(0, "p", "only", torch.zeros(1), torch.zeros(1), {"batch_item": row, "turn_idx": 0})
    seen = role_samples_callback(adapter, lambda samples: [(s.agent_idx, s.completion) for s in samples],
                                 on_failure="raise")
    with pytest.raises(CollaborationParseError, match="not one word per role"):
        seen([sample])
    assert adapter.calls == [("only", row, 2)]
    partial = role_samples_callback(adapter, lambda samples: [(s.agent_idx, s.completion) for s in samples])
    assert partial([sample]) == [(0, "only"), (1, "")]
    empty = role_samples_callback(adapter, lambda samples: [(s.agent_idx, s.completion) for s in samples], "empty")
    assert empty([sample]) == [(0, ""), (1, "")]

    received = {}

    def eval_logger(agent_completions_turns, batch_items, prompts):
        received.update(turns=agent_completions_turns, items=batch_items, prompts=prompts)
        return ["logged"]

    items = [{"id": 1}, {"id": 2}]
    joint = [["a b", "half"], ["c d", "e f"]]  # [row][turn]
    assert role_eval_logger(adapter, eval_logger, "empty")(agent_completions_turns=[joint], batch_items=items,
                                                         prompts=["p", "q"]) == ["logged"]
    assert received == {"turns": [[["a", ""], ["c", "e"]], [["b", ""], ["d", "f"]]], "items": items,
                        "prompts": ["p", "q"]}
    assert adapter.calls[-4:] == [("a b", items[0], 2), ("half", items[0], 2), ("c d", items[1], 2),
                                  ("e f", items[1], 2)]
    default = role_eval_logger(adapter, lambda **kwargs: kwargs["agent_completions_turns"])
    assert default(agent_completions_turns=[joint], batch_items=items)[0] == [["a", "half"], ["c", "e"]]  # partial
