"""Recipe for the bundled demo: the toy task's Parquet files and a tiny local model.

    python data/make_demo.py            # rewrites data/letters/*.parquet
    python data/make_demo.py --model D  # also builds the tiny model + tokenizer in D

Nothing is downloaded: the tokenizer is trained locally with `tokenizers` and the model is
a randomly initialised 80k-parameter Llama (see comlrl/tiny.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from comlrl.tasks.letters import write_dataset
from comlrl.tiny import save_tiny_model

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="directory to build the tiny model in")
    args = parser.parse_args()
    for split, path in write_dataset(HERE / "letters").items():
        print(f"{split}: {path}")
    if args.model:
        print(f"model: {save_tiny_model(args.model, 'llama', vocab_size=96, seed=0)}")


if __name__ == "__main__":
    main()
