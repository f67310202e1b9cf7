"""The ``comlrl`` command line."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEMO_DATA = PROJECT_ROOT / "data" / "letters"


def demo(args: argparse.Namespace) -> int:
    """A short MAGRPO run of two tiny agents on the bundled letters task."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from datasets import load_dataset

    from comlrl.tasks.letters import letters_reward
    from comlrl.tiny import save_tiny_model
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    transformers.utils.logging.disable_progress_bar()
    work = Path(args.workdir).resolve()
    model_dir = work / "models" / "tiny-llama"
    if not (model_dir / "config.json").is_file():
        save_tiny_model(model_dir, "llama", vocab_size=96, seed=0)
    data = load_dataset("parquet", data_files={s: str(DEMO_DATA / f"{s}.parquet") for s in ("train", "eval")})
    trainer = MAGRPOTrainer(
        agent_model=str(model_dir),
        num_agents=2,
        reward_func=letters_reward,
        train_dataset=data["train"],
        eval_dataset=data["eval"],
        args=MAGRPOConfig(
            num_agents=2, num_generations=4, max_new_tokens=16, temperature=1.0, agent_learning_rate=3e-3,
            num_train_epochs=args.epochs, per_device_train_batch_size=2, seed=0,
        ),
    )
    before = trainer.evaluate()["eval/reward_mean"]
    history = trainer.train()
    after = trainer.evaluate()["eval/reward_mean"]
    window = max(1, len(history) // 8)
    first = sum(s["reward_mean"] for s in history[:window]) / window
    last = sum(s["reward_mean"] for s in history[-window:]) / window
    saved = trainer.save_model(work / "saved-models" / "demo")
    print(f"train reward: first {window} steps {first:.3f} -> last {window} steps {last:.3f}")
    print(f"eval reward:  before {before:.3f} -> after {after:.3f}")
    print(f"saved agents: {saved}/agent_0, {saved}/agent_1")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="comlrl", description="Train cooperating LLM agents with multi-agent RL.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="run the bundled tiny demo end to end")
    demo_parser.add_argument("--workdir", default=".comlrl", help="where models and outputs go (default .comlrl)")
    demo_parser.add_argument("--epochs", type=int, default=3, help="training epochs (default 3)")
    demo_parser.set_defaults(handler=demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
