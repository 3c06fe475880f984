"""The launcher's messages: program name, timestamp to the millisecond, one handler."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from dist_launch.output.launcher_log import configure_launcher_logging

STAMP = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}\]"

SCRIPT = """
import logging
from dist_launch.output.launcher_log import configure_launcher_logging
configure_launcher_logging("dist-launch")
configure_launcher_logging("dist-launch")  # main() may run twice in one process
log = logging.getLogger("dist_launch.agent.agent")
log.info("starting %d ranks", 4)
log.warning("port %d was taken", 29500)
log.debug("not shown")
logging.getLogger("other").warning("not ours")
"""


@pytest.mark.processes
def test_messages_carry_program_timestamp_and_level_of_warnings_once() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    lines = result.stderr.splitlines()
    assert len(lines) == 3, result.stderr  # the "other" warning goes to logging's last resort
    assert re.fullmatch(rf"dist-launch: {STAMP} starting 4 ranks", lines[0]), lines[0]
    assert re.fullmatch(rf"dist-launch: {STAMP} WARNING: port 29500 was taken", lines[1])
    assert lines[2] == "not ours"


@pytest.fixture
def package_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("dist_launch")
    handlers, level = list(logger.handlers), logger.level
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)


def test_calling_again_replaces_its_handler_and_keeps_others(
    package_logger: logging.Logger,
) -> None:
    other = logging.NullHandler()
    package_logger.addHandler(other)
    first = configure_launcher_logging("dist-launch")
    second = configure_launcher_logging("dist-launch")
    assert first not in package_logger.handlers
    assert second in package_logger.handlers and other in package_logger.handlers
    assert package_logger.level == logging.INFO
