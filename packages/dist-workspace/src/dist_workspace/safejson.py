r"""JSON from untrusted bytes: bounded nesting, no duplicate keys, no NaN, no huge ints.

:func:`json.loads` recurses once per level of nesting, so ``[[[[...]]]]`` 1000 deep
raises :class:`RecursionError`; it keeps the last of duplicate keys silently; it
accepts ``NaN`` and ``Infinity``; and an integer of more than 4300 digits raises a
bare :class:`ValueError`. :func:`loads` measures the nesting first (strings left
out, in C-speed regular expressions, one pass per level up to the limit), then
parses, and turns every refusal into :class:`JsonRefused`. A lone UTF-16 surrogate
(``"\ud800"``), which no UTF-8 encoder accepts later, is refused too.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

# A JSON string, escapes included (the unrolled form: linear, no backtracking).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_INNERMOST = re.compile(r"\[\]|\{\}")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class JsonRefused(ValueError):
    """The text is not JSON this package accepts; the message says why."""


def nesting_within(text: str, limit: int) -> bool:
    """Whether ``text``'s arrays and objects are balanced and nest at most ``limit`` deep.

    Brackets inside strings do not count. Each pass removes the innermost level, so
    the work is at most ``limit + 1`` passes over the brackets, whatever the input.
    Brackets that do not pair up (never valid JSON) count as too deep.
    """
    skeleton = _NOT_BRACKET.sub("", _STRING.sub("", text))
    for _ in range(limit):
        if not skeleton:
            return True
        reduced = _INNERMOST.sub("", skeleton)
        if reduced == skeleton:  # stuck: unbalanced or mismatched brackets
            return False
        skeleton = reduced
    return not skeleton


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JsonRefused(f"the key {key!r:.80} appears twice in one object")
            seen.add(key)
    return result


def _no_constant(name: str) -> Any:
    raise JsonRefused(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (math.inf, -math.inf):
        raise JsonRefused(f"the number {text:.40} is out of range")
    return value


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(item) for item in value)
    return False


# Made once: json.loads with hooks builds a decoder (and its scanner) on every call,
# which cost more than parsing a small header.
_DECODER = json.JSONDecoder(
    object_pairs_hook=_unique_object, parse_constant=_no_constant, parse_float=_finite_float
)


def loads(text: str, *, max_depth: int) -> Any:
    """Parses ``text`` as strict JSON nested at most ``max_depth`` deep.

    Raises:
        JsonRefused: Not JSON, nested deeper than ``max_depth``, a duplicate key in
            an object, ``NaN``/``Infinity``, or an integer too long to convert.
    """
    if not nesting_within(text, max_depth):
        raise JsonRefused(f"unbalanced, or nested deeper than {max_depth} levels")
    try:
        value = _DECODER.decode(text)
    except JsonRefused:
        raise
    except (ValueError, RecursionError) as error:  # JSONDecodeError is a ValueError
        raise JsonRefused(f"not JSON: {error}") from None
    # A \\uD800-\\uDFFF escape that is not half of a pair decodes to a str that no
    # UTF-8 encoder accepts; look for one only when such an escape may be there.
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        raise JsonRefused("a string holds a lone UTF-16 surrogate (\\uD800-\\uDFFF)")
    return value
