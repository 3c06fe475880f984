"""The slow-rank report of one round: every window, which ranks enter collectives late.

Once per ``--slow-ranks`` window the watch asks every rank of this node for its flight
records (:mod:`dist_launch.watch.rank_requests`), parses the answers on a thread, and,
with several nodes, exchanges each rank's enqueue times of the window's collectives on
the job board. :func:`~dist_launch.diagnostics.slow_ranks.find_slow_ranks` then names
the ranks that are consistently late; each node reports its own ranks, against all
ranks of the job: a warning on the launcher's log and one JSON line per slow rank in
``slow_ranks.jsonl`` in the run's log directory (when one exists). A balanced job
writes nothing.

It is a timer of the launcher's event loop (:meth:`SlowRankWatch.due`): a small state
machine that never blocks the loop. The ranks pay for each window's dump (about 40 ms
of the GIL per 2000 entries); when answering took more than ``MAX_COST_SHARE`` of the
window (a large ``TORCH_FR_BUFFER_SIZE``), the windows are stretched to keep it there,
and the log says so once.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from dist_launch.diagnostics.flight_records import (
    GroupKey,
    RankRecords,
    RecordsError,
    records_from_json,
    records_to_json,
)
from dist_launch.diagnostics.slow_ranks import find_slow_ranks, last_seqs
from dist_launch.rendezvous.job_board import JobBoard
from dist_launch.watch.rank_requests import RankRequests, Request

logger = logging.getLogger(__name__)

# How long the ranks may take to answer a window's request.
ANSWER_SECONDS = 5.0
# How long the other nodes' times of a window are waited for (a node missing is skipped).
EXCHANGE_SECONDS = 10.0
SLOW_RANKS_FILE = "slow_ranks.jsonl"
# The share of a window the ranks may spend answering its request.
MAX_COST_SHARE = 0.01


class Pending(Protocol):
    """A call on a thread (:meth:`dist_launch.agent.event_loop.EventLoop.call_in_thread`)."""

    done: bool
    error: BaseException | None

    @property
    def result(self) -> Any:
        """What the call returned."""


class SlowRankWatch:
    """The slow-rank report of one round on this node; see the module docstring.

    Args:
        window: Seconds per window (``--slow-ranks``).
        requests: The round's records requests.
        in_thread: Runs a call on a thread; its end reaches the loop.
        job_ranks: Every global rank of the job.
        nodes: Each rank of this node's node rank (other nodes' ranks come with their times).
        board: The job board, when several nodes share a store.
        log_file: ``slow_ranks.jsonl``, or None without a log directory.
        attempt: The round's attempt number.
        host: This node's host name.
    """

    def __init__(
        self,
        window: float,
        requests: RankRequests,
        in_thread: Callable[[Callable[[], Any]], Pending],
        *,
        job_ranks: Sequence[int],
        nodes: Mapping[int, int],
        board: JobBoard | None = None,
        log_file: Path | None = None,
        attempt: int = 0,
        host: str = "",
    ) -> None:
        self.window = window
        self.requests = requests
        self.in_thread = in_thread
        self.job_ranks = tuple(job_ranks)
        self.nodes = dict(nodes)
        self.board = board
        self.log_file = log_file
        self.attempt = attempt
        self.host = host
        self._next_window = time.monotonic() + window
        self._request: Request | None = None
        self._asked_at = 0.0
        self._parsing: Pending | None = None
        self._exchanging: tuple[str, float, dict[int, RankRecords]] | None = None
        self._after: dict[GroupKey, int] = {}
        self._windows = 0
        self._stretched = False
        self._interval = window  # the window, stretched when answering costs too much
        self.reported: list[dict[str, Any]] = []  # every line written, for the round's result

    def due(self, now: float) -> float | None:
        """The loop's timer: one step of the window's work; returns when the next is due."""
        if self._exchanging is not None:
            return self._exchange(now)
        if self._parsing is not None:
            if not self._parsing.done:
                return None  # its end wakes the loop
            parsing, self._parsing = self._parsing, None
            if parsing.error is not None:
                logger.debug("slow ranks: the answers could not be read", exc_info=parsing.error)
                return self._schedule(now)
            return self._window_read(parsing.result, now)
        if self._request is not None:
            request = self._request
            if len(self.requests.answered(request)) < len(request.asked) and (
                now < self._asked_at + ANSWER_SECONDS
            ):
                return min(now + 0.05, self._asked_at + ANSWER_SECONDS)
            self._request = None
            self._parsing = self.in_thread(lambda: self.requests.read(request))
            return None
        if now >= self._next_window:
            self._request = self.requests.send("window")
            self._asked_at = now
            return now + 0.05
        return self._next_window

    def _stretch(self, dump_s: float) -> None:
        """Keeps a rank's share of time spent dumping its records under MAX_COST_SHARE."""
        self._interval = max(self.window, dump_s / MAX_COST_SHARE)
        if self._interval > self.window and not self._stretched:
            self._stretched = True
            logger.warning(
                "slow-rank report: a rank took %.2f s to dump its records; a window every "
                "%.0f s keeps that under %g%% of its time (--slow-ranks %g)",
                dump_s,
                self._interval,
                100 * MAX_COST_SHARE,
                self.window,
            )

    def _schedule(self, now: float) -> float:
        self._next_window = now + self._interval
        return self._next_window

    def _window_read(self, records: dict[int, RankRecords], now: float) -> float | None:
        self._windows += 1
        self._stretch(max((r.dump_s for r in records.values() if r.dump_s), default=0.0))
        if self.board is None:
            self._judge(records, now)
            return self._schedule(now)
        topic = f"slow/{self._windows}"
        self.board.share(
            topic, json.dumps({str(r): records_to_json(v) for r, v in records.items()})
        )
        self._exchanging = (topic, now + EXCHANGE_SECONDS, records)
        return self._exchange(now)

    def _exchange(self, now: float) -> float | None:
        assert self._exchanging is not None and self.board is not None
        topic, deadline, records = self._exchanging
        shared = self.board.shared(topic)
        if shared is None and now < deadline:
            return min(now + 0.1, deadline)
        self._exchanging = None
        self.board.forget(topic)
        merged = dict(records)
        for node, payload in (shared or {}).items():
            try:
                for key, value in json.loads(payload).items():
                    rank = int(key)
                    merged[rank] = records_from_json(value, rank)
                    self.nodes.setdefault(rank, node)
            except (ValueError, RecordsError, AttributeError):
                logger.debug("slow ranks: node %d's times could not be read", node, exc_info=True)
        self._judge(merged, now)
        return self._schedule(now)

    def _judge(self, records: dict[int, RankRecords], now: float) -> None:
        with_records = {rank: r for rank, r in records.items() if r.missing is None}
        slow = find_slow_ranks(
            with_records, job_ranks=self.job_ranks, after=self._after, nodes=self.nodes
        )
        self._after.update(last_seqs(with_records))
        own = set(self.requests.ranks)
        for found in slow:
            if found.rank not in own:
                continue  # its own node reports it
            logger.warning("%s", found.describe(self.window))
            line = {
                "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "attempt": self.attempt,
                "window_s": self.window,
                "group": found.group,
                "backend": found.backend,
                "op": found.op,
                "rank": found.rank,
                "node": self.nodes.get(found.rank),
                "host": self.host,
                "lag_ms": round(found.lag_s * 1000, 1),
                "samples": found.samples,
                "share_late": round(found.share_late, 3),
            }
            self.reported.append(line)
            if self.log_file is not None:
                with self.log_file.open("a") as file:
                    file.write(json.dumps(line, sort_keys=True) + "\n")
