"""Parsers of single flag values; each error names the flag and the value."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping

from dist_launch.plan.launch_plan import UsageError


def parse_int(value: str, flag: str, *, minimum: int | None = None) -> int:
    """``value`` as an integer of at least ``minimum``; an error names ``flag``."""
    try:
        number = int(value)
    except ValueError:
        raise UsageError(f"{flag}={value!r} is not an integer") from None
    if minimum is not None and number < minimum:
        raise UsageError(f"{flag}={number} must be at least {minimum}")
    return number


def parse_positive_float(value: str, flag: str) -> float:
    """``value`` as a positive number; an error names ``flag``."""
    try:
        number = float(value)
    except ValueError:
        raise UsageError(f"{flag}={value!r} is not a number") from None
    if number <= 0:
        raise UsageError(f"{flag}={value} must be positive")
    return number


def seconds_from_variable(environ: Mapping[str, str], name: str) -> float | None:
    """The variable ``name`` as a positive, finite number of seconds; None when unset.

    Raises:
        UsageError: It is set to something else; the message names it and its value.
    """
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise UsageError(f"{name}={raw!r}: not a positive number of seconds")
    return seconds


def parse_nnodes(value: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` as (min, max)."""
    text = value.strip()
    low, sep, high = text.partition(":")
    minimum = parse_int(low, "--nnodes", minimum=1)
    maximum = parse_int(high, "--nnodes", minimum=1) if sep else minimum
    if maximum < minimum:
        raise UsageError(f"--nnodes={value}: MAX ({maximum}) is below MIN ({minimum})")
    return minimum, maximum


def parse_nproc(value: str) -> int:
    """``N``, ``cpu``, ``gpu``, ``xpu`` or ``auto`` as a worker count (torchrun's meaning).

    ``gpu``/``xpu`` count this host's CUDA/XPU devices (an error when there are none);
    ``auto`` counts the accelerator's devices where there are some, else CPU cores.
    """
    text = value.strip().lower()
    if text == "cpu":
        return os.cpu_count() or 1
    if text in ("gpu", "xpu", "auto"):
        # Only these values need torch; a number never pays for its import.
        from dist_core.devices import accelerator_device_count, accelerator_type  # noqa: PLC0415

        kind, count = accelerator_type(), accelerator_device_count()
        if text == "auto":
            return count if count > 0 else (os.cpu_count() or 1)
        wanted = "cuda" if text == "gpu" else "xpu"
        if kind != wanted or count == 0:
            raise UsageError(
                f"--nproc-per-node={value}: this host has no {wanted.upper()} device "
                f"(accelerator: {kind or 'none'}); give a number or 'cpu'"
            )
        return count
    return parse_int(value, "--nproc-per-node", minimum=1)


def parse_rdzv_conf(value: str) -> dict[str, str]:
    """``k1=v1,k2=v2`` as a dict."""
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--rdzv-conf: {item!r} is not key=value")
        conf[key.strip()] = val.strip()
    return conf


def parse_signals(value: str, flag: str = "--signals-to-handle") -> tuple[int, ...]:
    """``SIGTERM,SIGINT,...`` (or ``TERM,INT``) as signal numbers; an error names ``flag``."""
    numbers: list[int] = []
    for name in filter(None, (part.strip().upper() for part in value.split(","))):
        full = name if name.startswith("SIG") else f"SIG{name}"
        try:
            numbers.append(int(signal.Signals[full]))
        except KeyError:
            raise UsageError(f"{flag}: {name!r} is not a signal name") from None
    return tuple(dict.fromkeys(numbers))


# The slow-rank report's window unless --slow-ranks says otherwise.
DEFAULT_SLOW_RANKS_WINDOW = 60.0
MIN_SLOW_RANKS_WINDOW = 1.0


def parse_slow_ranks(value: str, where: str = "--slow-ranks") -> float | None:
    """``SECONDS`` (the report's window, at least 1) or ``off`` (None); names ``where``."""
    text = value.strip().lower()
    if text in ("off", "none", "0"):
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise UsageError(f"{where}={value!r}: expected a number of seconds or 'off'") from None
    if not MIN_SLOW_RANKS_WINDOW <= seconds < float("inf"):
        raise UsageError(
            f"{where}={value!r}: the window must be at least {MIN_SLOW_RANKS_WINDOW:g} s (or 'off')"
        )
    return seconds
