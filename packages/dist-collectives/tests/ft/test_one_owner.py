"""One owner for the replica protocol's store keys and values: the store coordinator.

Up to 0.10 about 16 key shapes were built in three modules (the quorum, the Manager's
decisions and its executor), two of them twice, and values were coded as string
prefixes. The sources are read, not imported.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import dist_collectives.ft

PACKAGE = Path(dist_collectives.ft.__file__).resolve().parent
OWNER = "coordination/store_coordinator.py"
STORE_CALLS = {"set", "get", "add", "append", "check", "compare_set", "multi_get", "wait"}
# Modules that call a store for something other than the replica protocol: the store
# wrapper itself, configure()'s arrival barrier, and a group's own rendezvous (its
# handles, under the prefix of the group's address).
OTHER_STORE_USERS = {
    "coordination/bounded_store.py",
    "coordination/store.py",
    "groups/reconfigure.py",
    "groups/reconfigurable.py",
}
# The first segment of every key shape of the protocol.
KEY_PREFIXES = (
    "hb/",
    "left/",
    "alive/",
    "err/",
    "commit/",
    "votes/",
    "group/",
    "incarnation/",
)
# A receiver named like a store connection: ``store``, ``self._store``, ``liveness.store``.
STORE_NAME = re.compile(r"(^|[._])[a-z_]*store$")


@functools.cache
def _sources() -> dict[str, ast.Module]:
    return {
        str(path.relative_to(PACKAGE)): ast.parse(path.read_text(encoding="utf-8"))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def _store_calls(tree: ast.Module) -> list[int]:
    """Lines of calls like ``<something store-like>.set(...)`` (receivers named *store*)."""
    lines = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in STORE_CALLS
            and STORE_NAME.search(ast.unparse(node.func.value).lower())
        ):
            lines.append(node.lineno)
    return lines


def _key_literals(tree: ast.Module) -> list[tuple[int, str]]:
    """String constants and f-strings that start like a key of the protocol."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
            text = head.value if isinstance(head, ast.Constant) else ""
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        if (isinstance(text, str) and text.startswith(KEY_PREFIXES)) or _is_round_key(node):
            found.append((node.lineno, ast.unparse(node)))
    return found


def _is_round_key(node: ast.AST) -> bool:
    """``f"r{round}/..."``: a round's key."""
    return (
        isinstance(node, ast.JoinedStr)
        and len(node.values) >= 2
        and isinstance(node.values[0], ast.Constant)
        and node.values[0].value == "r"
    )


def test_only_the_store_coordinator_calls_the_store_for_the_replica_protocol() -> None:
    sources = _sources()
    callers = {name for name, tree in sources.items() if _store_calls(tree)}
    assert OWNER in callers, "the scan no longer finds the owner's own calls"
    unexpected = {
        f"{name}:{line}"
        for name in callers - {OWNER} - OTHER_STORE_USERS
        for line in _store_calls(sources[name])
    }
    assert not unexpected, f"store calls outside {OWNER}: {sorted(unexpected)}"


def test_only_the_store_coordinator_builds_a_key_of_the_protocol() -> None:
    sources = _sources()
    assert _key_literals(sources[OWNER]), "the scan no longer finds the owner's keys"
    elsewhere = [
        f"{name}:{line}: {text}"
        for name, tree in sources.items()
        if name != OWNER
        for line, text in _key_literals(tree)
    ]
    assert not elsewhere, "\n".join(elsewhere)


def test_no_value_of_the_protocol_is_a_string_prefix() -> None:
    """The old codes (``ok:same``, ``fail:<message>``, ``broken``) are gone for JSON."""
    old_codes = ("ok:", "fail:", "broken")
    found = [
        f"{name}:{node.lineno}"
        for name, tree in _sources().items()
        for node in ast.walk(tree)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str | bytes)
            and (node.value.decode() if isinstance(node.value, bytes) else node.value) in old_codes
        )
        or (
            isinstance(node, ast.JoinedStr)
            and node.values
            and isinstance(node.values[0], ast.Constant)
            and str(node.values[0].value).startswith(old_codes)
        )
    ]
    assert not found, found
