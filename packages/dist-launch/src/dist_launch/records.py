"""Moved to :mod:`dist_core.rank_files` (dist-core 0.3); these names stay importable here."""

from __future__ import annotations

from dist_core.rank_files import (
    RECORD_VERSION,
    STACK_DUMP_SIGNAL,
    ErrorRecord,
    RankFiles,
    exit_status_of,
    read_error_record,
    read_torchelastic_error,
    write_error_record,
)

__all__ = [
    "RECORD_VERSION",
    "STACK_DUMP_SIGNAL",
    "ErrorRecord",
    "RankFiles",
    "exit_status_of",
    "read_error_record",
    "read_torchelastic_error",
    "write_error_record",
]
