"""Values of the LoRA adapters, the exported model directories and the stop signals (issue 39).

Each test checks what a user sees (an adapter's scaling and places, a written directory loaded back, a request
set by a real signal, a handler put back) against a value worked out here, not by the code under test.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.models import export, lora
from comlrl.training.signals import StopRequest, stop_on_signals

peft = pytest.importorskip("peft")

TOKENS = torch.tensor([[5, 9, 17, 33, 2, 41]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=TOKENS).logits


def trained_adapters(tiny_llama: str, target_modules=None):
    """A LoRA agent whose adapters moved off zero, so that its policy is no longer the base's."""
    agent = lora.add_adapters(AutoModelForCausalLM.from_pretrained(tiny_llama), rank=4, alpha=8.0, dropout=0.0,
                              target_modules=target_modules)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, parameter in agent.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)
    return agent


# --- lora.py ---------------------------------------------------------------------------------------------------


def test_the_adapters_scale_by_alpha_over_rank_on_every_linear_layer_but_the_head(tiny_llama):
    base = AutoModelForCausalLM.from_pretrained(tiny_llama)
    linear = sorted(name for name, module in base.named_modules()
                    if isinstance(module, torch.nn.Linear) and name != "lm_head")
    agent = lora.add_adapters(base, rank=2, alpha=6.0, dropout=0.25, target_modules=None)
    assert isinstance(agent, peft.PeftModelForCausalLM) and lora.is_peft_model(agent)
    adapted = {name.removeprefix("base_model.model."): module for name, module in agent.named_modules()
               if isinstance(module, peft.tuners.lora.LoraLayer)}
    assert sorted(adapted) == linear  # every linear layer of the blocks, the output head left alone
    for module in adapted.values():
        assert module.r["default"] == 2 and module.scaling["default"] == 3.0  # 6 / 2
        assert module.lora_A["default"].weight.shape[0] == 2
        assert module.lora_dropout["default"].p == 0.25
    config = agent.peft_config["default"]
    assert config.task_type == "CAUSAL_LM" and config.r == 2 and config.lora_alpha == 6.0
    trainable = {name for name, parameter in agent.named_parameters() if parameter.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)  # the base weights are frozen


def test_named_target_modules_get_adapters_and_no_other(tiny_llama):
    agent = lora.add_adapters(AutoModelForCausalLM.from_pretrained(tiny_llama), rank=4, alpha=4.0, dropout=0.0,
                              target_modules=["q_proj", "v_proj"])
    adapted = {name.rsplit(".", 1)[-1] for name, module in agent.named_modules()
               if isinstance(module, peft.tuners.lora.LoraLayer)}
    assert adapted == {"q_proj", "v_proj"}
    assert set(agent.peft_config["default"].target_modules) == {"q_proj", "v_proj"}


def test_peft_absent_is_refused_with_the_install_hint_and_no_model_is_a_peft_model(tiny_llama, monkeypatch):
    assert lora.require_peft() is peft
    base = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert not lora.is_peft_model(base)
    monkeypatch.setitem(sys.modules, "peft", None)  # what an environment without the lora extra imports
    with pytest.raises(ImportError) as refused:
        lora.require_peft()
    assert str(refused.value) == ("LoRA (lora_rank is set) needs the peft package; install the optional extra: "
                                  "pip install 'comlrl[lora]' (or pip install peft)")
    assert refused.value.__cause__ is None and refused.value.__suppress_context__
    assert lora.is_peft_model(base) is False
    assert lora.exportable(base, "merged") is base


def test_a_merged_export_folds_the_adapters_into_plain_weights_and_leaves_the_agent_as_it_was(tiny_llama):
    agent = trained_adapters(tiny_llama, target_modules=["q_proj"])
    expected = logits(agent)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert not torch.allclose(expected, logits(base), atol=1e-3)  # so the adapters change the policy
    # By hand: a merged q_proj is W + (alpha / r) B A, every other weight the base's.
    folded = {}
    for name, module in agent.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            delta = module.lora_B["default"].weight @ module.lora_A["default"].weight * (8.0 / 4)
            folded[name.removeprefix("base_model.model.") + ".weight"] = module.base_layer.weight.detach() + delta
    merged = lora.exportable(agent, "merged")
    assert not lora.is_peft_model(merged) and type(merged) is type(base)
    weights = merged.state_dict()
    for name, tensor in base.state_dict().items():
        torch.testing.assert_close(weights[name], folded.get(name, tensor), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits(merged), expected, rtol=1e-4, atol=1e-5)
    assert lora.is_peft_model(agent)  # the agent keeps training with its adapters
    torch.testing.assert_close(logits(agent), expected)


def test_an_adapter_export_is_the_agent_itself_and_a_plain_model_is_never_copied(tiny_llama):
    agent = trained_adapters(tiny_llama)
    assert lora.exportable(agent, "adapter") is agent
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert lora.exportable(plain, "merged") is plain and lora.exportable(plain, "adapter") is plain


# --- export.py -------------------------------------------------------------------------------------------------


def test_exported_directories_load_back_the_same_weights_and_tokenizers(tiny_llama, tiny_llama_b, tmp_path):
    models = [AutoModelForCausalLM.from_pretrained(tiny_llama), AutoModelForCausalLM.from_pretrained(tiny_llama_b)]
    tokenizers = [AutoTokenizer.from_pretrained(tiny_llama), AutoTokenizer.from_pretrained(tiny_llama_b)]
    existing = tmp_path / "agent_0"
    existing.mkdir()  # a directory that is already there is written into
    directories = [existing, tmp_path / "deep" / "er" / "agent_1"]  # and missing parents are made
    export.save_pretrained_models(models, tokenizers, directories)
    for model, tokenizer, directory in zip(models, tokenizers, directories):
        assert (directory / "model.safetensors").is_file() and not list(directory.glob("*.bin"))
        stored = load_file(directory / "model.safetensors")
        for name, tensor in model.state_dict().items():
            if name in stored:
                assert torch.equal(stored[name], tensor)
        loaded = AutoModelForCausalLM.from_pretrained(directory)
        torch.testing.assert_close(logits(loaded), logits(model))
        text = "the cat and the dog"
        assert AutoTokenizer.from_pretrained(directory)(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert not torch.allclose(logits(models[0]), logits(models[1]))  # so each directory holds its own model


def test_merged_and_adapter_exports_write_what_their_loaders_read(tiny_llama, tmp_path):
    agent = trained_adapters(tiny_llama)
    expected = logits(agent)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    export.save_pretrained_models([lora.exportable(agent, "merged")], [tokenizer], [merged])
    export.save_pretrained_models([lora.exportable(agent, "adapter")], [tokenizer], [adapter])
    assert (merged / "model.safetensors").is_file() and not (merged / "adapter_config.json").exists()
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(merged)), expected, rtol=1e-4, atol=1e-5)
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    reloaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama), adapter)
    torch.testing.assert_close(logits(reloaded), expected, rtol=1e-5, atol=1e-6)


def test_a_value_head_is_saved_as_a_plain_state_dict(tmp_path):
    torch.manual_seed(0)
    head = torch.nn.Linear(3, 1)
    expected = {"weight": head.weight.detach().clone(), "bias": head.bias.detach().clone()}
    path = export.save_value_head(head, tmp_path / "critic" / "agent_0")
    assert path == tmp_path / "critic" / "agent_0" / "value_head.pt" and path.is_file()
    loaded = torch.load(path, weights_only=True)
    assert sorted(loaded) == ["bias", "weight"]
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor) and not loaded[name].requires_grad
    assert export.save_value_head(head, tmp_path / "critic" / "agent_0") == path  # again into the same directory


# --- signals.py ------------------------------------------------------------------------------------------------


def test_a_request_without_a_signal_is_not_requested():
    request = StopRequest()
    assert request.signal_name is None and request.requested is False and request.exit_status is None


@pytest.mark.parametrize("name, status", [("SIGTERM", 143), ("SIGINT", 130)])
def test_the_exit_status_is_the_shells_for_that_signal(name, status):
    request = StopRequest()
    request.signal_name = name
    assert request.requested is True and request.exit_status == status  # 128 + 15, 128 + 2


def previous_handler(number, frame):
    raise AssertionError("the scope's own handler should be installed")


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT])
def test_a_first_signal_sets_the_request_a_second_stops_at_once_and_the_old_handler_returns(number):
    before = {sig: signal.signal(sig, previous_handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with stop_on_signals() as request:
            assert not request.requested
            signal.raise_signal(number)
            assert request.signal_name == signal.Signals(number).name
            other = signal.SIGINT if number == signal.SIGTERM else signal.SIGTERM
            with pytest.raises(KeyboardInterrupt) as stopped:
                signal.raise_signal(other)
            assert str(stopped.value) == f"second stop signal ({signal.Signals(other).name}): stopping now"
            assert request.signal_name == signal.Signals(number).name  # the first one is kept
        assert signal.getsignal(signal.SIGTERM) is previous_handler
        assert signal.getsignal(signal.SIGINT) is previous_handler
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_given_request_and_signal_set_are_the_ones_used():
    given = StopRequest()
    before = signal.getsignal(signal.SIGTERM)
    usr1 = signal.signal(signal.SIGUSR1, previous_handler)
    try:
        with stop_on_signals(given, (signal.SIGUSR1,)) as request:
            assert request is given
            assert signal.getsignal(signal.SIGTERM) is before  # not in the set: left alone
            signal.raise_signal(signal.SIGUSR1)
            assert given.signal_name == "SIGUSR1"
        assert signal.getsignal(signal.SIGUSR1) is previous_handler
    finally:
        signal.signal(signal.SIGUSR1, usr1)


def test_off_the_main_thread_the_request_comes_back_untouched():
    given = StopRequest()
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    seen: dict = {}

    def worker():
        try:
            with stop_on_signals(given) as request:
                seen["request"] = request
                seen["handlers"] = {sig: signal.getsignal(sig) for sig in before}
        except BaseException as error:  # noqa: BLE001 - reported to the main thread below
            seen["error"] = error

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert "error" not in seen and seen["request"] is given and not given.requested
    assert seen["handlers"] == before
    assert {sig: signal.getsignal(sig) for sig in before} == before
