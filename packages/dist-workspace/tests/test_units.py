"""Sizes for people: what --max-shard-size accepts, how sizes, rates and times print."""

from __future__ import annotations

import io

import pytest

from dist_workspace.progress import ProgressLine, interval_from_environ
from dist_workspace.units import format_bytes, format_duration, format_rate, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5GB", 5 * 10**9),  # decimal, as transformers' convert_file_size_to_int
        ("500MB", 500 * 10**6),
        ("2GiB", 2 * 2**30),  # binary
        ("1.5GB", 1_500_000_000),
        ("10KB", 10_000),
        ("3mib", 3 * 2**20),
        ("1000000", 1_000_000),  # bare bytes
        ("64B", 64),
        (" 2 GB ", 2 * 10**9),
    ],
)
def test_parse_size_reads_sizes_as_transformers_does(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("5Gb", "bits"),  # transformers would read 5 gigabits = 625 MB: refused instead
        ("5gb", "bits"),
        ("5XB", "unknown unit"),
        ("GB", "not a size"),
        ("-1GB", "not a size"),
        ("0", "at least 1 byte"),
    ],
)
def test_parse_size_refuses_what_it_cannot_read_unambiguously(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_size(text)


def test_formats() -> None:
    assert format_bytes(1) == "1 byte"
    assert format_bytes(1023) == "1023 bytes"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(int(1.2 * 2**30)) == "1.20 GiB"
    assert format_bytes(300 * 2**20) == "300 MiB"
    assert format_rate(1.05e9) == "1.05 GB/s" and format_rate(2.3e8) == "230 MB/s"
    assert format_duration(42) == "42 s" and format_duration(185) == "3 min 05 s"
    assert format_duration(7620) == "2 h 07 min" and format_duration(float("inf")) == "?"


def test_progress_line_redraws_after_the_interval_and_ends_with_a_newline() -> None:
    now = [100.0]
    stream = io.StringIO()
    line = ProgressLine("merging", 4 * 10**9, stream, interval=2.0, clock=lambda: now[0])
    now[0] = 101.0
    line.advance(10**9)
    assert stream.getvalue() == ""  # within the interval: nothing drawn
    now[0] = 102.0
    line.advance(10**9)
    drawn = stream.getvalue()
    assert drawn.startswith("\rmerging: 1.86 GiB of 3.73 GiB (50%), 1.00 GB/s, 2 s left")
    now[0] = 104.0
    line.advance(2 * 10**9)
    line.finish()
    assert stream.getvalue().endswith("(100%), 1.00 GB/s, 0 s left\x1b[K\n")


def test_a_job_shorter_than_the_interval_draws_nothing() -> None:
    stream = io.StringIO()
    line = ProgressLine("merging", 10, stream, interval=60.0)
    line.advance(10)
    line.finish()
    assert stream.getvalue() == ""


def test_progress_interval_from_the_environment() -> None:
    assert interval_from_environ({}) == 2.0
    assert interval_from_environ({"DIST_WORKSPACE_PROGRESS_INTERVAL": "0"}) == 0.0
    with pytest.raises(ValueError, match="DIST_WORKSPACE_PROGRESS_INTERVAL"):
        interval_from_environ({"DIST_WORKSPACE_PROGRESS_INTERVAL": "soon"})
