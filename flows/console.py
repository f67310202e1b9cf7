"""The command line's console: the demo's quiet one, and the tracebacks ``comlrl run`` keeps in a log file.

``comlrl run``/``resume`` show every log line, and draw the demo's bar on a terminal (:func:`attach_bar`); without
``--verbose`` the tracebacks attached to log records go to the run's log file instead of the console
(:func:`tracebacks_to`), and the command ends with one ``comlrl:`` line naming that file. Library use is never
changed. ``comlrl demo`` installs the quiet console (:func:`install`); ``--verbose`` leaves the console as the
libraries make it. What the demo silences:

- third-party progress bars (Hugging Face's "Loading weights", "Writing model shards",
  ``datasets``' "Generating train split"): ``HF_HUB_DISABLE_PROGRESS_BARS`` /
  ``HF_DATASETS_DISABLE_PROGRESS_BARS``;
- Prefect's INFO lines on the console (``PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL=WARNING``: the
  flow-run logs still reach the Prefect API and UI) and MLflow's INFO lines
  (``MLFLOW_LOGGING_LEVEL=WARNING``);
- the known-harmless lines in :data:`KNOWN_HARMLESS` (MLflow's model-card and license warnings
  for local models, its registration notices), dropped line by line from standard error.

Every other warning or error still reaches the console. The progress bar and the boundary
lines come from the ``flows.progress`` records of :mod:`flows.progress`.
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, TextIO

QUIET_ENVIRONMENT = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
    "MLFLOW_LOGGING_LEVEL": "WARNING",
}
# Lines third-party code writes that say nothing wrong about a local demo run.
KNOWN_HARMLESS = tuple(re.compile(pattern) for pattern in (
    r"The model card could not be retrieved from the hub",
    r"Unable to find license information for this model",
    r"^Successfully registered model '",
    r"^Registered model '.*' already exists\. Creating a new version",
    r"^Created version '\d+' of model '",
    r"Running model prediction to infer the model output signature",
    r"Validating input example against model signature",
    r"friendly reminder - the current text generation call has exceeded the model's predefined maximum length",
    # The agents' signatures declare max_new_tokens / do_sample as params on purpose.
    r"params provided to the `predict` method will override the inference configuration saved with the model",
))


def harmless(line: str) -> bool:
    return any(pattern.search(line) for pattern in KNOWN_HARMLESS)


class FilteredStream(io.TextIOBase):
    """A text stream that passes whole lines on to ``target`` unless :func:`harmless`."""

    def __init__(self, target: TextIO) -> None:
        self.target = target
        self.pending = ""
        self.dropped = 0

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if harmless(line):
                self.dropped += 1
            else:
                self.target.write(line + "\n")
        if self.pending and ("\r" in self.pending or len(self.pending) > 4096):  # a bar redraw: pass it on
            self.target.write(self.pending)
            self.pending = ""
        return len(text)

    def flush(self) -> None:
        self.target.flush()

    def isatty(self) -> bool:
        return self.target.isatty()

    def fileno(self) -> int:
        return self.target.fileno()


class ProgressConsole(logging.Handler):
    """Draws ``flows.progress`` records: a bar for steps, a line for each boundary and the gate."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(logging.DEBUG)
        self.stream = stream
        self.bar: Any = None

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        event = getattr(record, "progress", None) or {}
        kind = event.get("kind")
        if kind == "start":
            if self.bar is None:
                self.bar = tqdm(total=event["total"], initial=event["done"], desc="training", unit="step",
                                file=self.stream, dynamic_ncols=True, leave=True)
        elif kind == "step" and self.bar is not None:
            self.bar.update(event["done"] - self.bar.n)
            if event.get("reward") is not None:
                self.bar.set_postfix(reward=f"{event['reward']:.3f}", refresh=False)
        elif kind == "boundary":
            tqdm.write(f"  {record.getMessage()}", file=self.stream)
            if event["number"] == event["total"]:
                self.close_bar()
        elif kind == "gate":
            self.close_bar()
            gate = event["gate"]
            verdict = "promoted to champion" if gate["promoted"] else "not promoted (the champion stays)"
            tqdm.write(f"gate: {gate['candidate']} {verdict}: {gate['reason']}", file=self.stream)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def attach_bar(stream: TextIO | None = None) -> ProgressConsole | None:
    """For ``comlrl run``/``resume``: the progress bar and boundary lines on ``stream`` (standard error) when
    it is a terminal, beside every log line as before (nothing is silenced, the records still reach the
    flow-run log); nothing when it is not a terminal (a log file, a worker's output, a pipe)."""
    stream = stream if stream is not None else sys.stderr
    if not stream.isatty():
        return None
    console = ProgressConsole(stream)
    progress = logging.getLogger("flows.progress")
    progress.addHandler(console)
    progress.addHandler(_Propagate())  # INFO and up go on as before; the per-step DEBUG records feed the bar only
    progress.setLevel(logging.DEBUG)
    progress.propagate = False
    return console


class _Propagate(logging.Handler):
    """Hands ``flows.progress`` records of INFO and above to the parent logger, as propagation would."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("flows").handle(record)


LOG_FORMAT = "%(asctime)s | %(levelname)-7s | %(name)s - %(message)s"


class WithoutTraceback(logging.Formatter):
    """Formats a record as ``inner`` does, leaving out its exception's traceback and stack (the record's message,
    which names the exception, stays)."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        kept = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = kept


class LogFile(logging.FileHandler):
    """The run's log file, appended. A record that cannot be written (a full disk) is counted and dropped, and the
    file is reopened for the next one, so the records written once there is room again are kept. It never goes
    through logging's own error report: that prints a traceback to standard error, which Prefect's print-to-log
    (``log_prints``) hands back to this handler as a record, whose failure prints again, until Python's recursion
    limit (thousands of console lines, and a RecursionError raised into training)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, encoding="utf-8")
        self.lost = 0  # records not written
        self.error: BaseException | None = None  # why the first of them was not
        self.last_lost = False  # whether the latest record was lost

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if self.stream is None:
                self.stream = self._open()
        except OSError:
            self.handleError(record)
            return
        self.last_lost = False
        logging.StreamHandler.emit(self, record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        self.lost += 1
        self.last_lost = True
        if self.error is None:
            self.error = sys.exc_info()[1]
        stream, self.stream = self.stream, None  # reopened for the next record; what it buffered is dropped
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass

    def trouble(self) -> str | None:
        """What the closing line says of this file when records were lost (None when all were written)."""
        if not self.lost:
            return None
        why = f"{type(self.error).__name__}: {self.error}" if self.error is not None else "unknown"
        if self.last_lost:
            return f"the traceback could not be written to {self.baseFilename} ({why}); --verbose prints it"
        return f"traceback: {self.baseFilename}, which lost {self.lost} earlier records ({why})"


def tracebacks_to(log: Path) -> LogFile:
    """Every record the console loggers see, tracebacks included, also goes to ``log`` (appended, :class:`LogFile`);
    their console handlers stop printing tracebacks. The console loggers are the root logger (Prefect's handlers)
    and each logger with handlers of its own that does not propagate (MLflow's ``mlflow``, configured here by
    importing it, so that its database errors too leave their tracebacks in the file). Call after Prefect has
    configured logging (it does on import). Returns the file's handler."""
    import mlflow  # noqa: F401  (configures its loggers: its own console handler, not propagating to the root)

    log.parent.mkdir(parents=True, exist_ok=True)
    keeper = LogFile(log)
    keeper.setFormatter(logging.Formatter(LOG_FORMAT))
    for logger in console_loggers():
        for handler in logger.handlers:
            console = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            if console and not isinstance(handler.formatter, WithoutTraceback):
                handler.setFormatter(WithoutTraceback(handler.formatter))
        logger.addHandler(keeper)
    return keeper


def log_file_trouble(log: Path) -> str | None:
    """What the closing line says of the run's log file ``log`` when the :class:`LogFile` writing it lost records
    (:meth:`LogFile.trouble`); None when it lost none or is not attached."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, LogFile) and Path(handler.baseFilename) == Path(os.path.abspath(log)):
            return handler.trouble()
    return None


def console_loggers() -> list[logging.Logger]:
    """The root logger and every configured logger whose records stop at its own handlers."""
    own = [logger for logger in logging.Logger.manager.loggerDict.values()
           if isinstance(logger, logging.Logger) and logger.handlers and not logger.propagate]
    return [logging.getLogger(), *own]


def install(verbose: bool) -> ProgressConsole | None:
    """Quiet the console for the demo (nothing when ``verbose``); call before Prefect, MLflow and
    transformers are imported, so their settings take effect."""
    if verbose:
        return None
    for key, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    terminal = sys.stderr
    sys.stderr = FilteredStream(terminal)
    console = ProgressConsole(terminal)
    progress = logging.getLogger("flows.progress")
    progress.addHandler(console)
    progress.setLevel(logging.DEBUG)
    progress.propagate = False
    return console
