"""One call of a user reward function, bounded: retries with backoff, a timeout, and a stop signal
that is not kept waiting.

A reward function is user code that may call a service: it can raise now and then, hang, or call
``sys.exit``. :class:`RewardCallPolicy` (from the config's ``reward_retries``,
``reward_retry_backoff`` and ``reward_timeout``) says what a call may take:

- an exception (or ``SystemExit``) is retried up to ``retries`` times, waiting ``backoff * 2**k``
  seconds before retry k+1; once they are spent it becomes :class:`RewardCallError` naming the
  function, the attempts and the last error (``SystemExit`` included: a reward never ends the
  process without a word);
- with a ``timeout``, the call runs in a daemon thread and counts as failed (and is retried) after
  that many seconds; Python cannot kill the thread, so a hung call keeps its thread until it
  returns on its own, and its late answer is ignored;
- a stop request (SIGTERM/SIGINT) seen while waiting for a call or a retry ends the wait with
  :class:`RewardWaitInterrupted`: the training loop puts the step's starting point back and
  checkpoints the last completed step, so no finished step is lost and the run stops within the
  timeout (or at once, when waiting for a retry).

Without a timeout the call runs in the training thread, as before (nothing changes for the default).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from comlrl.errors import TrainingInterrupted

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05  # how often a wait looks at the stop request


class RewardCallError(RuntimeError):
    """A reward function failed on every attempt (raised, exited or timed out)."""


class RewardWaitInterrupted(TrainingInterrupted):
    """A stop signal arrived while a reward call (or its retry) was awaited: the step did not finish."""

    mid_step = True


@dataclass(frozen=True)
class RewardCallPolicy:
    retries: int = 0
    backoff: float = 1.0
    timeout: float | None = None

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"reward_retries must be >= 0, got {self.retries}")
        if self.backoff < 0:
            raise ValueError(f"reward_retry_backoff must be >= 0, got {self.backoff}")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"reward_timeout must be > 0 seconds or None, got {self.timeout}")


def _describe(error: BaseException) -> str:
    if isinstance(error, SystemExit):
        return f"called sys.exit({error.code!r})"
    if isinstance(error, TimeoutError):
        return str(error)
    return f"raised {type(error).__name__}: {error}"


class BoundedCaller:
    """Calls reward functions under a :class:`RewardCallPolicy`, watching a stop request (any object
    with ``requested`` and ``signal_name``, see :mod:`comlrl.training.signals`)."""

    def __init__(self, policy: RewardCallPolicy | None = None) -> None:
        self.policy = policy or RewardCallPolicy()
        self.stop_request: Any = None

    def watch_stop(self, request: Any) -> None:
        self.stop_request = request

    def _stopping(self) -> bool:
        return self.stop_request is not None and bool(self.stop_request.requested)

    def _interrupted(self, name: str, waiting_for: str) -> RewardWaitInterrupted:
        return RewardWaitInterrupted(f"{self.stop_request.signal_name} received while waiting for {waiting_for} of "
                                     f"reward function {name}: the step was not finished")

    def call(self, func: Callable[..., Any], name: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        attempts = self.policy.retries + 1
        for attempt in range(1, attempts + 1):
            try:
                return self._once(func, name, args, kwargs)
            except (Exception, SystemExit) as error:  # KeyboardInterrupt (a second signal) goes through
                if isinstance(error, RewardWaitInterrupted):
                    raise
                if attempt == attempts:
                    tries = f" (after {attempts} attempts)" if attempts > 1 else ""
                    raise RewardCallError(f"reward function {name} {_describe(error)}{tries}") from error
                delay = self.policy.backoff * 2 ** (attempt - 1)
                logger.warning("reward function %s %s; retry %d of %d in %.1f s", name, _describe(error), attempt,
                               self.policy.retries, delay)
                self._sleep(delay, name)

    def _sleep(self, seconds: float, name: str) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self._stopping():
                raise self._interrupted(name, "a retry")
            time.sleep(min(POLL_SECONDS, left))

    def _once(self, func: Callable[..., Any], name: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        if self.policy.timeout is None:
            return func(*args, **kwargs)
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                outcome["value"] = func(*args, **kwargs)
            except BaseException as error:  # handed to the training thread
                outcome["error"] = error

        worker = threading.Thread(target=target, name=f"reward {name}", daemon=True)
        worker.start()
        deadline = time.monotonic() + self.policy.timeout
        while worker.is_alive():
            if self._stopping():
                raise self._interrupted(name, "a call")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"did not return within reward_timeout={self.policy.timeout:g} s")
            worker.join(min(POLL_SECONDS, left))
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]
