"""torch elastic's worker watchdog (``FileTimerServer``), served as torchrun serves it.

With ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` in the launcher's environment, torchrun's
agent runs torch's own :class:`torch.distributed.elastic.timer.FileTimerServer` on a
FIFO (``TORCHELASTIC_TIMER_FILE`` if set, else a fresh path in the temporary
directory) and gives the workers that path, so that a script using
``FileTimerClient`` and ``expires(after=...)`` works unchanged. We run the same server,
reading torch's own request format. Only what happens when a timer expires differs:
torch sends the timer's signal to the worker and then to the agent itself; here the
expiry is recorded and handled as a hang (every rank's stack, the report, a restart
within ``--max-restarts`` or the hang's exit status).

torch is imported only when the variable asks for the server.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

ENABLE_VARIABLE = "TORCHELASTIC_ENABLE_FILE_TIMER"
FILE_VARIABLE = "TORCHELASTIC_TIMER_FILE"
# How often torch's server looks for expired timers (torchrun's value).
_MAX_INTERVAL = 0.1


@dataclass(frozen=True)
class ExpiredTimer:
    """A timer a worker set with ``expires(after=...)`` that ran out."""

    pid: int
    scope: str


def file_timer_requested(environ: Mapping[str, str]) -> bool:
    """True when ``TORCHELASTIC_ENABLE_FILE_TIMER`` is ``1``, as torchrun checks it."""
    return environ.get(ENABLE_VARIABLE) == "1"


class FileTimerWatch:
    """torch's ``FileTimerServer``, with expired timers kept for the launcher's loop.

    Args:
        run_id: The run id torch's server logs with its events.
        environ: Where ``TORCHELASTIC_TIMER_FILE`` is read (``os.environ`` by default).
    """

    def __init__(self, run_id: str, environ: Mapping[str, str] | None = None) -> None:
        from torch.distributed.elastic.timer.file_based_local_timer import (  # noqa: PLC0415
            FileTimerServer,
        )

        env = os.environ if environ is None else environ
        self.path = env.get(FILE_VARIABLE) or os.path.join(
            tempfile.gettempdir(), f"watchdog_timer_{uuid.uuid4()}"
        )
        self._lock = threading.Lock()
        self._expired: list[ExpiredTimer] = []
        self._scopes: dict[int, list[str]] = {}
        watch = self

        class _Server(FileTimerServer):
            """torch's server, reaping by telling the launcher instead of by a signal."""

            def _reap_worker(self, worker_pid: int, signal: int) -> bool:
                if worker_pid != os.getpid():  # torch then signals the agent itself
                    watch._record(worker_pid)
                return True

        def log_event(name: str, request: Any) -> None:
            if name == "timer expired" and request is not None:
                with self._lock:
                    self._scopes.setdefault(int(request.worker_pid), []).append(
                        str(request.scope_id)
                    )

        self._server = _Server(
            file_path=self.path,
            run_id=run_id,
            max_interval=_MAX_INTERVAL,
            daemon=True,
            log_event=log_event,
        )
        self._server.start()
        logger.info("serving torch elastic's FileTimerServer at %s", self.path)

    def _record(self, pid: int) -> None:
        with self._lock:
            scopes = self._scopes.pop(pid, None) or ["?"]
            self._expired.append(ExpiredTimer(pid, scopes[0]))

    def take_expired(self) -> list[ExpiredTimer]:
        """The timers that expired since the last call."""
        with self._lock:
            expired, self._expired = self._expired, []
        return expired

    def close(self) -> None:
        """Stops the server and removes its FIFO."""
        self._server.stop()
