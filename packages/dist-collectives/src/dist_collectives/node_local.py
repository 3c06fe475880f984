"""Node-local coordination, Composer's: local rank 0 first, file waits, signal files.

A *node* is the set of ranks that share a ``NODE_RANK`` (``GROUP_RANK``,
``SLURM_NODEID``, ..., read through :class:`dist_core.DistEnv`); each has exactly one
local rank 0. Without a process group, a process whose environment describes one rank
is alone on its node: :func:`run_local_rank_zero_first` runs its block at once and
:func:`local_rank_zero_download_and_wait` does not wait.

:func:`run_local_rank_zero_first` signals through a gloo group per node, created on
its first call and kept for the life of the default group: local rank 0 runs the
block, then broadcasts on its node's group whether the block succeeded (with the
exception's text when it did not); the other local ranks wait for that broadcast,
bounded by ``timeout``, and run the block only after a success. No file is written,
so there is nothing to clean up.

:func:`local_rank_zero_download_and_wait` needs no process group: the other local
ranks wait, bounded by ``timeout``, for a file that local rank 0 creates.
:func:`get_node_signal_file_name` and :func:`write_signal_file` name and write such a
file.
"""

from __future__ import annotations

import logging
import os
import random
import string
import tempfile
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dist_collectives._group import GroupView, ProcessGroup, resolve_group
from dist_collectives.collectives import all_gather_object, barrier, broadcast_object_list
from dist_collectives.errors import CollectivesError
from dist_core.ranks import get_local_rank, get_node_rank, get_rank

logger = logging.getLogger(__name__)

__all__ = [
    "get_node_signal_file_name",
    "local_rank_zero_download_and_wait",
    "run_local_rank_zero_first",
    "write_signal_file",
]

# How long the other local ranks wait for local rank 0 unless told: torch's default
# process-group timeout, long enough for a dataset download.
_DEFAULT_TIMEOUT = timedelta(minutes=30)

_SIGNAL_FILE_PREFIX = "._signal_file_node"
_TOKEN_ALPHABET = string.ascii_letters + string.digits
_TOKEN_LENGTH = 6

# The status local rank 0 broadcasts: one status byte, four bytes of message length
# (big-endian), then the message in UTF-8, truncated to fit. Plain bytes: nothing is
# unpickled.
_STATUS_BYTES = 4096
_STATUS_OK = 1
_STATUS_FAILED = 2
_HEADER = 5

# Polling interval of the file wait: starts short so that a file that is nearly there
# is seen at once, and backs off to Composer's 0.1 s.
_POLL_FIRST_S = 0.005
_POLL_MAX_S = 0.1


def _seconds(timeout: float | timedelta, operation: str) -> float:
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"{operation}: timeout={timeout!r} must be a positive duration")
    return seconds


@dataclass(frozen=True)
class _Node:
    """This rank's node: its gloo group and the global ranks in local-rank order."""

    node_rank: int
    local_rank: int
    ranks: tuple[int, ...]
    group: ProcessGroup | None  # None when the node holds this rank alone

    @property
    def leader(self) -> int:
        """Global rank of local rank 0."""
        return self.ranks[0]


# Node groups of each live default group, keyed by it weakly (as _group.py caches
# views): a destroyed and re-created default group gets new node groups.
_nodes: weakref.WeakKeyDictionary[ProcessGroup, _Node] = weakref.WeakKeyDictionary()


def _node_layout(places: list[tuple[int, int]]) -> dict[int, list[int]]:
    """Global ranks per node, in local-rank order, from each rank's (node, local rank).

    Raises:
        CollectivesError: Two ranks claim the same place, or a node's local ranks are
            not 0, 1, ..., n-1.
    """
    by_node: dict[int, dict[int, int]] = {}
    for rank, (node_rank, local_rank) in enumerate(places):
        seats = by_node.setdefault(node_rank, {})
        if local_rank in seats:
            raise CollectivesError(
                f"run_local_rank_zero_first: global ranks {seats[local_rank]} and {rank} "
                f"both say they are local rank {local_rank} of node {node_rank}; check "
                "LOCAL_RANK and NODE_RANK (or your launcher's equivalents) on each rank"
            )
        seats[local_rank] = rank
    layout: dict[int, list[int]] = {}
    for node_rank, seats in sorted(by_node.items()):
        if sorted(seats) != list(range(len(seats))):
            raise CollectivesError(
                f"run_local_rank_zero_first: node {node_rank} has local ranks "
                f"{sorted(seats)} (global ranks {[seats[k] for k in sorted(seats)]}); "
                f"expected 0 to {len(seats) - 1}, one rank each; check LOCAL_RANK and "
                "NODE_RANK (or your launcher's equivalents) on each rank"
            )
        layout[node_rank] = [seats[k] for k in sorted(seats)]
    return layout


def _node_of(view: GroupView) -> _Node:
    """This rank's node group; the first call is a collective on the whole world."""
    world = view.group
    assert world is not None  # callers handle the single process
    known = _nodes.get(world)
    if known is not None:
        return known
    if not dist.is_gloo_available():
        raise CollectivesError(
            "run_local_rank_zero_first: this torch build has no gloo backend, which the "
            "per-node groups use; use local_rank_zero_download_and_wait instead"
        )
    places = all_gather_object((get_node_rank(), get_local_rank()), group=world)
    layout = _node_layout([(int(node), int(local)) for node, local in places])
    me = view.rank
    node_rank, local_rank = (int(x) for x in places[me])
    group: ProcessGroup | None = None
    # new_group is a collective: every rank creates every node's group, in node order.
    for ranks in layout.values():
        created = dist.new_group(ranks, backend="gloo")
        if me in ranks and len(ranks) > 1:
            group = created
    # A gloo group connects its members through the default group's store (hosted by
    # rank 0) and new_group returns without waiting for the other members: without
    # this barrier a rank could finish, or die, and take the store down while another
    # node's ranks are still connecting.
    barrier(group=world)
    node = _Node(node_rank, local_rank, tuple(layout[node_rank]), group)
    _nodes[world] = node
    return node


def _encode_status(status: int, message: str) -> torch.Tensor:
    data = message.encode("utf-8")[: _STATUS_BYTES - _HEADER]
    buffer = bytearray(_STATUS_BYTES)
    buffer[0] = status
    buffer[1:_HEADER] = len(data).to_bytes(_HEADER - 1, "big")
    buffer[_HEADER : _HEADER + len(data)] = data
    return torch.frombuffer(buffer, dtype=torch.uint8)


def _decode_status(tensor: torch.Tensor) -> tuple[int, str]:
    raw = bytes(tensor.tolist())
    length = int.from_bytes(raw[1:_HEADER], "big")
    return raw[0], raw[_HEADER : _HEADER + length].decode("utf-8", errors="replace")


def _broadcast_status(node: _Node, tensor: torch.Tensor, seconds: float) -> None:
    """Broadcasts ``tensor`` from local rank 0 on the node's group, within ``seconds``."""
    assert node.group is not None
    options = dist.BroadcastOptions()
    options.rootRank = 0  # local rank 0 is the group's first rank
    options.rootTensor = 0
    options.timeout = timedelta(seconds=seconds)
    node.group.broadcast([tensor], options).wait()


def _where(node: _Node) -> str:
    return f"local rank {node.local_rank} of node {node.node_rank}"


@contextmanager
def run_local_rank_zero_first(*, timeout: float | timedelta = _DEFAULT_TIMEOUT) -> Iterator[None]:
    """Runs the block on each node's local rank 0 first, then on the node's other ranks.

    For work that one process per node must do before the others may start, such as
    downloading a dataset to a node-local disk::

        with dist_collectives.run_local_rank_zero_first():
            dataset = CIFAR10(root, download=True)

    Every rank of the job must enter it (the first call creates a gloo group per
    node, a collective on the whole world). Nodes do not wait for each other: a
    node's other ranks start as soon as their own local rank 0 has finished.

    Args:
        timeout: How long the other local ranks wait for local rank 0 to finish the
            block, in seconds or as a ``timedelta`` (30 minutes by default); local
            rank 0 waits as long for them to receive its signal.

    Raises:
        dist_collectives.CollectivesError: On the other local ranks, when local rank
            0 raised inside the block (the message holds its exception), died, or did
            not finish within ``timeout``; they do not run the block then. Also when
            the environment describes several ranks but no process group is
            initialized, or the ranks' node places are inconsistent.
        ValueError: ``timeout`` is not positive.
    """
    seconds = _seconds(timeout, "run_local_rank_zero_first")
    view = resolve_group(None, "run_local_rank_zero_first")
    if view.is_single:
        yield
        return
    node = _node_of(view)
    if node.group is None:  # alone on its node
        yield
        return
    if node.local_rank == 0:
        yield from _lead(node, seconds)
    else:
        _follow(node, seconds)
        yield


def _lead(node: _Node, seconds: float) -> Iterator[None]:
    """Local rank 0: run the block, then tell the node how it went."""
    try:
        yield
    except BaseException as error:
        message = f"{type(error).__name__}: {error}"
        try:
            _broadcast_status(node, _encode_status(_STATUS_FAILED, message), seconds)
        except RuntimeError as signal_error:
            error.add_note(
                f"run_local_rank_zero_first: could not tell the other local ranks of node "
                f"{node.node_rank} (global ranks {list(node.ranks[1:])}) that the block "
                f"failed: {signal_error}"
            )
        raise
    try:
        _broadcast_status(node, _encode_status(_STATUS_OK, ""), seconds)
    except RuntimeError as error:
        raise CollectivesError(
            f"run_local_rank_zero_first: global rank {node.leader} ({_where(node)}) "
            f"finished the block but could not tell the other local ranks (global ranks "
            f"{list(node.ranks[1:])}) within {seconds:g} s: {error}; one of them may have "
            "died or not entered run_local_rank_zero_first (see their logs)"
        ) from error


def _follow(node: _Node, seconds: float) -> None:
    """Another local rank: wait for local rank 0's signal; raise unless it succeeded."""
    me = node.ranks[node.local_rank]
    status = torch.zeros(_STATUS_BYTES, dtype=torch.uint8)
    started = time.monotonic()
    try:
        _broadcast_status(node, status, seconds)
    except RuntimeError as error:
        waited = time.monotonic() - started
        if waited < 0.9 * seconds:  # the connection failed well before the timeout
            what = (
                f"lost contact with local rank 0 of its node (global rank {node.leader}) "
                f"after {waited:.1f} s of the block: {error}. It probably died (see its log)"
            )
        else:
            what = (
                f"waited {seconds:g} s for local rank 0 of its node (global rank "
                f"{node.leader}) to finish the block, and it did not signal: {error}. It "
                "may still be running the block (pass a longer timeout) or be stuck"
            )
        raise CollectivesError(
            f"run_local_rank_zero_first: global rank {me} ({_where(node)}) {what}"
        ) from error
    code, message = _decode_status(status)
    if code != _STATUS_OK:
        raise CollectivesError(
            f"run_local_rank_zero_first: local rank 0 of node {node.node_rank} (global rank "
            f"{node.leader}) raised inside the block: {message}; global rank {me} did not "
            "run it"
        )


@contextmanager
def local_rank_zero_download_and_wait(
    expected_file_path: str | os.PathLike[str],
    *,
    timeout: float | timedelta = _DEFAULT_TIMEOUT,
) -> Iterator[None]:
    """Holds every local rank but 0 until ``expected_file_path`` exists, then runs the block.

    Local rank 0 enters the block at once and is expected to create the file in it;
    the other local ranks poll for the file (every 0.1 s at most) and enter the block
    once it exists. It needs no process group, only ``LOCAL_RANK`` (or a launcher's
    equivalent), so it works before the group is initialized; with a group,
    :func:`run_local_rank_zero_first` waits without polling. A file that already
    exists (from an earlier run) releases the others at once. Local rank 0 should
    create the file atomically (write a temporary file in the same directory, then
    ``os.replace`` it): the others read it as soon as the name appears::

        with dist_collectives.local_rank_zero_download_and_wait(path):
            if dist_core.get_local_rank() == 0:
                download(url, path)

    Args:
        expected_file_path: The file local rank 0 creates.
        timeout: How long the other local ranks wait for the file, in seconds or as a
            ``timedelta`` (30 minutes by default).

    Raises:
        dist_collectives.CollectivesError: On the other local ranks, when the file did
            not appear within ``timeout`` (the message names it).
        ValueError: ``timeout`` is not positive.
    """
    operation = "local_rank_zero_download_and_wait"
    seconds = _seconds(timeout, operation)
    path = os.fspath(expected_file_path)
    local_rank = get_local_rank()
    if local_rank != 0:
        _wait_for_file(path, seconds, local_rank, operation)
    yield
    if local_rank == 0 and not os.path.exists(path):
        logger.warning(
            "%s: local rank 0 left the block but %s does not exist; the other local ranks "
            "of node %d wait for it until their timeout (%g s)",
            operation,
            path,
            get_node_rank(),
            seconds,
        )


def _wait_for_file(path: str, seconds: float, local_rank: int, operation: str) -> None:
    deadline = time.monotonic() + seconds
    delay = _POLL_FIRST_S
    while not os.path.exists(path):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CollectivesError(
                f"{operation}: {path} did not appear within {seconds:g} s; local rank 0 of "
                f"node {get_node_rank()} should create it (this is local rank {local_rank}, "
                f"global rank {get_rank()}). Check local rank 0's log for an error, check "
                "that every local rank uses the same path, or pass a longer timeout"
            )
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, _POLL_MAX_S)


def get_node_signal_file_name(rng: random.Random | None = None) -> str:
    """A file name for a node-local file wait, agreed by every rank of the job.

    The name is ``._signal_file_node{node_rank}_{token}``: ``token`` is six letters
    or digits drawn by global rank 0 and broadcast to every rank, and ``node_rank`` is
    the caller's node. The local ranks of a node therefore get the same name, and
    different nodes get different names, so that a directory shared by several nodes
    still signals within each node. With a process group, every rank must call it (it
    is a collective).

    Args:
        rng: Where the token is drawn from; a fresh ``random.Random()`` (seeded from
            the operating system) when None. Every rank draws from its own ``rng``,
            so seeded generators stay in step across ranks; rank 0's token is used.

    Returns:
        The file name (no directory).

    Raises:
        dist_collectives.CollectivesError: The environment describes several ranks
            but no process group is initialized.
    """
    view = resolve_group(None, "get_node_signal_file_name")
    generator = random.Random() if rng is None else rng
    token = ["".join(generator.choices(_TOKEN_ALPHABET, k=_TOKEN_LENGTH))]
    if not view.is_single:
        broadcast_object_list(token, src=0)
    return f"{_SIGNAL_FILE_PREFIX}{get_node_rank()}_{token[0]}"


def write_signal_file(signal_file_name: str, dir_path: str | os.PathLike[str] | None = None) -> str:
    """Local rank 0 writes the signal file; every rank gets its path.

    The file is written atomically (a temporary file in the same directory, then a
    rename), so a rank waiting for the name (for example in
    :func:`local_rank_zero_download_and_wait`) never finds it half-written. Removing
    it is the caller's job. Needs no process group.

    Args:
        signal_file_name: A file name, such as :func:`get_node_signal_file_name`'s.
        dir_path: The directory, created if missing (on every rank); the current
            working directory when None.

    Returns:
        The signal file's path, on every rank.

    Raises:
        ValueError: ``signal_file_name`` is empty or contains a path separator.
    """
    separators = [sep for sep in (os.sep, os.altsep) if sep]
    if signal_file_name in ("", ".", "..") or any(s in signal_file_name for s in separators):
        raise ValueError(
            f"write_signal_file: signal_file_name={signal_file_name!r} must be a plain file "
            "name (no directory); pass the directory as dir_path"
        )
    if dir_path is None:
        directory = os.getcwd()
    else:
        directory = os.fspath(dir_path)
        os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, signal_file_name)
    if get_local_rank() == 0:
        _write_atomically(path, f"local rank 0 done (global rank {get_rank()})\n")
    return path


def _write_atomically(path: str, text: str) -> None:
    directory, name = os.path.split(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
