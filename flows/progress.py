"""Training progress as the flow reports it: a Prefect progress artifact and ``flows.progress`` log records.

:class:`StepProgress` is a trainer callback: at every ``on_log`` of a training step it records
the global step and the step's reward. It never waits on the Prefect API: the progress
artifact is updated by a background thread (:class:`ProgressArtifact`) with the newest value,
at most every ``interval`` seconds, and finally when the run ends. The same steps, and each
finished boundary, are emitted as records of the standard ``flows.progress`` logger
(``extra={"progress": {...}}``): nothing shows them in library use; the demo's console
(:mod:`flows.console`) draws its progress bar and boundary lines from them.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from typing import Any

from comlrl.callbacks import TrainerCallback
from flows import orchestrator

logger = logging.getLogger("flows.progress")


def emit(kind: str, message: str, **fields: Any) -> None:
    """A ``flows.progress`` record (``kind``: ``start``, ``step``, ``boundary``, ``gate``)."""
    level = logging.DEBUG if kind == "step" else logging.INFO
    if logger.isEnabledFor(level):
        logger.log(level, message, extra={"progress": {"kind": kind, **fields}})


class ProgressArtifact:
    """A Prefect progress artifact of the current flow run, updated from a background thread."""

    def __init__(self, key: str, description: str, interval: float = 1.0) -> None:
        from prefect.artifacts import create_progress_artifact

        self.artifact_id = create_progress_artifact(0.0, key=key, description=description)
        self.interval = interval
        self._value: float | None = None
        self._sent: float | None = 0.0
        self._changed = threading.Event()
        self._stop = threading.Event()
        self.errors = 0
        context = contextvars.copy_context()  # the run's Prefect settings (API URL) for the thread
        self._thread = threading.Thread(target=context.run, args=(self._loop,), daemon=True, name="progress-artifact")
        self._thread.start()

    def update(self, percent: float) -> None:
        self._value = max(0.0, min(100.0, percent))
        self._changed.set()

    def _send(self) -> None:
        from prefect.artifacts import update_progress_artifact

        value = self._value
        if value is None or value == self._sent or orchestrator.outage() is not None:
            return
        try:
            update_progress_artifact(self.artifact_id, value)
            self._sent = value
        except Exception as error:  # the UI's progress is not worth failing a run for
            self.errors += 1
            if orchestrator.unanswered(error):  # the run reports the outage once
                orchestrator.record_outage(error)
            elif self.errors == 1:
                logger.warning("could not update the progress artifact: %s", error)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._changed.wait()
            self._changed.clear()
            self._send()
            self._stop.wait(self.interval)

    def close(self, timeout: float = 5.0) -> None:
        """Send the newest value and stop the thread (waiting at most ``timeout`` seconds for a call in progress,
        none during an outage)."""
        self._stop.set()
        self._changed.set()
        self._thread.join(0 if orchestrator.outage() else timeout)
        if not self._thread.is_alive():  # else the API is slow or gone: no second call beside the first
            self._send()


def duration(seconds: float) -> str:
    """``42 s``, ``7 min``, ``2 h 05 min``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


class StepProgress(TrainerCallback):
    """Counts training steps towards ``total`` for the progress artifact and the console; every
    ``every`` seconds (and at the first step) it also says where training is through ``say`` (the
    flow's run logger: the console of ``comlrl run`` and the Prefect UI), so a long run is never
    silent: ``step 37/512 (7 %) · reward 0.312 · 4.1 s/step · about 32 min left``."""

    def __init__(self, total: int, artifact: ProgressArtifact | None = None, say: Any = None, every: float = 30.0,
                 clock: Any = time.monotonic) -> None:
        self.total = max(total, 1)
        self.artifact = artifact
        self.reward: float | None = None
        self.say, self.every, self.clock = say, every, clock
        self._said: tuple[float, int] | None = None  # (time, step) of the last line said

    def heartbeat(self, done: int) -> str | None:
        """The progress line due at step ``done`` (None when the last one is less than ``every`` s old)."""
        now = self.clock()
        if self._said is not None and now - self._said[0] < self.every:
            return None
        parts = [f"step {done}/{self.total} ({100 * done // self.total} %)"]
        if self.reward is not None:
            parts.append(f"reward {self.reward:.3f}")
        if self._said is not None and done > self._said[1]:
            per_step = (now - self._said[0]) / (done - self._said[1])
            parts += [f"{per_step:.2g} s/step", f"about {duration(per_step * (self.total - done))} left"]
        self._said = (now, done)
        return " · ".join(parts)

    def on_log(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        if any(key.startswith(("eval/", "pbrl/")) for key in metrics):
            return  # evaluations and PbRL stage records are no training steps
        done = getattr(trainer, "state").global_step
        self.reward = metrics.get("reward_mean", self.reward)
        if self.artifact is not None:
            self.artifact.update(100.0 * done / self.total)
        emit("step", f"step {done}/{self.total}", done=done, total=self.total, reward=self.reward)
        if self.say is not None and (line := self.heartbeat(done)) is not None:
            self.say(line)
