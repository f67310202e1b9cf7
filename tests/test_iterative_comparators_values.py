"""Iterative preference training's comparators and iteration loop against values computed in the test
(docs/mutation.md, "Above the maths: the comparators, the iteration loop and the reward histogram"): the token IDs
a comparator stores, the settings and requests of an OpenAI-compatible endpoint (a scripted server on loopback)
and its refusals word for word, which history snapshot iteration ``i`` loads with ``k``, what each
``comparator_policy`` builds, and an iteration's prepared reference log-probabilities and DPO stage by hand."""

from __future__ import annotations

import json
import logging
import math
import shutil
import socket
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from loopback_http import JSONEndpoint, Reply
from tokenizers.processors import TemplateProcessing
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.data import format_prompt
from comlrl.rollout import preferences
from comlrl.rollout.collaboration import as_adapter, build_adapter
from comlrl.rollout.generation import Generation
from comlrl.tasks.letters import letters_reward
from comlrl.trainers.preference import MADPOConfig, MADPOIterConfig, MADPOIterTrainer
from comlrl.trainers.preference import comparators as cmp
from comlrl.trainers.preference import reward_histogram as rh
from comlrl.utils import set_reward_range
from test_iterative import PROMPTS, TINY, build

ROWS = [{"prompt": p} for p in PROMPTS]


# ----- the token IDs a comparator stores ---------------------------------------------------------------
def generation(ids: list[list[int]], mask: list[list[int]], texts: list[str]) -> Generation:
    return Generation(prompt_ids=torch.zeros((len(ids), 1), dtype=torch.long),
                      prompt_mask=torch.ones((len(ids), 1), dtype=torch.long),
                      completion_ids=torch.tensor(ids), completion_mask=torch.tensor(mask), texts=texts,
                      num_generations=1)


def test_sampled_ids_keep_the_unmasked_tokens_and_eos_ends_only_a_finished_row(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    eos = tokenizer.eos_token_id
    rows = generation([[5, 7, eos, 0], [8, 9, 10, 11], [eos, 0, 0, 0], [eos, 0, 0, 0]],
                      [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], ["a", "b", "c", "d"])
    assert cmp.sampled_ids(rows) == [[5, 7, eos], [8, 9, 10, 11], [eos], []]
    assert cmp.ended_with_eos(rows, tokenizer) == [True, False, True, False]  # an empty row did not finish


def test_text_ids_tokenize_each_text_alone_and_append_eos_where_it_finished(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    texts = ["cat sun", "the road", ""]
    expected = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    expected[0] = expected[0] + [tokenizer.eos_token_id]
    expected[2] = expected[2] + [tokenizer.eos_token_id]
    assert cmp.text_ids(tokenizer, texts, [True, False, True]) == expected
    assert expected[1] and tokenizer.eos_token_id not in expected[1]
    with pytest.raises(ValueError):  # a text without its finish flag is a mistake, not a shorter list
        cmp.text_ids(tokenizer, texts, [True, False])
    bos = tokenizer.convert_ids_to_tokens(1)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 1)])
    assert tokenizer("cat sun")["input_ids"] == [1] + expected[0][:-1]  # this tokenizer adds a BOS...
    assert cmp.text_ids(tokenizer, texts[:1], [False]) == [expected[0][:-1]]  # ...which a completion does not get


class SeveralEOS:
    """A tokenizer object whose ``eos_token_id`` is a list of two IDs (the agent's EOS first)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = [tokenizer.eos_token_id, 5]

    def __call__(self, text, **options):
        return self.tokenizer(text, **options)


def test_text_ids_end_a_finished_text_with_the_first_of_several_eos(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert cmp.text_ids(SeveralEOS(tokenizer), ["cat sun"], [True]) == [
        tokenizer("cat sun", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]


class NoVocabulary:
    """A tokenizer that does not tell its vocabulary (no get_vocab)."""

    eos_token_id = 2


def test_same_vocabulary_needs_the_same_tokens_and_eos(tiny_llama, tiny_gpt2):
    mine = AutoTokenizer.from_pretrained(tiny_llama)
    again = AutoTokenizer.from_pretrained(tiny_llama)
    other_eos = AutoTokenizer.from_pretrained(tiny_llama)
    other_eos.eos_token = other_eos.convert_ids_to_tokens(5)
    assert cmp.same_vocabulary(mine, mine) and cmp.same_vocabulary(mine, again)
    assert not cmp.same_vocabulary(mine, AutoTokenizer.from_pretrained(tiny_gpt2))
    assert not cmp.same_vocabulary(mine, other_eos) and other_eos.get_vocab() == mine.get_vocab()
    blind = NoVocabulary()
    assert cmp.same_vocabulary(blind, blind)
    assert not cmp.same_vocabulary(blind, NoVocabulary())
    assert not cmp.same_vocabulary(mine, blind)


def test_agent_ids_keep_the_sampled_ids_or_retokenize_the_text(tiny_llama, tiny_gpt2):
    agent = AutoTokenizer.from_pretrained(tiny_llama)
    source = AutoTokenizer.from_pretrained(tiny_gpt2)
    eos = source.eos_token_id
    rows = generation([[30, 31, eos], [40, 41, 42]], [[1, 1, 1], [1, 1, 1]], ["the cat", "a sun"])
    assert cmp.agent_ids(rows, agent, AutoTokenizer.from_pretrained(tiny_llama)) == [[30, 31, eos], [40, 41, 42]]
    assert cmp.agent_ids(rows, source, agent) == [
        agent("the cat", add_special_tokens=False)["input_ids"] + [agent.eos_token_id],
        agent("a sun", add_special_tokens=False)["input_ids"]]


def test_comparator_devices_one_per_agent():
    cpu = torch.device("cpu")
    agents = [cpu, cpu]
    assert cmp.comparator_devices(None, agents) == agents and cmp.comparator_devices(None, agents) is not agents
    assert cmp.comparator_devices("cpu", agents) == [cpu, cpu]
    assert cmp.comparator_devices("cpu", [cpu, cpu, cpu]) == [cpu, cpu, cpu]
    assert cmp.comparator_devices(["cpu", "cpu"], agents) == [cpu, cpu]
    meta = torch.device("meta")  # a device other than the agents' (on any machine)
    assert cmp.comparator_devices("meta", agents) == [meta, meta]
    assert cmp.comparator_devices(["cpu", "meta"], agents) == [cpu, meta]


# ----- the endpoint's settings ------------------------------------------------------------------------
def api_config(url: str = "http://127.0.0.1:9/v1", **options) -> MADPOIterConfig:
    return MADPOIterConfig(**{**TINY, "comparator_policy": "api", "comparator_api_url": url, **options})


def test_api_settings_from_the_config(monkeypatch):
    settings = cmp.APISettings.from_config(api_config(
        "http://host:8/v1/", comparator_api_model="m", comparator_api_timeout=7, comparator_api_retries=3,
        comparator_api_retry_backoff=0.25, comparator_api_concurrency=5, comparator_api_max_n_per_request=2,
        comparator_api_headers={"X-Team": "a"}, comparator_api_key="k1", comparator_api_extra_body={"stop": ["x"]}))
    assert settings == cmp.APISettings(
        url="http://host:8/v1/chat/completions", api_format="chat", model="m", timeout=7.0, retries=3,
        retry_backoff=0.25, concurrency=5, max_n_per_request=2,
        headers={"Content-Type": "application/json", "X-Team": "a", "Authorization": "Bearer k1"},
        extra_body={"stop": ["x"]})
    assert type(settings.timeout) is float and type(settings.retries) is int and type(settings.concurrency) is int
    plain = cmp.APISettings.from_config(api_config("http://host:8/v1", comparator_api_format="completions"))
    assert (plain.url, plain.model, plain.headers, plain.extra_body, plain.max_n_per_request) == (
        "http://host:8/v1/completions", None, {"Content-Type": "application/json"}, {}, None)
    assert (plain.timeout, plain.retries, plain.retry_backoff, plain.concurrency) == (120.0, 2, 1.0, 4)
    assert cmp.APISettings.from_config(api_config("http://host:8/apiX/")).url == "http://host:8/apiX/chat/completions"
    full = cmp.APISettings.from_config(api_config("http://host:8/v1/chat/completions"))
    assert full.url == "http://host:8/v1/chat/completions"  # a full endpoint is kept as given
    bare = cmp.APISettings.from_config(api_config(comparator_api_key="k2", comparator_api_key_prefix=" ",
                                                  comparator_api_key_header="X-Key"))
    assert bare.headers == {"Content-Type": "application/json", "X-Key": "k2"}
    token = cmp.APISettings.from_config(api_config(comparator_api_key="k3", comparator_api_key_prefix=" Token "))
    assert token.headers["Authorization"] == "Token k3"
    monkeypatch.setenv("COMPARATOR_TEST_KEY", "k4")
    config = api_config(comparator_api_key_env="COMPARATOR_TEST_KEY")
    assert cmp.APISettings.from_config(config).headers["Authorization"] == "Bearer k4"
    given = api_config(comparator_api_key="k5", comparator_api_key_env="COMPARATOR_TEST_KEY")
    assert cmp.APISettings.from_config(given).headers["Authorization"] == "Bearer k5"  # the key itself wins
    monkeypatch.delenv("COMPARATOR_TEST_KEY")
    with pytest.raises(ValueError) as error:
        cmp.APISettings.from_config(config)
    assert str(error.value) == "comparator_api_key_env='COMPARATOR_TEST_KEY': that environment variable is not set"


def test_answer_choices_read_the_text_and_how_it_ended():
    chat = cmp.APISettings.from_config(api_config())
    answer = {"choices": [
        {"message": {"content": "a"}, "finish_reason": "stop"},
        {"text": "b", "finish_reason": "length"},
        {"message": {"content": None}, "text": "c"},
        {"message": {"content": "d"}, "text": "not this", "finish_reason": "eos"},
        {"text": "e", "finish_reason": "max_tokens"},
        {"text": 5, "finish_reason": "eos_token"},
        {"text": "g", "finish_reason": "content_filter"},
    ]}
    assert cmp.answer_choices(chat, answer) == [
        cmp.APICompletion("a", True), cmp.APICompletion("b", False), cmp.APICompletion("c", None),
        cmp.APICompletion("d", True), cmp.APICompletion("e", False), cmp.APICompletion("5", True),
        cmp.APICompletion("g", None)]
    completions = cmp.APISettings.from_config(api_config(comparator_api_format="completions"))
    assert cmp.answer_choices(completions, {"choices": [{"message": {"content": "m"}, "text": "t"}]}) == [
        cmp.APICompletion("t", None)]
    url = completions.url
    with pytest.raises(cmp.ComparatorAPIError) as error:
        cmp.answer_choices(completions, {"choices": [{"message": {"content": "m"}}]})
    assert str(error.value) == f"comparator API {url}: a choice without text: {{'message': {{'content': 'm'}}}}"
    with pytest.raises(cmp.ComparatorAPIError) as error:
        cmp.answer_choices(chat, ["x"])
    assert str(error.value) == f"comparator API {chat.url} answered without a 'choices' list: ['x']"
    with pytest.raises(cmp.ComparatorAPIError) as error:
        cmp.answer_choices(chat, {"choices": "x" * 400})
    assert str(error.value) == (f"comparator API {chat.url} answered without a 'choices' list: "
                                + str({"choices": "x" * 400})[:300])
    with pytest.raises(cmp.ComparatorAPIError, match="a choice without text: x"):
        cmp.answer_choices(chat, {"choices": ["x"]})
    long_choice = {"message": {"content": None}, "note": "n" * 300}
    with pytest.raises(cmp.ComparatorAPIError) as error:
        cmp.answer_choices(chat, {"choices": [long_choice]})
    assert str(error.value) == f"comparator API {chat.url}: a choice without text: {str(long_choice)[:200]}"


# ----- a scripted endpoint on loopback ----------------------------------------------------------------
class ScriptedServer(JSONEndpoint):
    """Answers each POST with the next scripted reply (status, body, delay, cut); records every request."""

    def __init__(self) -> None:
        self.replies: list[Reply] = []
        self.requests: list[tuple[str, dict[str, str], dict]] = []
        self.default = None  # a function of the request body giving a JSON reply when the script is empty
        self.start()

    def answer(self, path: str, headers: dict[str, str], body: dict) -> Reply:
        self.requests.append((path, headers, body))
        return self.replies.pop(0) if self.replies else Reply.json(self.default(path, body))

    def script(self, *replies) -> None:
        self.replies = [Reply(status, data if isinstance(data, bytes) else json.dumps(data).encode(), delay, cut)
                        for status, data, delay, cut in replies]


@pytest.fixture
def scripted():
    server = ScriptedServer()
    yield server
    server.close()


def settings_for(url: str, **options) -> cmp.APISettings:
    return cmp.APISettings.from_config(api_config(url, comparator_api_retry_backoff=0.5, **options))


@pytest.fixture
def sleeps(monkeypatch):
    """The backoff waits the client asks for (recorded, not slept)."""
    waited: list[float] = []
    monkeypatch.setattr(cmp.time, "sleep", waited.append)
    return waited


def test_post_json_sends_the_body_and_headers_and_returns_the_answer(scripted, sleeps):
    settings = settings_for(scripted.url, comparator_api_key="k")
    scripted.script((200, {"choices": []}, 0.0, False))
    assert cmp.post_json(settings, {"n": 2, "prompt": "é"}) == {"choices": []}
    path, headers, body = scripted.requests[0]
    assert path == "/v1/chat/completions" and body == {"n": 2, "prompt": "é"}
    assert headers["Authorization"] == "Bearer k" and headers["Content-Type"] == "application/json"
    assert sleeps == []


def test_post_json_refuses_an_answer_that_is_not_json_without_retrying(scripted, sleeps):
    settings = settings_for(scripted.url, comparator_api_retries=2)
    scripted.script((200, b"oops" * 100, 0.0, False))
    with pytest.raises(cmp.ComparatorAPIError) as error:
        cmp.post_json(settings, {})
    assert str(error.value) == f"comparator API {settings.url} answered with non-JSON: {('oops' * 100)[:300]!r}"
    assert len(scripted.requests) == 1 and sleeps == []
    scripted.script((200, b"\xff\xfe{", 0.0, False))  # bytes that are not UTF-8 are replaced, then refused
    with pytest.raises(cmp.ComparatorAPIError) as error:
        cmp.post_json(settings, {})
    assert str(error.value) == f"comparator API {settings.url} answered with non-JSON: '\ufffd\ufffd{{'"


def test_post_json_does_not_retry_a_refused_request(scripted, sleeps):
    settings = settings_for(scripted.url, comparator_api_retries=2)
    scripted.script((404, b"x" * 400, 0.0, False))
    with pytest.raises(cmp.ComparatorAPIError) as error:
        cmp.post_json(settings, {})
    assert str(error.value) == (f"comparator API {settings.url} refused the request with HTTP 404 Not Found: "
                                f"{'x' * 300}; check comparator_api_url, comparator_api_model and the key")
    assert len(scripted.requests) == 1 and sleeps == []
    scripted.script((400, b"bad \xff", 0.0, False))  # an error body that is not UTF-8 is shown replaced
    with pytest.raises(cmp.ComparatorAPIError, match="refused the request with HTTP 400 Bad Request: bad \ufffd; check"):
        cmp.post_json(settings, {})


def test_post_json_retries_busy_and_failing_servers_with_a_doubling_backoff(scripted, sleeps, caplog):
    settings = settings_for(scripted.url, comparator_api_retries=3)
    scripted.script((429, b"slow down", 0.0, False), (500, b"crashed", 0.0, False), (503, b"busy", 0.0, False),
                    (200, {"ok": 1}, 0.0, False))
    with caplog.at_level(logging.WARNING, logger=cmp.__name__):
        assert cmp.post_json(settings, {}) == {"ok": 1}
    assert len(scripted.requests) == 4 and sleeps == [0.5, 1.0, 2.0]
    assert [r.getMessage() for r in caplog.records] == [
        f"comparator API {settings.url}: HTTP 429 Too Many Requests: slow down; retrying (1/3)",
        f"comparator API {settings.url}: HTTP 500 Internal Server Error: crashed; retrying (2/3)",
        f"comparator API {settings.url}: HTTP 503 Service Unavailable: busy; retrying (3/3)"]
    scripted.requests.clear()
    sleeps.clear()
    scripted.script(*[(503, b"busy", 0.0, False)] * 4)
    with pytest.raises(cmp.ComparatorAPIError) as error:
        cmp.post_json(settings, {})
    assert str(error.value) == (
        f"comparator API {settings.url} failed after 4 attempt(s): HTTP 503 Service Unavailable: busy. Training "
        "stopped before this stage finished; the last checkpoint is intact: resume from it once the endpoint answers")
    assert len(scripted.requests) == 4 and sleeps == [0.5, 1.0, 2.0]  # no wait after the last attempt


def test_post_json_names_a_timeout(scripted, sleeps):
    settings = settings_for(scripted.url, comparator_api_retries=0, comparator_api_timeout=0.2)
    scripted.script((200, {"late": True}, 1.0, False))
    with pytest.raises(cmp.ComparatorAPIError) as error:
        cmp.post_json(settings, {})
    assert str(error.value).startswith(f"comparator API {settings.url} failed after 1 attempt(s): no answer within "
                                       "comparator_api_timeout=0.2 s. Training stopped")


def test_post_json_names_a_connection_that_is_never_accepted_as_a_timeout(sleeps):
    """A listening socket whose backlog is full: the connection attempt itself times out."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        waiting = []
        for _ in range(3):
            client = socket.socket()
            client.setblocking(False)
            client.connect_ex(("127.0.0.1", port))
            waiting.append(client)
        settings = settings_for(f"http://127.0.0.1:{port}/v1", comparator_api_retries=0, comparator_api_timeout=0.3)
        try:
            with pytest.raises(cmp.ComparatorAPIError) as error:
                cmp.post_json(settings, {})
        finally:
            for client in waiting:
                client.close()
    assert str(error.value).startswith(f"comparator API {settings.url} failed after 1 attempt(s): no answer within "
                                       "comparator_api_timeout=0.3 s. Training stopped")


def test_post_json_names_a_refused_connection_and_a_cut_answer(scripted, sleeps):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    closed = settings_for(f"http://127.0.0.1:{port}/v1", comparator_api_retries=1)
    with pytest.raises(cmp.ComparatorAPIError) as error:
        cmp.post_json(closed, {})
    assert str(error.value).startswith(f"comparator API {closed.url} failed after 2 attempt(s): connection failed (")
    assert "Connection refused" in str(error.value) and sleeps == [0.5]
    cut = settings_for(scripted.url, comparator_api_retries=0)
    scripted.script((200, b'{"choices": [', 0.0, True))  # the body ends before its Content-Length
    with pytest.raises(cmp.ComparatorAPIError) as error:
        cmp.post_json(cut, {})
    assert str(error.value).startswith(f"comparator API {cut.url} failed after 1 attempt(s): connection failed "
                                       "(IncompleteRead: ")


# ----- the API comparator's requests and samples --------------------------------------------------------
@pytest.fixture(scope="module")
def api_trainer(tiny_llama):
    return build(tiny_llama, comparator_policy="api", comparator_api_url="http://127.0.0.1:9/v1",
                 max_new_tokens=4, temperature=0.7, top_p=0.9)


def test_request_body_per_format(api_trainer):
    spec = api_trainer.policy_trainer.rollout_spec
    chat = cmp.APIComparator(cmp.APISettings.from_config(api_config(comparator_api_model="m")))
    assert chat.request_body("hi", 3, spec) == {"n": 3, "max_tokens": 4, "temperature": 0.7, "top_p": 0.9,
                                                "model": "m", "messages": [{"role": "user", "content": "hi"}]}
    plain = cmp.APIComparator(cmp.APISettings.from_config(api_config(
        comparator_api_format="completions", comparator_api_extra_body={"temperature": 0.0, "seed": 1})))
    assert plain.request_body("hi", 2, spec) == {"n": 2, "max_tokens": 4, "temperature": 0.0, "top_p": 0.9,
                                                 "prompt": "hi", "seed": 1}


def numbered(path: str, body: dict) -> dict:
    """n choices named after the prompt and the request's order; even ones finished, odd ones cut."""
    prompt = body["messages"][0]["content"] if "messages" in body else body["prompt"]
    return {"choices": [{"message": {"content": f"{prompt[-3:]} {i}"},
                         "finish_reason": "stop" if i % 2 == 0 else "length"} for i in range(body["n"])]}


def test_completions_are_asked_in_chunks_of_max_n_and_an_empty_answer_is_refused(scripted, api_trainer):
    spec = api_trainer.policy_trainer.rollout_spec
    comparator = cmp.APIComparator(settings_for(scripted.url, comparator_api_max_n_per_request=2))
    scripted.default = numbered
    got = comparator.completions("the cat", 5, spec)
    assert [body["n"] for _, _, body in scripted.requests] == [2, 2, 1]
    assert got == [cmp.APICompletion("cat 0", True), cmp.APICompletion("cat 1", False),
                   cmp.APICompletion("cat 0", True), cmp.APICompletion("cat 1", False), cmp.APICompletion("cat 0", True)]
    scripted.requests.clear()
    scripted.script((200, {"choices": [{"text": str(i)} for i in range(4)]}, 0.0, False))
    unlimited = cmp.APIComparator(settings_for(scripted.url))
    assert [c.text for c in unlimited.completions("x", 3, spec)] == ["0", "1", "2"]  # extra choices are dropped
    assert [body["n"] for _, _, body in scripted.requests] == [3]
    scripted.script((200, {"choices": []}, 0.0, False))
    with pytest.raises(cmp.ComparatorAPIError) as error:
        comparator.completions("x", 3, spec)
    assert str(error.value) == f"comparator API {comparator.settings.url} returned no completions (asked n=2)"


def test_api_sample_gives_every_agents_prompts_in_row_order(scripted, api_trainer, caplog):
    policy = api_trainer.policy_trainer
    spec = policy.rollout_spec.replace(num_generations=2)
    comparator = cmp.APIComparator(settings_for(scripted.url, comparator_api_concurrency=3))
    scripted.default = numbered
    labels = [5, 6, 7, 8]
    samples = comparator.sample(policy, spec, ROWS, labels)
    for agent, tokenizer in enumerate(policy.tokenizers):
        prompts = [format_prompt(spec.formatters[agent], row, agent, label) for row, label in zip(ROWS, labels)]
        texts = [f"{prompt[-3:]} {k}" for prompt in prompts for k in range(2)]
        assert samples.texts[agent] == texts
        assert samples.token_ids[agent] == [tokenizer(t, add_special_tokens=False)["input_ids"]
                                            + ([tokenizer.eos_token_id] if k % 2 == 0 else [])
                                            for t, k in zip(texts, [0, 1] * 4)]
    assert len(scripted.requests) == 2 * len(ROWS) and not comparator.warned_unknown_finish
    assert not [r for r in caplog.records if "finish_reason" in r.getMessage()]
    scripted.default = lambda path, body: {"choices": [{"message": {"content": "x"}} for _ in range(body["n"])]
                                                      + [{"message": {"content": "y"}, "finish_reason": "stop"}]}
    with caplog.at_level(logging.WARNING, logger=cmp.__name__):
        comparator.sample(policy, spec, ROWS, labels)
        comparator.sample(policy, spec, ROWS, labels)
    warnings = [r.getMessage() for r in caplog.records if "finish_reason" in r.getMessage()]
    assert warnings == [
        f"comparator API {comparator.settings.url} did not say how 16 of 16 completions ended (no finish_reason "
        "'stop' or 'length'); they are stored without EOS, as if cut at max_tokens, so a pair against the policy's "
        "completions (which keep their EOS) is scored without the comparator side's EOS term; use an endpoint that "
        "reports finish_reason"]
    assert comparator.state_dict() == {} and comparator.kind == "api"


# ----- the history comparator: which snapshot iteration i loads with k ----------------------------------
def agent_weights(models) -> list[dict[str, torch.Tensor]]:
    return [{k: v.detach().clone() for k, v in model.state_dict().items()} for model in models]


def same(a, b) -> bool:
    return all(a_[k].shape == b_[k].shape and torch.equal(a_[k], b_[k]) for a_, b_ in zip(a, b) for k in a_) \
        and len(a) == len(b)


def test_history_snapshots_and_the_policy_of_k_iterations_ago(tiny_llama, tmp_path):
    trainer = build(tiny_llama, comparator_policy="history", comparator_history_k=2, output_dir=str(tmp_path / "out"))
    policy, history = trainer.policy_trainer, trainer.comparator
    assert (history.kind, history.k, history.directory, history.sources, history.models, history.tokenizers) == (
        "history", 2, None, [], None, None)  # nothing loaded before the first iteration
    with pytest.raises(RuntimeError) as error:
        history.begin(0, policy)
    assert str(error.value) == ("the history comparator has no snapshot directory (set output_dir or "
                                "policy_checkpoint_dir)")
    history.use_output_dir(tmp_path / "run")
    history.use_output_dir(tmp_path / "elsewhere")  # the first directory stays
    root = tmp_path / "run" / "policies"
    assert history.directory == root
    assert [history.source_iteration(i) for i in range(5)] == [0, 0, 0, 1, 2]
    entering = {}
    for iteration in range(4):
        entering[iteration] = agent_weights(policy.agents)
        history.begin(iteration, policy)
        source = max(iteration - 2, 0)
        assert history.sources == [str(root / f"iteration_{source:04d}" / f"agent_{i}") for i in range(2)]
        assert same(agent_weights(history.models), entering[source])
        assert all(not m.training and not any(p.requires_grad for p in m.parameters()) for m in history.models)
        assert history.tokenizers is policy.tokenizers
        history.end()
        assert (history.models, history.tokenizers, history.sources) == (None, None, [])
        with torch.no_grad():  # the policy moves between iterations
            for agent in policy.agents:
                for parameter in agent.parameters():
                    parameter.add_(0.01 * (iteration + 1))
    written = {i: str(root / f"iteration_{i:04d}") for i in range(4)}
    for i in range(4):
        saved = [AutoModelForCausalLM.from_pretrained(Path(written[i]) / f"agent_{a}") for a in range(2)]
        assert same(agent_weights(saved), entering[i])
    assert history.loaded_from == [(0, written[0]), (1, written[0]), (2, written[0]), (3, written[1])]
    state = history.state_dict()
    assert state == {"snapshots": {str(i): written[i] for i in range(4)},
                     "loaded_from": [[0, written[0]], [1, written[0]], [2, written[0]], [3, written[1]]]}
    resumed = cmp.HistoryComparator(2, policy.agent_devices, policy.dtype, policy.data_parallel, tmp_path / "new")
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint stores it
    assert resumed.snapshots == {i: written[i] for i in range(4)} and resumed.loaded_from == history.loaded_from
    resumed.begin(5, policy)  # iteration 5 compares against iteration 3's snapshot, written by the earlier run
    assert resumed.loaded_from[-1] == (5, written[3]) and (tmp_path / "new" / "iteration_0005" / "agent_1").is_dir()
    resumed.end()


def test_a_missing_history_snapshot_is_refused_naming_it(tiny_llama, tmp_path):
    trainer = build(tiny_llama, comparator_policy="history", comparator_history_k=2, output_dir=str(tmp_path / "out"),
                    policy_checkpoint_dir=str(tmp_path / "snapshots"))
    policy, history = trainer.policy_trainer, trainer.comparator
    assert history.directory == tmp_path / "snapshots"
    advice = ("which is missing; it is written at the start of every iteration under policy_checkpoint_dir (default "
              "output_dir/policies): keep those directories while the run may resume")
    with pytest.raises(FileNotFoundError) as error:
        history.begin(3, policy)  # iteration 1's snapshot was never written
    assert str(error.value) == f"the history comparator needs the policy snapshot of iteration 1 (never written), {advice}"
    for iteration in (0, 1):
        history.begin(iteration, policy)
        history.end()
    shutil.rmtree(tmp_path / "snapshots" / "iteration_0001" / "agent_1")
    with pytest.raises(FileNotFoundError) as error:
        history.begin(3, policy)
    assert str(error.value) == (f"the history comparator needs the policy snapshot of iteration 1 "
                                f"({tmp_path / 'snapshots' / 'iteration_0001'}), {advice}")
    assert history.loaded_from == [(i, str(tmp_path / "snapshots" / "iteration_0000")) for i in (0, 1)]


# ----- what each comparator_policy builds --------------------------------------------------------------
def test_each_comparator_policy_builds_its_comparator(tiny_llama, tiny_llama_b, tmp_path):
    current = build(tiny_llama)
    assert current.comparator is None and current.compat_settings()["comparator"] == "current"
    history = build(tiny_llama, comparator_policy="history", output_dir=str(tmp_path))
    assert history.comparator.k == 1 and history.compat_settings()["comparator"] == "history"
    assert history.comparator.data_parallel is history.policy_trainer.data_parallel
    model = build(tiny_llama, comparator_policy="model", comparator_agents=[tiny_llama_b, tiny_llama])
    assert model.comparator.sources == [tiny_llama_b, tiny_llama]
    expected = [AutoModelForCausalLM.from_pretrained(tiny_llama_b), AutoModelForCausalLM.from_pretrained(tiny_llama)]
    assert same(agent_weights(model.comparator.models), agent_weights(expected))
    assert all(not m.training for m in model.comparator.models)
    assert [t.get_vocab() for t in model.comparator.tokenizers] == [
        AutoTokenizer.from_pretrained(source).get_vocab() for source in (tiny_llama_b, tiny_llama)]
    assert model.compat_settings()["comparator"] == "model"
    api = build(tiny_llama, comparator_policy="api", comparator_api_url="http://127.0.0.1:9/v1/")
    assert api.comparator.settings.url == "http://127.0.0.1:9/v1/chat/completions"
    central = build(tiny_llama, comparator_policy="model", comparator_agents=[tiny_llama, tiny_llama_b],
                    comparator_generation_mode="centralized", comparator_centralized_agent_index=1,
                    comparator_parse_failure="empty")
    comparator = central.comparator
    assert (comparator.kind, comparator.index, comparator.parse_failure, comparator.source_index) == (
        "centralized_model", 1, "empty", 0)
    assert comparator.source.sources == [tiny_llama_b] and comparator.source.devices == [torch.device("cpu")]
    assert comparator.adapter.num_roles == 2
    hist = build(tiny_llama, comparator_policy="history", comparator_generation_mode="centralized",
                 comparator_centralized_agent_index=1, output_dir=str(tmp_path / "c"))
    assert (hist.comparator.kind, hist.comparator.source_index, hist.comparator.source.k) == ("centralized_history", 1, 1)
    with pytest.raises(ValueError) as error:
        MADPOIterTrainer(agent_model=tiny_llama, reward_func=letters_reward,
                         train_dataset=Dataset.from_dict({"prompt": PROMPTS}), args=MADPOIterConfig(**TINY),
                         centralized_comparator_adapter=build_adapter(2))
    assert str(error.value) == ("centralized_comparator_adapter is used only with comparator_generation_mode="
                                "'centralized', got 'decentralized'; set it, or leave the adapter out")


def tagged(path: str, body: dict) -> dict:
    """Joint answers in the tagged format, the n-th for each role; the last one unreadable."""
    n = body["n"]
    choices = [{"message": {"content": f"<agent_0>\nred {i}\n</agent_0>\n<agent_1>\nblue {i}\n</agent_1>"}}
               for i in range(n - 1)]
    return {"choices": choices + [{"message": {"content": "<agent_0>\nonly\n</agent_0>"}}]}


def test_a_centralized_api_comparator_splits_each_joint_answer(tiny_llama, scripted):
    trainer = build(tiny_llama, comparator_policy="api", comparator_api_url=scripted.url,
                    comparator_generation_mode="centralized", comparator_parse_failure="partial")
    policy, comparator = trainer.policy_trainer, trainer.comparator
    assert comparator.kind == "centralized_api" and comparator.state_dict() == {}
    scripted.default = tagged
    spec = policy.rollout_spec.replace(num_generations=3)
    labels = [0, 1, 2, 3]
    samples = comparator.sample(policy, spec, ROWS, labels)
    adapter = build_adapter(2)
    asked = [body["messages"][0]["content"] for _, _, body in scripted.requests]
    assert sorted(asked) == sorted(adapter.build_prompt(row, [format_prompt(spec.formatters[a], row, a, label)
                                                               for a in range(2)]) for row, label in zip(ROWS, labels))
    assert all(body["n"] == 3 for _, _, body in scripted.requests)
    assert samples.texts == [["red 0", "red 1", "only"] * 4, ["blue 0", "blue 1", ""] * 4]
    for agent, tokenizer in enumerate(policy.tokenizers):
        assert samples.token_ids[agent] == [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                                            for t in samples.texts[agent]]


def test_a_centralized_history_comparator_loads_and_frees_its_source(tiny_llama, tmp_path):
    trainer = build(tiny_llama, comparator_policy="history", comparator_generation_mode="centralized",
                    output_dir=str(tmp_path / "out"))
    comparator, policy = trainer.comparator, trainer.policy_trainer
    comparator.use_output_dir(tmp_path / "run")
    assert comparator.source.directory == tmp_path / "run" / "policies"
    comparator.begin(0, policy)
    assert comparator.source.sources == [str(tmp_path / "run" / "policies" / "iteration_0000" / f"agent_{i}")
                                         for i in range(2)]
    torch.manual_seed(4)
    samples = comparator.sample(policy, policy.rollout_spec.replace(num_generations=2), ROWS[:2], [0, 1])
    assert [len(texts) for texts in samples.texts] == [4, 4]
    comparator.end()
    assert comparator.source.models is None
    state = comparator.state_dict()
    assert state["snapshots"] == {"0": str(tmp_path / "run" / "policies" / "iteration_0000")}
    fresh = build(tiny_llama, comparator_policy="history", comparator_generation_mode="centralized",
                  output_dir=str(tmp_path / "out2"))
    fresh.comparator.load_state_dict(state)
    assert fresh.comparator.source.loaded_from == [(0, state["snapshots"]["0"])]


# ----- the iteration loop: prepared references and the DPO stage by hand ------------------------------
def completion_logprob(model, tokenizer, prompt: str, completion: list[int], prompt_tokens: int | None = None) -> float:
    """log p(completion | prompt) under ``model``, summed over the completion's tokens (no padding); with
    ``prompt_tokens``, after the prompt's last ``prompt_tokens`` tokens only."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][-(prompt_tokens or 0):]
    ids = torch.tensor([prompt_ids + completion])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    logprobs = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)
    return float(logprobs[torch.arange(len(completion)), torch.tensor(completion)].sum())


def test_prepared_references_and_the_dpo_stage_by_hand(tiny_llama):
    trainer = build(tiny_llama, num_iterations=1, dpo_batch_size=3, num_train_epochs=2, log_reward_distribution=True)
    initial = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    trainer.run_next_stage()
    pairs = trainer.pairs_by_iteration[0]
    assert len(pairs) > 3 and len(pairs) % 3 != 0  # the last micro-batch is a partial one
    trainer.run_next_stage()
    prepared = trainer.state.stage_records[-1]
    expected = torch.tensor([[[completion_logprob(initial, tokenizer, prompts[a], ids[a])
                               for prompts, ids in zip(pairs["agent_prompts"], pairs[f"{side}_ids"])]
                              for side in ("chosen", "rejected")] for a in range(2)])
    torch.testing.assert_close(trainer.reference, expected, rtol=1e-4, atol=1e-4)
    assert prepared["replay/pairs"] == len(pairs) and prepared["replay/iterations"] == 1.0
    assert prepared["reference/chosen_logprob_mean"] == pytest.approx(float(expected[:, 0].mean()), abs=1e-4)
    assert prepared["reference/rejected_logprob_mean"] == pytest.approx(float(expected[:, 1].mean()), abs=1e-4)
    chosen = list(pairs["chosen_reward"])
    assert prepared["distribution/train_chosen_reward_mean"] == pytest.approx(sum(chosen) / len(chosen))
    assert prepared["distribution/train_rejected_reward_max"] == pytest.approx(max(pairs["rejected_reward"]))
    trainer.run_next_stage()
    learned = trainer.state.stage_records[-1]
    steps = [row for row in trainer.state.history if row.get("iteration") == 0]
    per_epoch = -(-len(pairs) // 3)
    assert learned["policy/steps"] == len(steps) == 2 * per_epoch
    # the first step's policy is its reference: every pair's log-ratio is 0, its loss log 2
    assert steps[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5)
    losses = [row["dpo/loss"] for row in steps]
    assert learned["policy/dpo_loss_mean"] == pytest.approx(sum(losses) / len(losses), rel=1e-9)
    assert len(set(losses)) > 1 and trainer.reference is None
    assert trainer.state.global_step == trainer.policy_trainer.state.global_step == 2 * per_epoch


def test_a_reference_of_another_size_and_an_iteration_without_pairs(tiny_llama, caplog):
    trainer = build(tiny_llama, num_iterations=1)
    trainer.run_next_stage()
    trainer.run_next_stage()
    pairs = len(trainer.pairs_by_iteration[0])
    trainer.reference = trainer.reference[..., :-1]
    with pytest.raises(RuntimeError) as error:
        trainer.learn_policy()
    assert str(error.value) == f"iteration 0: {pairs - 1} prepared reference log-probabilities for {pairs} pairs"
    tied = MADPOIterTrainer(agent_model=tiny_llama, reward_func=lambda a, b: [0.5] * len(a),
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                            args=MADPOIterConfig(**{**TINY, "num_iterations": 1}))
    before = agent_weights(tied.agents)
    with caplog.at_level(logging.WARNING):
        tied.train()
    records = tied.state.stage_records
    assert records[1]["replay/pairs"] == 0.0 and records[1]["replay/iterations"] == 0.0
    assert "reference/chosen_logprob_mean" not in records[1]
    assert not [k for k in records[1] if k.startswith("distribution/train")]  # nothing to describe
    assert records[2]["policy/steps"] == 0.0 and same(before, agent_weights(tied.agents))
    assert ("iteration 0: no preference pairs to train on (every candidate tied); the policy is unchanged"
            in [r.getMessage() for r in caplog.records])


def test_without_a_reference_nothing_is_prepared_and_replay_counts_iterations(tiny_llama):
    trainer = build(tiny_llama, num_iterations=2, dpo_reference="none", preference_replay_mode="all")
    trainer.train()
    prepared = [r for r in trainer.state.stage_records if r["stage"] == "prepare_pairs"]
    sizes = [len(p) for p in trainer.pairs_by_iteration]
    assert [r["replay/pairs"] for r in prepared] == [sizes[0], sizes[0] + sizes[1]]
    assert [r["replay/iterations"] for r in prepared] == [1.0, 2.0]
    assert all("reference/chosen_logprob_mean" not in r for r in prepared)
    learned = [r for r in trainer.state.stage_records if r["stage"] == "learn_policy"]
    assert [r["policy/steps"] for r in learned] == [-(-s // TINY["dpo_batch_size"]) for s in
                                                      (sizes[0], sizes[0] + sizes[1])]


def test_the_iterative_state_round_trips_and_args_are_checked(tiny_llama):
    trainer = build(tiny_llama, num_iterations=1)
    trainer.run_next_stage()
    trainer.run_next_stage()
    state = trainer.state_dict()
    assert state["policy"]["progress"]["history"] == [] and torch.equal(state["reference"], trainer.reference)
    assert state["progress"]["stage"] == trainer.state.stage == 2
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    state = trainer.state_dict()
    torch.manual_seed(9)
    resumed = build(tiny_llama, num_iterations=1)
    resumed.load_state_dict(state)
    assert torch.equal(torch.rand(3), expected_draw)  # the RNGs are the checkpoint's
    assert torch.equal(resumed.reference, trainer.reference) and resumed.state.stage == 2
    assert resumed.state.history is resumed.policy_trainer.history
    assert resumed.pairs_by_iteration[0].to_list() == trainer.pairs_by_iteration[0].to_list()
    assert resumed.preference_pairs.to_list() == trainer.pairs_by_iteration[0].to_list()
    assert "rng" not in state["policy"]  # one copy of the RNGs: the run's
    learned = build(tiny_llama, num_iterations=2)
    for _ in range(3):
        learned.run_next_stage()
    steps = learned.state_dict()
    again = build(tiny_llama, num_iterations=2)
    again.load_state_dict(steps)
    assert again.state.history == learned.state.history and len(again.state.history) > 0
    assert again.policy_trainer.history is again.state.history
    names = sorted(again.policy_trainer.model_optimizers)
    steps["policy"]["optimizers"] = {}
    with pytest.raises(ValueError) as error:
        again.load_state_dict(steps)
    assert str(error.value) == f"the checkpoint holds no optimizer state for {names}"
    with pytest.raises(ValueError) as error:
        again.load_state_dict(steps, "checkpoint-3")
    assert str(error.value) == f"checkpoint-3 holds no optimizer state for {names}"
    with pytest.raises(ValueError) as error:
        MADPOIterTrainer(agent_model=tiny_llama, reward_func=letters_reward,
                         train_dataset=Dataset.from_dict({"prompt": PROMPTS}), args=MADPOConfig(num_agents=2))
    assert str(error.value) == "args must be a MADPOIterConfig, got MADPOConfig"


def test_evaluate_is_the_policy_trainers(tiny_llama):
    trainer = MADPOIterTrainer(agent_model=tiny_llama, reward_func=letters_reward,
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                               eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}),
                               args=MADPOIterConfig(**{**TINY, "eval_num_samples": 2}))
    other = Dataset.from_dict({"prompt": PROMPTS[2:]})
    torch.manual_seed(0)
    mine = trainer.evaluate(other, 1)
    torch.manual_seed(0)
    assert mine == trainer.policy_trainer.evaluate(other, 1)
    torch.manual_seed(0)
    mine = trainer.evaluate(num_eval_samples=3)
    torch.manual_seed(0)
    assert mine == trainer.policy_trainer.evaluate(num_eval_samples=3)


# ----- the reward histogram by hand -----------------------------------------------------------------------
def test_histogram_of_rewards_by_hand():
    edges = rh.bin_edges((-2.0, 2.0), 4)
    assert edges.tolist() == [-2.0, -1.0, 0.0, 1.0, 2.0]
    assert rh.bin_edges((0.0, 1.0)).tolist() == [k / 16 for k in range(17)]
    counts, same_edges = rh.histogram_counts([-3.0, -1.0, -0.5, 0.0, 2.0, 9.0], edges)
    assert counts.tolist() == [1, 2, 1, 2] and same_edges is edges
    empty, _ = rh.histogram_counts([], edges)
    assert empty.tolist() == [0, 0, 0, 0] and empty.dtype.kind == "i"
    series = rh.histogram_series([1.5, float("nan"), -2.0, 0.5], edges)
    assert series == {"sample_count": 3, "mean": 0.0, "counts": [1, 0, 1, 1], "raw_rewards": [1.5, -2.0, 0.5]}
    assert all(type(c) is int for c in series["counts"]) and type(series["mean"]) is float
    metrics = rh.histogram_metrics("iter", 2, [1.0, 2.0, 4.0], [0.5], pair_count=0)
    assert metrics == {"iter/current_iteration": 3.0, "iter/pair_count": 0.0, "iter/target_sample_count": 3.0,
                       "iter/comparator_sample_count": 1.0, "iter/target_mean": 7 / 3, "iter/comparator_mean": 0.5}
    assert rh.histogram_metrics("iter", 0, [], [2.0]) == {"iter/current_iteration": 1.0,
                                                            "iter/target_sample_count": 0.0,
                                                            "iter/comparator_sample_count": 1.0,
                                                            "iter/comparator_mean": 2.0}
    assert rh.format_axis_tick(-0.05) == "-0.050" and rh.format_axis_tick(-0.5) == "-0.50"
    assert rh.format_axis_tick(10.25) == "10.2" and rh.format_axis_tick(3.0000000001) == "3"
    assert rh.format_axis_tick(0.1) == "0.10" and rh.format_axis_tick(1.0 + 2e-9) == "1.0"


def test_the_reward_range_is_the_rewards_or_refused_in_words():
    def reward(a, b):
        return [0.0] * len(a)

    with pytest.raises(ValueError) as error:
        rh.reward_range_of(reward)
    assert str(error.value) == (
        "log_reward_distribution=True requires reward_func.reward_range to declare the raw reward scale as (minimum, "
        "maximum); set it with comlrl.utils.set_reward_range(reward_func, lo, hi)")
    reward.reward_range = (-1.0, 3.0)
    assert tuple(rh.reward_range_of(reward)) == (-1.0, 3.0)


def test_selected_pair_rewards_by_hand():
    class Pair:
        def __init__(self, target, comparator):
            self.target_raw_reward, self.comparator_raw_reward = target, comparator

    pairs = [Pair(1.0, 2.0), Pair(None, 3.0), Pair(4.0, None), Pair(float("inf"), 5.0), Pair(6.0, float("nan"))]
    assert rh.selected_pair_rewards(pairs) == ([1.0, 6.0], [2.0, 5.0])
    assert rh.finite_floats(["1.5", 2, float("-inf")]) == [1.5, 2.0]


def test_the_original_histogram_names_on_a_trainer(tiny_llama):
    def reward(completions_0, completions_1):
        return [0.0] * len(completions_0)

    set_reward_range(reward, -2.0, 2.0)
    trainer = MADPOIterTrainer(agent_model=tiny_llama, reward_func=reward,
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                               args=MADPOIterConfig(**{**TINY, "log_reward_distribution": True}))
    assert trainer._log_reward_distribution_enabled() is True
    assert tuple(trainer._resolve_reward_distribution_range()) == (-2.0, 2.0)
    edges = trainer._reward_distribution_bin_edges()
    assert edges.tolist() == [-2.0 + 0.25 * k for k in range(17)]
    assert trainer._reward_distribution_counts([-9.0, 1.9], edges)[0].tolist() == [1] + [0] * 14 + [1]
    assert trainer._reward_distribution_json_series([0.1, float("nan")], edges) == {
        "sample_count": 1, "mean": 0.1, "counts": [0] * 8 + [1] + [0] * 7, "raw_rewards": [0.1]}
    section = trainer._reward_distribution_json_section([-2.0], [2.0, 1.0], edges)
    assert section == {"target": {"sample_count": 1, "mean": -2.0, "counts": [1] + [0] * 15, "raw_rewards": [-2.0]},
                       "comparator": {"sample_count": 2, "mean": 1.5, "counts": [0] * 12 + [1, 0, 0, 1],
                                      "raw_rewards": [2.0, 1.0]}}
    assert rh.format_axis_tick(1e-9) == "0.000"  # a difference of exactly 1e-9 is not an integer
    quiet = build(tiny_llama, log_reward_distribution=False)
    assert quiet._log_reward_distribution_enabled() is False


# ----- a formatter's refusal names the comparator's row and agent; the snapshot keeps the policy's dtype -----
def needs_context(row) -> str:
    return "context: " + row["context"]


def test_comparator_prompts_name_the_row_and_agent_a_formatter_fails_on(tiny_llama, scripted, tmp_path):
    data = Dataset.from_dict({"prompt": PROMPTS, "context": PROMPTS})
    formatters = [lambda row: row["prompt"], needs_context]
    lacking = [{"prompt": "write about the cat"}, {"prompt": "write about the sun"}]
    expected = "row 11 has no field 'context' needed by the formatter of agent 1 (fields present: ['prompt'])"
    scripted.default = tagged
    for options in (dict(comparator_policy="api", comparator_api_url=scripted.url),
                    dict(comparator_policy="api", comparator_api_url=scripted.url,
                         comparator_generation_mode="centralized"),
                    dict(comparator_policy="history", output_dir=str(tmp_path)),
                    dict(comparator_policy="model", comparator_model_name=tiny_llama)):
        trainer = MADPOIterTrainer(agent_model=tiny_llama, reward_func=letters_reward, train_dataset=data,
                                   formatters=formatters, args=MADPOIterConfig(**{**TINY, **options}))
        policy, comparator = trainer.policy_trainer, trainer.comparator
        comparator.use_output_dir(tmp_path / "run")
        comparator.begin(0, policy)
        with pytest.raises(ValueError) as error:
            comparator.sample(policy, policy.rollout_spec, [{"context": "x", "prompt": "y"}, lacking[0]], [10, 11])
        comparator.end()
        assert str(error.value) == expected


def test_a_snapshot_is_loaded_in_the_policys_dtype_and_its_path_returned(tiny_llama, tmp_path):
    trainer = MADPOIterTrainer(agent_model=tiny_llama, reward_func=letters_reward,
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                               model_config={"dtype": torch.bfloat16},
                               args=MADPOIterConfig(**{**TINY, "comparator_policy": "history",
                                                       "output_dir": str(tmp_path)}))
    policy, history = trainer.policy_trainer, trainer.comparator
    assert all(p.dtype == torch.bfloat16 for p in policy.agents[0].parameters())
    history.use_output_dir(tmp_path)
    assert history.snapshot(7, policy) == str(tmp_path / "policies" / "iteration_0007")
    history.begin(0, policy)
    assert [next(m.parameters()).dtype for m in history.models] == [torch.bfloat16] * 2
    history.end()
    model = MADPOIterTrainer(agent_model=tiny_llama, reward_func=letters_reward,
                             train_dataset=Dataset.from_dict({"prompt": PROMPTS}), model_config={"dtype": torch.bfloat16},
                             args=MADPOIterConfig(**{**TINY, "comparator_policy": "model",
                                                     "comparator_model_name": tiny_llama}))
    assert [next(m.parameters()).dtype for m in model.comparator.models] == [torch.bfloat16] * 2


def test_a_users_agent_map_runs_the_comparators_sampling(tiny_llama, tiny_llama_b, tmp_path):
    mapped = []

    def recording_map(work, devices):
        mapped.append(len(devices))
        return [work(agent) for agent in range(len(devices))]

    for options, widths in ((dict(comparator_policy="model", comparator_model_name=tiny_llama_b), [2]),
                            (dict(comparator_policy="history", output_dir=str(tmp_path)), [2]),
                            (dict(comparator_policy="model", comparator_model_name=tiny_llama_b,
                                  comparator_generation_mode="centralized"), [1])):
        trainer = build(tiny_llama, **options)
        policy, comparator = trainer.policy_trainer, trainer.comparator
        trainer.run_agents_with(recording_map)
        comparator.use_output_dir(tmp_path / "run")
        comparator.begin(0, policy)
        mapped.clear()
        comparator.sample(policy, policy.rollout_spec, ROWS[:2], [0, 1])
        comparator.end()
        assert mapped == widths


def test_a_model_comparators_tokenizers_are_named_in_its_warnings_and_refusals(tiny_llama, tiny_gpt2, tmp_path, caplog):
    padless = tmp_path / "padless"
    shutil.copytree(tiny_llama, padless)
    tokenizer = AutoTokenizer.from_pretrained(padless)
    eos = tokenizer.eos_token
    tokenizer.pad_token = None
    tokenizer.save_pretrained(padless)
    assert AutoTokenizer.from_pretrained(padless).pad_token_id is None
    with caplog.at_level(logging.WARNING, logger="comlrl.models.entities"):
        build(tiny_llama, comparator_policy="model", comparator_model_name=str(padless))
    assert [r.getMessage() for r in caplog.records if "has no pad token" in r.getMessage()] == [
        f"the tokenizer of comparator_{i} has no pad token; using its EOS token {eos!r}" for i in range(2)]
    misfit = tmp_path / "misfit"
    shutil.copytree(tiny_llama, misfit)
    AutoTokenizer.from_pretrained(tiny_gpt2).save_pretrained(misfit)
    with pytest.raises(ValueError) as error:
        build(tiny_llama, comparator_policy="model", comparator_model_name=str(misfit))
    assert str(error.value).startswith("the tokenizer given for comparator_0 has 128 tokens but the model ")


def test_each_dpo_epoch_ends_with_an_optimizer_step_and_uses_the_prepared_references(tiny_llama, tmp_path):
    trainer = build(tiny_llama, num_iterations=1, dpo_batch_size=3, num_train_epochs=2, gradient_accumulation_steps=2,
                    log_reward_distribution=False, output_dir=str(tmp_path))
    trainer.prepare_output_dir(resuming=False)  # what train() does first
    trainer.run_next_stage()
    pairs = trainer.pairs_by_iteration[0]
    saved = preferences.load_pairs(tmp_path / "iteration_0" / "pairs.parquet")
    assert saved.to_list() == pairs.to_list()  # the shard is written in the iteration's directory
    trainer.run_next_stage()
    assert not [k for k in trainer.state.stage_records[-1] if k.startswith("distribution/")]
    per_epoch = -(-len(pairs) // 3)
    assert per_epoch % 2 == 1  # an epoch ends between two accumulation windows
    trainer.reference[:, 0] -= 5.0  # the stage uses the prepared numbers: each agent's log-ratio gains 5
    trainer.run_next_stage()
    optimizer_steps = [component.state_dict()["steps"] for component in trainer.policy_trainer.model_optimizers.values()]
    assert optimizer_steps == [2 * -(-per_epoch // 2)] * 2
    rows = [row for row in trainer.state.history if row.get("iteration") == 0]
    # a row carries an optimizer step's numbers after every second micro-batch of an epoch and after its last
    stepped = [j % 2 == 0 or j == per_epoch for _ in range(2) for j in range(1, per_epoch + 1)]
    assert [all(f"agent_{a}/grad_norm" in row for a in range(2)) for row in rows] == stepped
    assert all(p.grad is None for agent in trainer.agents for p in agent.parameters())  # no gradient left pending
    first = rows[0]
    assert first["dpo/loss"] == pytest.approx(math.log1p(math.exp(-0.1 * 10.0)), abs=1e-5)


def test_evaluate_passes_its_dataset_and_counts(tiny_llama):
    def length_reward(completions_0, completions_1):
        return [float(len(a) + 2 * len(b)) for a, b in zip(completions_0, completions_1)]

    trainer = MADPOIterTrainer(agent_model=tiny_llama, reward_func=length_reward,
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                               eval_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                               args=MADPOIterConfig(**TINY))
    other = Dataset.from_dict({"prompt": PROMPTS[2:]})
    runs = {}
    for name, call in (("other", lambda t: t.evaluate(other, 1)), ("default", lambda t: t.evaluate(None, 1)),
                       ("one", lambda t: t.evaluate(num_eval_samples=1))):
        torch.manual_seed(0)
        runs[name] = call(trainer)
        torch.manual_seed(0)
        assert runs[name] == call(trainer.policy_trainer)
    torch.manual_seed(0)
    every = trainer.evaluate()
    assert runs["other"] != runs["default"] and runs["one"] != every


# ----- the comparator's devices, its own code, a user's adapter and the policy's own centralized comparator -----
def test_the_comparator_models_go_to_comparator_devices(tiny_llama, tmp_path):
    cpu, meta = torch.device("cpu"), torch.device("meta")  # meta: a device other than the agents' on any machine
    trainer = build(tiny_llama, comparator_policy="model", comparator_model_name=tiny_llama,
                    comparator_devices=["cpu", "meta"])
    assert [next(m.parameters()).device for m in trainer.comparator.models] == [cpu, meta]
    assert [next(a.parameters()).device for a in trainer.policy_trainer.agents] == [cpu, cpu]
    history = build(tiny_llama, comparator_policy="history", comparator_devices="meta", output_dir=str(tmp_path))
    history.comparator.use_output_dir(tmp_path)
    history.comparator.begin(0, history.policy_trainer)
    assert [next(m.parameters()).device for m in history.comparator.models] == [meta, meta]
    history.comparator.end()


OWN_CODE = '''from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


class CustomLlamaConfig(LlamaConfig):
    model_type = "custom_llama"


class CustomLlamaForCausalLM(LlamaForCausalLM):
    config_class = CustomLlamaConfig


class CustomTokenizer(PreTrainedTokenizerFast):
    pass
'''


def with_its_own_code(model_dir: str, directory: Path) -> Path:
    """A copy of ``model_dir`` whose config, model and tokenizer classes are defined by code in the directory."""
    shutil.copytree(model_dir, directory)
    (directory / "custom_llama.py").write_text(OWN_CODE)
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="custom_llama", auto_map={"AutoConfig": "custom_llama.CustomLlamaConfig",
                                                        "AutoModelForCausalLM": "custom_llama.CustomLlamaForCausalLM"})
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config.pop("tokenizer_class")
    tokenizer_config["auto_map"] = {"AutoTokenizer": [None, "custom_llama.CustomTokenizer"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


def test_a_comparator_model_with_its_own_code_loads_only_when_trusted(tiny_llama, tmp_path):
    custom = str(with_its_own_code(tiny_llama, tmp_path / "custom"))
    with pytest.raises(ValueError, match="contains custom code"):
        build(tiny_llama, comparator_policy="model", comparator_model_name=custom)
    with pytest.raises(ValueError, match="contains custom code"):  # not trusted unless asked
        cmp.ModelComparator([custom], [torch.device("cpu")], torch.float32)
    trainer = build(tiny_llama, comparator_policy="model", comparator_model_name=custom, trust_remote_code=True)
    comparator = trainer.comparator
    assert [type(m).__name__ for m in comparator.models] == ["CustomLlamaForCausalLM"] * 2
    assert [type(t).__name__ for t in comparator.tokenizers] == ["CustomTokenizer"] * 2
    assert same(agent_weights(comparator.models), agent_weights([AutoModelForCausalLM.from_pretrained(tiny_llama)] * 2))


class Halves:
    """A comlrl 1.4.3 collaboration adapter: the agents' prompts joined by ' | ', a joint answer split at '|'."""

    def build_prompt(self, batch_item, agent_prompts):
        return " | ".join(agent_prompts)

    def parse_completion(self, completion, batch_item, num_agents):
        return [part.strip() for part in completion.split("|")]


def test_a_users_adapter_writes_and_splits_the_centralized_comparators_answers(tiny_llama, scripted):
    trainer = MADPOIterTrainer(agent_model=tiny_llama, reward_func=letters_reward,
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                               args=MADPOIterConfig(**{**TINY, "comparator_policy": "api",
                                                       "comparator_api_url": scripted.url,
                                                       "comparator_generation_mode": "centralized"}),
                               centralized_comparator_adapter=Halves())
    policy = trainer.policy_trainer
    scripted.default = lambda path, body: {"choices": [{"message": {"content": f"red {i} | blue {i}"}}
                                                       for i in range(body["n"])]}
    spec = policy.rollout_spec.replace(num_generations=2)
    samples = trainer.comparator.sample(policy, spec, ROWS[:2], [0, 1])
    asked = sorted(body["messages"][0]["content"] for _, _, body in scripted.requests)
    assert asked == sorted(" | ".join(format_prompt(spec.formatters[a], row, a, label) for a in range(2))
                           for row, label in zip(ROWS[:2], [0, 1]))
    assert samples.texts == [["red 0", "red 1"] * 2, ["blue 0", "blue 1"] * 2]


class Copies(Halves):
    """Every agent's part is the whole joint answer."""

    def parse_completion(self, completion, batch_item, num_agents):
        return [completion] * num_agents


def test_a_centralized_comparator_writes_with_its_sources_first_model_unless_told(tiny_llama, tiny_llama_b):
    policy = build(tiny_llama).policy_trainer
    source = cmp.ModelComparator([tiny_llama_b, tiny_llama], policy.agent_devices, torch.float32)
    spec = policy.rollout_spec.replace(num_generations=2)
    adapter = as_adapter(Copies(), 2)
    texts = {}
    for name, index in (("default", None), ("first", 0), ("second", 1)):
        options = {} if index is None else {"source_index": index}
        comparator = cmp.CentralizedComparator(adapter, 0, "partial", source, **options)
        torch.manual_seed(5)
        texts[name] = comparator.sample(policy, spec, ROWS[:2], [0, 1]).texts
    assert texts["default"] == texts["first"] != texts["second"] and all(texts["first"][0])


def test_the_policys_own_centralized_comparator_keeps_no_state(tiny_llama):
    trainer = build(tiny_llama, comparator_generation_mode="centralized")
    comparator = trainer.comparator
    assert (comparator.kind, comparator.source) == ("centralized_current", None)
    assert comparator.state_dict() == {} and trainer.collection.state_dict()["comparator"] == {}


# ----- the trainer's construction, the collection's comparator, prompts cut to fit, skipped steps -------------
def test_a_trainer_without_args_runs_the_default_config(tiny_llama):
    trainer = MADPOIterTrainer(agent_model=tiny_llama, reward_func=letters_reward,
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    assert trainer.args == MADPOIterConfig() and trainer.policy_trainer.args is trainer.args


def test_the_collection_pairs_the_policy_against_the_configured_comparator(tiny_llama, scripted):
    trainer = build(tiny_llama, num_iterations=1, comparator_policy="api", comparator_api_url=scripted.url,
                    comparator_num_candidates=2)
    scripted.default = lambda path, body: {"choices": [{"message": {"content": "eeee"}, "finish_reason": "stop"}]
                                                      * body["n"]}
    trainer.run_next_stage()
    assert sorted(body["n"] for _, _, body in scripted.requests) == [2] * 2 * len(PROMPTS)  # each agent, each row
    pairs = trainer.pairs_by_iteration[0].to_list()
    tokenizer = trainer.policy_trainer.tokenizers[0]
    eeee = tokenizer("eeee", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert pairs and all({pair["chosen_source"], pair["rejected_source"]} == {"policy", "comparator"} for pair in pairs)
    for pair in pairs:
        side = "chosen" if pair["chosen_source"] == "comparator" else "rejected"
        assert (pair[side], pair[f"{side}_ids"], pair[f"{side}_reward"]) == (["eeee", "eeee"], [eeee, eeee], 0.5)
    assert trainer.state_dict()["reference"] is None  # a checkpoint after the collection: nothing prepared yet


def test_prepared_references_score_the_prompt_as_sampling_cut_it(tiny_llama):
    trainer = build(tiny_llama, num_iterations=1, max_prompt_length=3)
    initial = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert all(len(tokenizer(p, add_special_tokens=False)["input_ids"]) > 3 for p in PROMPTS)
    trainer.run_next_stage()
    trainer.run_next_stage()
    pairs = trainer.pairs_by_iteration[0]
    expected = torch.tensor([[[completion_logprob(initial, tokenizer, prompts[a], ids[a], prompt_tokens=3)
                               for prompts, ids in zip(pairs["agent_prompts"], pairs[f"{side}_ids"])]
                              for side in ("chosen", "rejected")] for a in range(2)])
    torch.testing.assert_close(trainer.reference, expected, rtol=1e-4, atol=1e-4)


def test_stored_pairs_whose_prompts_no_longer_fit_are_refused_with_prompt_overflow_error(tiny_llama):
    collected = build(tiny_llama, num_iterations=1)
    collected.run_next_stage()
    stricter = build(tiny_llama, num_iterations=1, max_prompt_length=3, prompt_overflow="error")
    stricter.load_state_dict(collected.state_dict())
    first = stricter.pairs_by_iteration[0][0]["agent_prompts"][0]
    length = len(AutoTokenizer.from_pretrained(tiny_llama)(first, add_special_tokens=False)["input_ids"])
    with pytest.raises(ValueError) as error:
        stricter.run_next_stage()
    assert str(error.value) == (f"prompt 0 has {length} tokens but only 3 fit (context minus max_new_tokens, or "
                                "max_prompt_length); shorten it or set prompt_overflow='truncate'")


def test_the_stage_mean_loss_leaves_out_the_skipped_steps(tiny_llama):
    trainer = build(tiny_llama, num_iterations=1, dpo_batch_size=3, num_train_epochs=2, max_nonfinite_updates=50)
    trainer.run_next_stage()
    trainer.run_next_stage()
    trainer.reference[:, :, 0] = float("nan")  # pair 0: its micro-batch's loss is NaN, that update skipped
    trainer.run_next_stage()
    losses = [row["dpo/loss"] for row in trainer.state.history if row.get("iteration") == 0]
    finite = [loss for loss in losses if math.isfinite(loss)]
    assert len(finite) == len(losses) - 2  # one micro-batch in each of the two epochs
    learned = trainer.state.stage_records[-1]
    assert learned["policy/steps"] == len(losses)
    assert learned["policy/dpo_loss_mean"] == pytest.approx(sum(finite) / len(finite), rel=1e-9)
    every = build(tiny_llama, num_iterations=1, max_nonfinite_updates=50)
    every.run_next_stage()
    every.run_next_stage()
    every.reference[:] = float("nan")
    every.run_next_stage()
    learned = every.state.stage_records[-1]
    assert learned["policy/steps"] > 0 and math.isnan(learned["policy/dpo_loss_mean"])
