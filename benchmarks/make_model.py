"""Build the benchmark's tiny local Llama and tokenizer (no hub) with this library's comlrl.tiny."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_HIDDEN_SIZE = 256


def make_model(directory: str | Path, hidden_size: int = DEFAULT_HIDDEN_SIZE, vocab_size: int = 96) -> Path:
    from comlrl.tiny import save_tiny_model

    directory = Path(directory)
    if not (directory / "config.json").exists():
        save_tiny_model(directory, "llama", vocab_size=vocab_size, hidden_size=hidden_size, seed=0)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory")
    parser.add_argument("--hidden-size", type=int, default=DEFAULT_HIDDEN_SIZE)
    args = parser.parse_args()
    path = make_model(args.directory, args.hidden_size)
    print(json.dumps({"model_dir": str(path), **json.loads((path / "config.json").read_text())}))


if __name__ == "__main__":
    main()
