"""Sizes, rates and durations for people: parsing ``--max-shard-size``, printing sizes.

Parsing follows transformers' ``convert_file_size_to_int`` (what ``save_pretrained``'s
``max_shard_size`` accepts), so a size means here what it means there:
``KB``/``MB``/``GB``/``TB`` are decimal (``5GB`` = 5 * 10**9 bytes), ``KiB``/``MiB``/
``GiB``/``TiB`` binary (``2GiB`` = 2 * 2**30), a bare number is bytes, and the number
may have a fraction (``1.5GB``). Unit letters are case-insensitive except a final
lowercase ``b``: transformers reads ``5Gb`` (and ``5gb``) as gigabits, an eighth of
``5GB``; that spelling is refused here with a message, not silently divided by 8.

Printing uses binary units for sizes (``1.2 GiB``, as ``ls -h`` and ``du -h``) and
decimal GB/s for rates (as disks and networks are rated).
"""

from __future__ import annotations

import math
import re

_DECIMAL = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_BINARY = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>[A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in a size such as ``"5GB"``, ``"500MB"``, ``"2GiB"`` or ``"1000000"``.

    Raises:
        ValueError: Not a positive size in these units; the message says what is.
    """
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(
            f"{text!r} is not a size: write a number of bytes or a number with a unit, "
            "e.g. 5GB (5*10^9 bytes), 500MB, 2GiB (2*2^30 bytes)"
        )
    unit = match["unit"]
    upper = unit.upper()
    if upper in _DECIMAL and unit.endswith("b"):
        raise ValueError(
            f"{text!r}: a lowercase b means bits to transformers ({unit} = 1/8 of "
            f"{upper}); write {match['number']}{upper} for bytes"
        )
    if unit in ("", "B"):
        factor = 1
    elif upper in _DECIMAL:
        factor = _DECIMAL[upper]
    elif upper in _BINARY:
        factor = _BINARY[upper]
    else:
        raise ValueError(
            f"{text!r}: unknown unit {unit!r}; use KB, MB, GB, TB (decimal) or KiB, MiB, "
            "GiB, TiB (binary), or none for bytes"
        )
    size = int(float(match["number"]) * factor)
    if size <= 0:
        raise ValueError(f"{text!r}: a size must be at least 1 byte")
    return size


def format_bytes(size: int) -> str:
    """``size`` in binary units: ``"512 bytes"``, ``"3.0 KiB"``, ``"1.21 GiB"``."""
    if size < 1024:
        return f"{size} byte" if size == 1 else f"{size} bytes"
    value = float(size)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            break
    digits = 2 if value < 10 else 1 if value < 100 else 0
    return f"{value:.{digits}f} {unit}"


def format_size(size: int) -> str:
    """A size for people and for scripts: ``"1.21 GiB (1300000000 bytes)"``."""
    human = format_bytes(size)
    return human if size < 1024 else f"{human} ({size} bytes)"


def format_rate(bytes_per_second: float) -> str:
    """A throughput in decimal units: ``"1.05 GB/s"``, ``"230 MB/s"``."""
    if bytes_per_second >= 1e9:
        return f"{bytes_per_second / 1e9:.2f} GB/s"
    if bytes_per_second >= 1e6:
        return f"{bytes_per_second / 1e6:.0f} MB/s"
    return f"{bytes_per_second / 1e3:.0f} kB/s"


def format_duration(seconds: float) -> str:
    """``"42 s"``, ``"3 min 05 s"``, ``"2 h 07 min"``; ``"?"`` when not finite."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"
