"""configure_logging: a [rank r/w] prefix unless the launcher prefixes lines; INFO on rank 0."""

from __future__ import annotations

import logging

import pytest

from dist_core import INFOALL, configure_logging
from dist_core.log import LAUNCHER_PREFIXES_VARIABLE


@pytest.fixture(autouse=True)
def _not_under_a_prefixing_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    # The suite itself may run under dist-launch; these tests choose the variable.
    monkeypatch.delenv(LAUNCHER_PREFIXES_VARIABLE, raising=False)


@pytest.fixture
def restore_root_logger():  # type: ignore[no-untyped-def]
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _emit(capsys: pytest.CaptureFixture[str], rank: int) -> str:
    configure_logging(rank=rank, world_size=4)
    logger = logging.getLogger("dist_core.test")
    logger.info("info %d", rank)
    logger.log(INFOALL, "infoall %d", rank)
    logger.warning("warning %d", rank)
    logger.debug("debug %d", rank)
    return capsys.readouterr().err


@pytest.mark.usefixtures("restore_root_logger")
def test_rank_zero_logs_info_and_infoall(capsys: pytest.CaptureFixture[str]) -> None:
    err = _emit(capsys, 0)
    assert "[rank 0/4] INFO dist_core.test: info 0" in err
    assert "[rank 0/4] INFOALL dist_core.test: infoall 0" in err
    assert "[rank 0/4] WARNING dist_core.test: warning 0" in err
    assert "debug" not in err


@pytest.mark.usefixtures("restore_root_logger")
def test_other_ranks_drop_info_but_keep_infoall_and_warnings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _emit(capsys, 2)
    assert "info 2" not in err.replace("infoall 2", "")
    assert "[rank 2/4] INFOALL dist_core.test: infoall 2" in err
    assert "[rank 2/4] WARNING dist_core.test: warning 2" in err


@pytest.mark.usefixtures("restore_root_logger")
def test_reads_environment_and_reconfigures_without_duplicates(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    configure_logging()
    configure_logging()
    logging.getLogger("x").log(INFOALL, "once")
    err = capsys.readouterr().err
    assert err.count("[rank 3/8] INFOALL x: once") == 1


@pytest.mark.usefixtures("restore_root_logger")
def test_no_rank_prefix_when_the_launcher_prefixes_every_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LAUNCHER_PREFIXES_VARIABLE, "1")
    err = _emit(capsys, 2)
    assert err.splitlines() == [
        "INFOALL dist_core.test: infoall 2",
        "WARNING dist_core.test: warning 2",
    ]


@pytest.mark.usefixtures("restore_root_logger")
def test_rank_prefix_kept_unless_the_variable_is_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LAUNCHER_PREFIXES_VARIABLE, "0")
    assert "[rank 1/4] WARNING dist_core.test: warning 1" in _emit(capsys, 1)


def test_launcher_variable_name() -> None:
    assert LAUNCHER_PREFIXES_VARIABLE == "DIST_LAUNCH_PREFIXES_OUTPUT"


def test_infoall_level() -> None:
    assert INFOALL == logging.INFO + 5
    assert logging.getLevelName(INFOALL) == "INFOALL"
