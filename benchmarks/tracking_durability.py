"""The cost of a durable metrics send: ``MLflowCallback.on_log`` writes and ``fsync``s each step's record.

Measured per ``on_log`` (``--keys`` metrics per step, the size of a MAGRPO step's dict), in one process:

- ``on_log``: the callback as shipped (encode, one ``write``, one ``fsync``; delivery is left to
  the sender thread, kept idle here by an unreachable server and a long send interval);
- ``write only``: the same bytes appended without ``fsync`` (survives a killed process, not a
  lost machine);
- ``queue append``: what a send cost before (a deque append; the record reached disk up to a
  send interval later, and died with a killed process);
- ``resume scan``: opening a callback on a spool of ``--steps`` steps (``Spool.logged_steps``,
  how a resumed run learns which steps it already holds).

    .venv/bin/python benchmarks/tracking_durability.py --steps 2000 --keys 20
    .venv/bin/python benchmarks/tracking_durability.py --dir /path/on/another/filesystem
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from collections import deque
from pathlib import Path

from comlrl import tracking
from comlrl.tracking_spool import Spool, encode_record


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def summary(name: str, seconds: list[float]) -> str:
    ordered = sorted(seconds)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6  # noqa: E731
    return (f"{name:<14} median {pick(0.5):8.1f} us   p90 {pick(0.9):8.1f} us   p99 {pick(0.99):8.1f} us   "
            f"mean {statistics.fmean(seconds) * 1e6:8.1f} us")


def step_metrics(step: int, keys: int) -> dict[str, float]:
    return {f"agent_{k % 2}/metric_{k}": step * 0.001 + k for k in range(keys)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="on_log calls to time (default 2000)")
    parser.add_argument("--keys", type=int, default=20, help="metrics per step (default 20)")
    parser.add_argument("--dir", default=None, help="where the spools go (default a temporary folder)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        root = Path(folder)
        identity = {"run_id": "benchmark", "tracking_uri": f"http://127.0.0.1:{closed_port()}"}
        callback = tracking.MLflowCallback(identity, spool_dir=root / "shipped", send_interval=3600, drain_timeout=0)
        shipped = []
        for step in range(1, args.steps + 1):
            metrics = step_metrics(step, args.keys)
            started = time.perf_counter()
            callback.on_log(None, metrics, step)
            shipped.append(time.perf_counter() - started)
        callback.close(warn=False)

        path = root / "write-only.bin"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        written = []
        for step in range(1, args.steps + 1):
            metrics = step_metrics(step, args.keys)
            started = time.perf_counter()
            now_ms = int(time.time() * 1000)
            os.write(descriptor, encode_record({"metrics": [[k, float(v), now_ms, step] for k, v in metrics.items()]}))
            written.append(time.perf_counter() - started)
        os.close(descriptor)

        queue: deque = deque()
        queued = []
        for step in range(1, args.steps + 1):
            metrics = step_metrics(step, args.keys)
            started = time.perf_counter()
            now_ms = int(time.time() * 1000)
            queue.append({"metrics": [[k, float(v), now_ms, step] for k, v in metrics.items()]})
            queued.append(time.perf_counter() - started)

        spool = Spool(root / "shipped" / "benchmark")
        started = time.perf_counter()
        held = spool.logged_steps()
        scan = time.perf_counter() - started

    where = args.dir or "a temporary folder"
    print(f"{args.steps} steps of {args.keys} metrics, spool {spool.size / 1e6:.2f} MB, in {where}")
    print(summary("on_log", shipped))
    print(summary("write only", written))
    print(summary("queue append", queued))
    print(f"resume scan    {scan * 1e3:.1f} ms for {args.steps} steps "
          f"({len(held)} keys, last step {max(held.values())})")


if __name__ == "__main__":
    main()
