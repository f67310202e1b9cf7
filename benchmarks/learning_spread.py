"""How far the learning tests' held-out reward rises, per trainer kind, over many seeds (issue 27).

``tests/test_learning.py`` asserts that training raises the held-out reward, in the median over a few
seeds, by a margin; this script measures the rise that margin is set from (benchmarks/README.md,
"Learning tests: the spread of the rise"). Each run builds the trainer with the test's own
settings (``test_learning.build``: one home for them), evaluates the held-out rows, trains,
evaluates again, and records the rise and the seconds it took. The table gives, per kind, every
seed's rise and their min/median/max.

Another CPU rounds differently; over a run the first differing sampled token sends the trajectory
elsewhere. Two perturbations imitate that without changing the algorithm:

- ``--threads 2``: intra-op threads split some reductions differently;
- ``--perturb ulp``: every weight of the tiny model moved by one unit in the last place (a
  seeded random direction per element), i.e. the same model to float32 precision.

MARLHF's preference settings are measured with ``--preference letters`` (the settings MAGRPO, IAC and
MAAC learn letters under: 6 epochs, lr 3e-3, 4 generations, the preference defaults) on either task
(``--task``), and any config field can be changed with ``--set field=value``.

    .venv/bin/python benchmarks/learning_spread.py --kinds all --seeds 0-7
    .venv/bin/python benchmarks/learning_spread.py --kinds magrpo,iac --seeds 0-7 --perturb ulp
    .venv/bin/python benchmarks/learning_spread.py --kinds marlhf --seeds 0-4 --preference letters --task keywords
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as tests/conftest.py: the tiny models gain nothing from threads
for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(name, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import ast  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_learning  # noqa: E402  (the test's settings and build)

from comlrl.tasks.keywords import keywords_reward  # noqa: E402
from comlrl.tasks.letters import letters_reward  # noqa: E402
from comlrl.tiny import save_tiny_model  # noqa: E402
from comlrl.trainers.preference import MARLHFConfig, MARLHFIterTrainer, MARLHFTrainer  # noqa: E402

KINDS = list(test_learning.MARGINS)
PREFERENCE_KINDS = ("marlhf", "marlhf_iter")
TASKS = {"keywords": keywords_reward, "letters": letters_reward}


def tiny_model(directory: Path, perturb: str) -> str:
    """The test fixture's model (``tiny_llama``), optionally every weight one ulp away."""
    path = save_tiny_model(directory / "tiny-llama", "llama", vocab_size=96, seed=0)
    if perturb == "ulp":
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        generator = torch.Generator().manual_seed(12345)
        with torch.no_grad():
            for parameter in model.parameters():
                up = torch.rand(parameter.shape, generator=generator) < 0.5
                target = torch.where(up, torch.full_like(parameter, float("inf")), torch.full_like(parameter, -float("inf")))
                parameter.copy_(torch.nextafter(parameter, target))
        model.save_pretrained(path)
    return str(path)


def letters_settings(kind: str, model: str, seed: int, task: str, changes: dict):
    """MARLHF at the settings MAGRPO/IAC/MAAC learn letters under, with the preference defaults."""
    settings = dict(test_learning.COMMON, num_train_epochs=6, reward_model_device=None)
    data = dict(reward_func=TASKS[task], train_dataset=test_learning.TRAIN, eval_dataset=test_learning.HELD_OUT)
    if kind == "marlhf":
        return MARLHFTrainer(agent_model=model, args=MARLHFConfig(seed=seed, **dict(settings, **changes)), **data)
    iterative = dict(settings, num_train_epochs=3, num_iterations=2)
    return MARLHFIterTrainer(agent_model=model, args=MARLHFConfig(seed=seed, **dict(iterative, **changes)), **data)


def guard_summary(trainer) -> dict:
    """MARLHF's policy-stage records: how many stages the guard reverted, the reward model's agreement."""
    records = getattr(getattr(trainer, "state", None), "stage_records", None) or []
    stages = [r for r in records if r["stage"] == "learn_policy"]
    fits = [r for r in records if r["stage"] == "fit_reward_model"]
    if not stages:
        return {}
    return {"reverted": sum(int(r.get("policy/guard_reverted", 0)) for r in stages), "stages": len(stages),
            "agreement": [round(r.get("policy/reward_model_agreement", float("nan")), 3) for r in stages],
            "guard": [(round(r.get("policy/guard_task_reward_before", float("nan")), 3),
                       round(r.get("policy/guard_task_reward_after", float("nan")), 3)) for r in stages],
            "heldout_accuracy": [round(r.get("reward_model/heldout_accuracy", float("nan")), 3) for r in fits]}


def one_run(kind: str, model: str, seed: int, args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    if kind in PREFERENCE_KINDS and args.preference == "letters":
        trainer = letters_settings(kind, model, seed, args.task, args.changes)
    else:
        trainer = test_learning.build(kind, model, seed, **args.changes)
    before = test_learning.held_out_reward(trainer)
    trainer.train()
    after = test_learning.held_out_reward(trainer)
    return {"kind": kind, "seed": seed, "before": before, "after": after, "rise": after - before,
            "seconds": time.perf_counter() - start, **guard_summary(trainer)}


def seeds_of(text: str) -> list[int]:
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(part) for part in text.split(",")]


def changes_of(items: list[str]) -> dict:
    changes = {}
    for item in items:
        field, _, value = item.partition("=")
        try:
            changes[field] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            changes[field] = value
    return changes


def table(results: list[dict]) -> str:
    """Per kind: every seed's rise, their min/median/max and the mean seconds per run; for MARLHF also
    the policy stages the guard reverted and the fitted reward models' held-out accuracy."""
    lines = ["| kind | seeds | rises | min | median | max | s/run | guard reverted | RM held-out acc. (median) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for kind in dict.fromkeys(r["kind"] for r in results):
        runs = [r for r in results if r["kind"] == kind]
        rises = [r["rise"] for r in runs]
        reverted = f"{sum(r['reverted'] for r in runs)}/{sum(r['stages'] for r in runs)}" if "stages" in runs[0] else ""
        accuracy = [a for r in runs for a in r.get("heldout_accuracy", []) if a == a]
        lines.append(f"| {kind} | {','.join(str(r['seed']) for r in runs)} | {' '.join(f'{x:+.3f}' for x in rises)} | "
                     f"{min(rises):+.3f} | {statistics.median(rises):+.3f} | {max(rises):+.3f} | "
                     f"{statistics.mean(r['seconds'] for r in runs):.1f} | {reverted} | "
                     f"{f'{statistics.median(accuracy):.2f}' if accuracy else ''} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="all", help=f"comma-separated, or 'all': {','.join(KINDS)}")
    parser.add_argument("--seeds", default="0-7", help="'0-7' or '0,3,5'")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the tests use 1)")
    parser.add_argument("--perturb", choices=("none", "ulp"), default="none")
    parser.add_argument("--preference", choices=("test", "letters"), default="test",
                        help="MARLHF settings: the test's tuned ones, or the letters settings with the preference defaults")
    parser.add_argument("--task", choices=tuple(TASKS), default="keywords", help="MARLHF's task with --preference letters")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a config change (repeatable)")
    parser.add_argument("--json", help="append each run as a JSON line to this file")
    parser.add_argument("--table", nargs="+", metavar="JSONL", help="print the table of runs saved with --json; run nothing")
    args = parser.parse_args()
    if args.table:
        print(table([json.loads(line) for path in args.table for line in open(path)]))
        return
    args.changes = changes_of(args.set)
    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("comlrl").setLevel(logging.ERROR)  # the guard's revert warnings are counted in the table
    kinds = KINDS if args.kinds == "all" else args.kinds.split(",")
    results = []
    with tempfile.TemporaryDirectory() as directory:
        model = tiny_model(Path(directory), args.perturb)
        for kind in kinds:
            for seed in seeds_of(args.seeds):
                result = one_run(kind, model, seed, args)
                result.update(threads=args.threads, perturb=args.perturb, preference=args.preference,
                              task=args.task, changes=args.changes)
                results.append(result)
                print(json.dumps(result), flush=True)
                if args.json:
                    with open(args.json, "a") as handle:
                        handle.write(json.dumps(result) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
