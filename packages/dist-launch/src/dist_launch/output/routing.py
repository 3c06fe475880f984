"""What goes where: each local rank's stdout and stderr, to the console and/or its file.

torchrun's flags, with torchrun's meaning:

``-r/--redirects`` and ``-t/--tee``
    ``0`` no stream, ``1`` stdout, ``2`` stderr, ``3`` both, for every local rank; or a
    map ``LOCAL_RANK:VALUE,...`` such as ``0:1,1:2`` (a rank it does not name gets
    ``0``). A redirected stream goes to the rank's log file only; a tee'd stream goes
    to the file and to the console. A stream both redirected and tee'd is tee'd.
``--local-ranks-filter 0,2``
    Only those local ranks appear on the console; the files are not affected.

Our choices where torchrun's behaviour is not a contract:

- With ``--log-dir``, every rank's stdout and stderr always go to their files too
  (torchrun writes only the redirected and tee'd streams there): the flags choose what
  the console shows, never what the log keeps.
- Without ``--log-dir``, a redirected or tee'd stream goes to a fresh directory under
  the system's temporary directory, as torchrun does; the launcher says where
  (:meth:`OutputRouting.needs_files`, :meth:`dist_launch.output.log_layout.LogLayout.create`).
- A map may name local ranks of two or more digits (``12:3``); torch's parser accepts
  single digits only, so every value torchrun accepts is accepted with its meaning.
- ``--local-ranks-filter`` refuses negative ranks (torchrun takes them and shows
  nothing for them).
- Every console line carries a prefix, ``[rank<global rank>]: `` unless
  ``--log-line-prefix-template`` (torch 2.14's flag; also read from
  ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``, as torchrun does) says otherwise. torchrun
  prefixes only tee'd streams, with ``[${role_name}${local_rank}]:``; here the
  template applies to every console line, rendered as torchrun renders it (macros
  ``${role_name}``, ``${local_rank}``, ``${rank}``, ``${hostname}``, an unknown one
  left as written, nothing added after it). Log files never get a prefix.
"""

from __future__ import annotations

import enum
import re
import string
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

Stream = Literal["stdout", "stderr"]
STREAMS: tuple[Stream, ...] = ("stdout", "stderr")

_VALUE = re.compile(r"[0-3]")
_MAP = re.compile(r"\d+:[0-3](,\d+:[0-3])*")


class Std(enum.IntFlag):
    """A set of standard streams, as torchrun's ``-r``/``-t`` values number them."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3

    @classmethod
    def of(cls, stream: Stream) -> Std:
        """The flag of one stream."""
        return cls.OUT if stream == "stdout" else cls.ERR


@dataclass(frozen=True)
class StreamSetting:
    """A parsed ``-r``/``-t`` value: the streams of every rank, or per named rank."""

    default: Std = Std.NONE
    per_rank: dict[int, Std] = field(default_factory=dict)

    @classmethod
    def parse(cls, value: str, flag: str) -> StreamSetting:
        """Parses ``3`` or ``0:1,1:2``; the last entry for a rank wins, as in torchrun.

        Raises:
            ValueError: ``value`` is neither, naming ``flag`` and what is accepted.
        """
        if _VALUE.fullmatch(value):
            return cls(default=Std(int(value)))
        if _MAP.fullmatch(value):
            per_rank: dict[int, Std] = {}
            for entry in value.split(","):
                rank, streams = entry.split(":")
                per_rank[int(rank)] = Std(int(streams))
            return cls(per_rank=per_rank)
        raise ValueError(
            f"{flag} {value!r}: expected 0 (no stream), 1 (stdout), 2 (stderr), 3 (both), "
            "or a map of local ranks to those values such as 0:1,1:2"
        )

    def of_rank(self, local_rank: int) -> Std:
        """The streams this setting names for ``local_rank``."""
        return self.per_rank.get(local_rank, self.default)


def parse_local_ranks_filter(value: str) -> set[int] | None:
    """Parses ``--local-ranks-filter``: ``0,2`` -> {0, 2}; empty -> None (no filter).

    Raises:
        ValueError: Not a comma-separated list of local ranks, naming the flag.
    """
    if not value.strip():
        return None
    try:
        ranks = {int(item) for item in value.split(",")}
    except ValueError:
        ranks = set()
    if not ranks or min(ranks) < 0:
        raise ValueError(
            f"--local-ranks-filter {value!r}: expected a comma-separated list of local "
            "ranks (0 or more), such as 0,2"
        )
    return ranks


@dataclass(frozen=True)
class Destinations:
    """Where one stream of one local rank goes."""

    console: bool
    file: bool


DEFAULT_PREFIX_TEMPLATE = "[rank${rank}]: "


@dataclass(frozen=True)
class OutputRouting:
    """The destinations of every local rank's streams, from torchrun's output flags."""

    redirects: StreamSetting = field(default_factory=StreamSetting)
    tee: StreamSetting = field(default_factory=StreamSetting)
    local_ranks_filter: frozenset[int] | None = None
    has_log_dir: bool = False
    prefix_template: str = DEFAULT_PREFIX_TEMPLATE

    @classmethod
    def for_flags(
        cls,
        redirects: str = "0",
        tee: str = "0",
        local_ranks_filter: set[int] | None = None,
        has_log_dir: bool = False,
        prefix_template: str | None = None,
    ) -> OutputRouting:
        """Parses ``-r``/``-t`` as given on the command line (see the module docstring).

        Args:
            redirects: The ``--redirects`` value.
            tee: The ``--tee`` value.
            local_ranks_filter: The parsed ``--local-ranks-filter`` (see
                :func:`parse_local_ranks_filter`), None to show every rank.
            has_log_dir: Whether ``--log-dir`` was given.
            prefix_template: The ``--log-line-prefix-template`` value, None (or empty)
                for ``[rank<r>]: ``.

        Raises:
            ValueError: A value does not parse; the message names the flag.
        """
        return cls(
            redirects=StreamSetting.parse(redirects, "--redirects"),
            tee=StreamSetting.parse(tee, "--tee"),
            local_ranks_filter=None
            if local_ranks_filter is None
            else frozenset(local_ranks_filter),
            has_log_dir=has_log_dir,
            prefix_template=prefix_template or DEFAULT_PREFIX_TEMPLATE,
        )

    def console_prefix(self, rank: int, local_rank: int, role: str, hostname: str) -> bytes:
        """The prefix of each console line of this rank (see the module docstring)."""
        rendered = string.Template(self.prefix_template).safe_substitute(
            role_name=role, local_rank=local_rank, rank=rank, hostname=hostname
        )
        return rendered.encode()

    def route(self, local_rank: int, stream: Stream) -> Destinations:
        """Where ``stream`` of ``local_rank`` goes."""
        flag = Std.of(stream)
        redirected = bool(self.redirects.of_rank(local_rank) & flag)
        teed = bool(self.tee.of_rank(local_rank) & flag)
        shown = self.local_ranks_filter is None or local_rank in self.local_ranks_filter
        return Destinations(
            console=shown and (teed or not redirected),
            file=self.has_log_dir or redirected or teed,
        )

    def needs_files(self, local_ranks: Iterable[int]) -> bool:
        """Whether any stream of these ranks goes to a file, so a log layout is needed."""
        return any(self.route(rank, stream).file for rank in local_ranks for stream in STREAMS)
