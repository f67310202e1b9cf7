"""What the writing run learnt: its eval curve as a PNG, and the base and trained agents side by side.

    OMP_NUM_THREADS=1 comlrl run flows/specs/writing_smollm2.yaml
    .venv/bin/python data/real_model/writing_report.py .comlrl/runs/<run id>

From the run directory's ``result.json`` (its MLflow run and registered agents) this

1. evaluates the base model as the run evaluated (``trainer.evaluate()``: the first
   ``eval_num_samples`` eval rows, the run's seed) and logs it to the MLflow run as
   ``eval/reward_mean`` at step 0, the point before training;
2. draws ``eval/reward_mean`` (and the training batches' ``reward_mean``) over steps to
   ``docs/img/writing_curve.png``;
3. prints, as Markdown, the mean of each reward term on the eval rows (4 samples per row at the
   run's temperature, fixed seed) and greedy completions of both agents on three eval passages,
   base model beside trained agents (also written to ``writing_report.json`` in the run directory).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "flows" / "specs" / "writing_smollm2.yaml"
CURVE = ROOT / "docs" / "img" / "writing_curve.png"
TERMS = ("structure", "coordination", "vocabulary", "style", "reward")


def load_spec_config() -> dict[str, Any]:
    from flows.spec import load_spec

    spec = load_spec(SPEC, ROOT)
    return {"config": dict(spec.config), "model": str(ROOT / spec.models["agent_model"])}


def eval_rows() -> list[dict[str, str]]:
    return [json.loads(line) for line in (ROOT / "data" / "writing" / "eval.jsonl").read_text().splitlines()]


def base_evaluation(model_dir: str, config: dict[str, Any]) -> dict[str, float]:
    """The run's evaluation on the untrained model (same rows, seed and sampling)."""
    from comlrl.tasks.writing import FORMATTERS, writing_reward
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    rows = eval_rows()
    trainer = MAGRPOTrainer(agent_model=model_dir, num_agents=config["num_agents"], reward_func=writing_reward,
                            formatters=list(FORMATTERS), train_dataset=Dataset.from_list(rows),
                            eval_dataset=Dataset.from_list(rows), args=MAGRPOConfig(**config))
    return trainer.evaluate()


def agent_directories(result: dict[str, Any], run_dir: Path) -> list[Path]:
    """The trained agents, exported from the registry versions the run registered."""
    from comlrl.tracking import export_registered_model

    agents = sorted((entry for entry in result["registered"] if "-agent-" in entry["name"]), key=lambda e: e["name"])
    return [export_registered_model(result["tracking_uri"], f"models:/{entry['name']}/{entry['version']}",
                                    run_dir / "report-models" / entry["name"]) for entry in agents]


def completions(model_dirs: list[str], rows: list[dict[str, str]], num_samples: int, temperature: float | None,
                max_new_tokens: int, seed: int) -> list[list[str]]:
    """Per agent, its completions of every row (``num_samples`` each; greedy when ``temperature`` is None)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl.rollout.generation import generate_completions
    from comlrl.rollout.sampling import SamplingParams
    from comlrl.tasks.writing import FORMATTERS

    sampling = SamplingParams(temperature=temperature or 1.0, max_new_tokens=max_new_tokens,
                              do_sample=temperature is not None)
    texts = []
    for directory, formatter in zip(model_dirs, FORMATTERS):
        model = AutoModelForCausalLM.from_pretrained(directory).eval()
        tokenizer = AutoTokenizer.from_pretrained(directory)
        generator = torch.Generator().manual_seed(seed)
        texts.append(generate_completions(model, tokenizer, [formatter(row) for row in rows], num_samples, sampling,
                                          generator=generator).texts)
    return texts


def term_means(summaries: list[str], expansions: list[str]) -> dict[str, float]:
    from comlrl.tasks.writing import words, writing_terms

    terms = [writing_terms(a, b) for a, b in zip(summaries, expansions)]
    means = {name: statistics.mean(t[name] for t in terms) for name in TERMS}
    means["summary words"] = statistics.mean(len(words(a)) for a in summaries)
    means["expansion words"] = statistics.mean(len(words(b)) for b in expansions)
    return means


def plot(client: Any, run_id: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evaluation = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "eval/reward_mean"))
    training = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "reward_mean"))
    figure, axis = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    if training:
        axis.plot(*zip(*training), color="0.75", linewidth=1, label="training batches (2 passages)")
    axis.plot(*zip(*evaluation), marker="o", color="C0", label="held-out eval (8 passages x 4 samples)")
    axis.set_xlabel("step (optimizer steps per agent)")
    axis.set_ylabel("joint reward (0 to 1)")
    axis.set_title("Two SmolLM2-135M agents, writing task (MAGRPO, 2-core CPU)")
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)


def markdown(report: dict[str, Any]) -> str:
    lines = ["| eval rows, 4 samples each | base model | trained agents |", "|---|---:|---:|"]
    for name in report["terms"]["base"]:
        lines.append(f"| {name} | {report['terms']['base'][name]:.3f} | {report['terms']['trained'][name]:.3f} |")
    lines.append("")
    for example in report["examples"]:
        lines += [f"**{example['id']}**", "", "| | base model | trained agents |", "|---|---|---|"]
        for role, index in (("summary (agent 0)", 0), ("expansion (agent 1)", 1)):
            base, trained = (example[key][index].replace("\n", " ").replace("|", "/") for key in ("base", "trained"))
            lines.append(f"| {role} | {base} | {trained} |")
        lines.append(f"| reward | {example['base_reward']:.3f} | {example['trained_reward']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run's directory (WORKDIR/runs/<run id>)")
    parser.add_argument("--examples", type=int, default=3, help="eval passages shown side by side")
    parser.add_argument("--curve", type=Path, default=CURVE)
    args = parser.parse_args()
    import mlflow

    torch.set_num_threads(1)
    result = json.loads((args.run_dir / "result.json").read_text())
    settings = load_spec_config()
    config, base = settings["config"], settings["model"]
    client = mlflow.MlflowClient(result["tracking_uri"])
    if not client.get_metric_history(result["mlflow_run_id"], "eval/reward_mean") or all(
            m.step != 0 for m in client.get_metric_history(result["mlflow_run_id"], "eval/reward_mean")):
        before = base_evaluation(base, config)
        client.log_metric(result["mlflow_run_id"], "eval/reward_mean", before["eval/reward_mean"], step=0)
    plot(client, result["mlflow_run_id"], args.curve)
    trained = [str(path) for path in agent_directories(result, args.run_dir)]
    rows = eval_rows()
    sampled = {name: completions(dirs, rows, 4, config["temperature"], config["max_new_tokens"], config["seed"])
               for name, dirs in (("base", [base, base]), ("trained", trained))}
    shown = rows[:args.examples]
    greedy = {name: completions(dirs, shown, 1, None, config["max_new_tokens"], 0)
              for name, dirs in (("base", [base, base]), ("trained", trained))}
    from comlrl.tasks.writing import writing_reward

    report = {
        "terms": {name: term_means(*texts) for name, texts in sampled.items()},
        "examples": [{"id": row["id"], "base": [greedy["base"][0][i], greedy["base"][1][i]],
                      "trained": [greedy["trained"][0][i], greedy["trained"][1][i]],
                      "base_reward": writing_reward([greedy["base"][0][i]], [greedy["base"][1][i]])[0],
                      "trained_reward": writing_reward([greedy["trained"][0][i]], [greedy["trained"][1][i]])[0]}
                     for i, row in enumerate(shown)],
    }
    (args.run_dir / "writing_report.json").write_text(json.dumps(report, indent=1))
    print(markdown(report))
    print(f"\ncurve: {args.curve}")


if __name__ == "__main__":
    main()
