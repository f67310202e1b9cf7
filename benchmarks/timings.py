"""Re-measure the published timings (docs/performance.md, 'Timings') as a new user gets them: a fresh clone of this
repository's HEAD, its own new virtual environment, and the README's commands run as printed.

    .venv/bin/python benchmarks/timings.py                 # install, demo, test suite, end-to-end tier
    .venv/bin/python benchmarks/timings.py --skip-tests    # install and demo only (a few minutes)

Install is the first ``bash infra/bootstrap.sh demo`` minus a second one (the second reuses the venv, so it
is the demo alone); the test figures are the wall time of ``bash infra/bootstrap.sh test`` and of
``bash infra/bootstrap.sh test -m e2e`` after the install. Prints a Markdown table; run it on a quiet
machine (nothing else using the cores) for figures comparable to those in docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(command: list[str], cwd: Path, log: Path) -> tuple[float, int]:
    """Wall seconds and exit status of ``command``, its output in ``log``."""
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}  # a fresh shell, no venv active
    started = time.monotonic()
    with open(log, "w") as out:
        status = subprocess.call(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    return time.monotonic() - started, status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-tests", action="store_true", help="measure install and demo only")
    parser.add_argument("--keep", action="store_true", help="keep the clone (its path is printed)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="comlrl-timings-"))
    clone = work / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    steps = [("install + demo", ["bash", "infra/bootstrap.sh", "demo"]),
             ("demo", ["bash", "infra/bootstrap.sh", "demo"])]
    if not args.skip_tests:
        steps += [("test suite", ["bash", "infra/bootstrap.sh", "test", "-q"]),
                  ("end-to-end tier", ["bash", "infra/bootstrap.sh", "test", "-q", "-m", "e2e"])]
    figures: dict[str, tuple[float, int]] = {}
    for index, (name, command) in enumerate(steps):
        figures[name] = timed(command, clone, work / f"{index}.log")
        print(f"{name}: {figures[name][0]:.0f} s (exit {figures[name][1]}), log {work / f'{index}.log'}",
              file=sys.stderr)
    rows = [("install", figures["install + demo"][0] - figures["demo"][0], figures["install + demo"][1])]
    rows += [(name, seconds, status) for name, (seconds, status) in figures.items() if name != "install + demo"]
    print(f"\n{os.cpu_count()} CPUs, HEAD {subprocess.check_output(['git', 'rev-parse', '--short', 'HEAD'], cwd=clone, text=True).strip()}\n")
    print("| step | wall time | exit |\n|---|---|---|")
    for name, seconds, status in rows:
        print(f"| {name} | {seconds / 60:.1f} min ({seconds:.0f} s) | {status} |")
    if not args.keep:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    else:
        print(f"\nclone kept: {clone}")
    return 0 if all(status == 0 for _, _, status in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
