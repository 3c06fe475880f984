"""Launchers that a test signals start with those signals handled, whoever started pytest.

A launcher keeps a signal ignored when it was ignored at its start (README, "Ignored
signals stay ignored"). A POSIX shell without job control starts a background job
(``python3 -m nox &`` in a CI script) with SIGINT and SIGQUIT ignored, and ``nohup``
ignores SIGHUP; pytest, and every launcher it starts, inherits that. A test that sends
its launcher Ctrl-C or SIGQUIT would then wait for an answer that never comes. Such
tests start the launcher with :func:`default_signal_handling` as ``preexec_fn``: what
they check no longer depends on how the test run itself was started.
"""

from __future__ import annotations

import signal

# The signals the tests send a launcher and expect it to handle.
SENT_BY_TESTS = (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM)


def default_signal_handling() -> None:
    """``preexec_fn``: :data:`SENT_BY_TESTS` at their default disposition in the child.

    Runs in the child between fork and exec; the test process keeps its own.
    """
    for signum in SENT_BY_TESTS:
        signal.signal(signum, signal.SIG_DFL)
