"""The launcher's side of the records requests: a FIFO per rank, numbered requests, answers.

Each worker's beacon thread reads its FIFO (``rank<r>.requests`` in the round's scratch
directory, named to it by ``DIST_LAUNCH_REQUESTS``) and answers a request with
``rank<r>.records.<id>.json`` beside it (:mod:`dist_launch.in_worker.records`).
Writing a request never blocks: a rank whose beacon is not reading (not started yet,
or a ``--no-python`` target) is reported, not waited for.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dist_launch.diagnostics.flight_records import RankRecords, RecordsError, parse_rank_records
from dist_launch.in_worker.records import REQUESTS_VARIABLE, records_path

NOT_READING = "its beacon thread is not reading requests (not started, or no Python)"


@dataclass(frozen=True)
class Request:
    """One request sent to the ranks.

    Attributes:
        id: Its number in the round.
        kind: ``hang`` or ``window``.
        asked: The ranks it reached.
        unreachable: The ranks it did not reach, and why.
    """

    id: int
    kind: str
    asked: tuple[int, ...]
    unreachable: Mapping[int, str] = field(default_factory=dict)


class RankRequests:
    """The requests FIFOs of one round's ranks.

    Args:
        run_dir: The round's scratch directory.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self._fifos: dict[int, Path] = {}
        self._next_id = 1

    def worker_variables(self, rank: int) -> dict[str, str]:
        """Creates ``rank``'s FIFO; the variable that names it to the worker."""
        path = self.run_dir / f"rank{rank}.requests"
        os.mkfifo(path, 0o600)
        self._fifos[rank] = path
        return {REQUESTS_VARIABLE: str(path)}

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks with a FIFO."""
        return tuple(sorted(self._fifos))

    def send(self, kind: str, ranks: tuple[int, ...] | None = None) -> Request:
        """Writes a request to every rank's FIFO (or those of ``ranks``), without blocking."""
        request_id = self._next_id
        self._next_id += 1
        line = json.dumps({"id": request_id, "kind": kind}).encode() + b"\n"
        asked: list[int] = []
        unreachable: dict[int, str] = {}
        for rank in self.ranks if ranks is None else ranks:
            try:
                fd = os.open(self._fifos[rank], os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as error:
                unreachable[rank] = NOT_READING if error.errno == errno.ENXIO else str(error)
                continue
            try:
                os.write(fd, line)  # shorter than PIPE_BUF: written whole or not at all
                asked.append(rank)
            except OSError as error:
                unreachable[rank] = f"its request FIFO is full or closed ({error})"
            finally:
                os.close(fd)
        return Request(request_id, kind, tuple(asked), unreachable)

    def answered(self, request: Request) -> tuple[int, ...]:
        """The asked ranks whose answer file is there."""
        return tuple(
            rank
            for rank in request.asked
            if records_path(self._fifos[rank], rank, request.id).exists()
        )

    def read(self, request: Request) -> dict[int, RankRecords]:
        """Each answer, parsed; a rank without an answer, or with a bad one, says why.

        The answer files are removed once read (a window's are about 1 MB each).
        """
        found: dict[int, RankRecords] = {}
        for rank, why in request.unreachable.items():
            found[rank] = RankRecords(rank, None, {}, missing=why)
        for rank in request.asked:
            path = records_path(self._fifos[rank], rank, request.id)
            try:
                text = path.read_bytes()
            except OSError:
                found[rank] = RankRecords(rank, None, {}, missing="it did not answer in time")
                continue
            with contextlib.suppress(OSError):
                path.unlink()
            try:
                found[rank] = parse_rank_records(text, rank, str(path))
            except RecordsError as error:
                found[rank] = RankRecords(rank, None, {}, missing=str(error))
        return found
