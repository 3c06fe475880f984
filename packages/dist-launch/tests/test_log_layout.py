"""--log-dir's layout, torch's error-file format, and what -r/-t/--local-ranks-filter route."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from dist_launch.output.log_layout import LogLayout, write_torch_error_file
from dist_launch.output.routing import (
    Destinations,
    OutputRouting,
    Std,
    StreamSetting,
    parse_local_ranks_filter,
)

# ---- the layout ----


def test_paths_follow_torchruns_layout(tmp_path: Path) -> None:
    layout = LogLayout.create(tmp_path / "logs", "job7")
    assert layout.launcher_dir == tmp_path / "logs" / "job7"
    assert layout.stdout(0, 1) == tmp_path / "logs/job7/attempt_0/1/stdout.log"
    assert layout.stderr(2, 0) == tmp_path / "logs/job7/attempt_2/0/stderr.log"
    assert layout.error_file(1, 3) == tmp_path / "logs/job7/attempt_1/3/error.json"


def test_create_attempt_makes_one_directory_per_local_rank(tmp_path: Path) -> None:
    layout = LogLayout.create(tmp_path, "run")
    layout.create_attempt(0, range(3))
    layout.create_attempt(1, range(3))
    assert sorted(p.name for p in layout.attempt_dir(1).iterdir()) == ["0", "1", "2"]
    layout.stdout(1, 2).write_text("x")
    with pytest.raises(FileExistsError):
        layout.create_attempt(1, range(3))  # a restart must not reuse (wipe) an attempt
    assert layout.stdout(1, 2).read_text() == "x"


def test_a_rerun_with_the_same_id_never_overwrites_the_earlier_one(tmp_path: Path) -> None:
    first = LogLayout.create(tmp_path, "none")
    first.create_attempt(0, range(1))
    first.stdout(0, 0).write_text("first run")
    second = LogLayout.create(tmp_path, "none")
    third = LogLayout.create(tmp_path, "none")
    assert (second.launcher_dir.name, third.launcher_dir.name) == ("none_1", "none_2")
    assert first.stdout(0, 0).read_text() == "first run"


def test_nodes_of_one_run_share_its_directory_each_in_a_folder_of_its_own(
    tmp_path: Path,
) -> None:
    node0 = LogLayout.create(tmp_path, "1234.0", "node0")
    node1 = LogLayout.create(tmp_path, "1234.0", "node1")
    assert node0.stdout(0, 1) == tmp_path / "1234.0/node0/attempt_0/1/stdout.log"
    assert node1.error_file(2, 0) == tmp_path / "1234.0/node1/attempt_2/0/error.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1234.0"]  # one run


def test_a_rerun_of_a_node_never_overwrites_its_earlier_folder(tmp_path: Path) -> None:
    first = LogLayout.create(tmp_path, "job", "node1")
    first.create_attempt(0, range(1))
    first.stdout(0, 0).write_text("first run")
    again = LogLayout.create(tmp_path, "job", "node1")  # a requeued SLURM job, same id
    assert again.launcher_dir == tmp_path / "job" / "node1_1"
    assert first.stdout(0, 0).read_text() == "first run"


@pytest.mark.parametrize("folder", ["", "..", "a/b"])
def test_node_folder_that_cannot_name_a_directory_is_refused(tmp_path: Path, folder: str) -> None:
    with pytest.raises(ValueError, match="node folder"):
        LogLayout.create(tmp_path, "run", folder)


def _claim(log_dir: str, queue: multiprocessing.Queue[str]) -> None:
    queue.put(str(LogLayout.create(log_dir, "same").launcher_dir))


@pytest.mark.processes
def test_launchers_started_together_get_distinct_directories(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[str] = context.Queue()
    processes = [context.Process(target=_claim, args=(str(tmp_path), queue)) for _ in range(6)]
    for process in processes:
        process.start()
    dirs = [queue.get(timeout=30) for _ in processes]
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0
    assert len(set(dirs)) == 6


def test_no_log_dir_means_a_fresh_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # tempfile caches TMPDIR
    a, b = LogLayout.create(None, "r"), LogLayout.create(None, "r")
    assert a.launcher_dir.parent != b.launcher_dir.parent
    assert a.launcher_dir.parent.parent == tmp_path
    assert a.launcher_dir.parent.name.startswith("dist-launch-logs-")


@pytest.mark.parametrize("run_id", ["", ".", "..", "a/b"])
def test_run_id_that_cannot_name_a_directory_is_refused(tmp_path: Path, run_id: str) -> None:
    with pytest.raises(ValueError, match="--rdzv-id"):
        LogLayout.create(tmp_path, run_id)


def test_log_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError, match="--log-dir"):
        LogLayout.create(tmp_path / "f", "r")


# ---- error.json in torch's format ----

TRACEBACK = 'Traceback (most recent call last):\n  File "train.py", line 3\nValueError: bad lr\n'


def test_torchs_process_failure_reads_our_error_file(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    write_torch_error_file(
        path, message="ValueError: bad lr", traceback=TRACEBACK, timestamp=1_795_000_000.75
    )
    failure = ProcessFailure(local_rank=1, pid=4242, exitcode=1, error_file=str(path))
    assert failure.timestamp == 1_795_000_000
    message: object = failure.message  # torch types it str; from an error file it is a dict
    assert isinstance(message, dict)
    assert message["message"] == "ValueError: bad lr"
    assert message["extraInfo"]["py_callstack"] == TRACEBACK
    # torchrun's own failure summary shows our traceback
    summary = ChildFailedError("train.py", {3: failure}).format_msg()  # type: ignore[no-untyped-call]
    assert "ValueError: bad lr" in summary and 'File "train.py", line 3' in summary


def test_error_file_is_replaced_whole_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text("{half a reco")
    write_torch_error_file(path, message="m", traceback="t", timestamp=5.0)
    assert json.loads(path.read_text())["message"]["extraInfo"] == {
        "py_callstack": "t",
        "timestamp": "5",
    }
    assert os.listdir(tmp_path) == ["error.json"]


def test_error_file_in_a_missing_directory_raises_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_torch_error_file(
            tmp_path / "no" / "error.json", message="m", traceback="", timestamp=0
        )
    assert os.listdir(tmp_path) == []


# ---- routing ----


def test_stream_values_parse_as_torchrun_parses_them() -> None:
    assert StreamSetting.parse("0", "-r") == StreamSetting()
    assert StreamSetting.parse("3", "-r").of_rank(7) == Std.ALL
    mapped = StreamSetting.parse("0:3,1:0,2:1,3:2", "-r")
    assert [mapped.of_rank(rank) for rank in range(5)] == [
        Std.ALL,
        Std.NONE,
        Std.OUT,
        Std.ERR,
        Std.NONE,
    ]
    assert StreamSetting.parse("12:1,0:2,12:2", "-r").of_rank(12) == Std.ERR  # last wins


@pytest.mark.parametrize("value", ["4", "", "1,2", "0:4", "0:1,", " 1", "a:1", "0=1", "-1"])
@pytest.mark.parametrize("flag", ["--redirects", "--tee"])
def test_bad_stream_values_name_the_flag_and_value(flag: str, value: str) -> None:
    expected = f"^{re.escape(flag)} {re.escape(repr(value))}: expected 0"
    with pytest.raises(ValueError, match=expected):
        if flag == "--redirects":
            OutputRouting.for_flags(redirects=value)
        else:
            OutputRouting.for_flags(tee=value)


def test_default_everything_to_the_console_nothing_to_files() -> None:
    routing = OutputRouting.for_flags()
    assert routing.route(0, "stdout") == Destinations(console=True, file=False)
    assert not routing.needs_files(range(8))


def test_redirect_sends_to_the_file_only_and_tee_to_both() -> None:
    routing = OutputRouting.for_flags(redirects="1", tee="0:2")
    assert routing.route(0, "stdout") == Destinations(console=False, file=True)
    assert routing.route(0, "stderr") == Destinations(console=True, file=True)
    assert routing.route(1, "stderr") == Destinations(console=True, file=False)
    assert routing.needs_files(range(2))


def test_a_stream_both_redirected_and_teed_is_teed() -> None:
    routing = OutputRouting.for_flags(redirects="3", tee="3")
    assert routing.route(0, "stdout") == Destinations(console=True, file=True)


def test_log_dir_keeps_every_stream_in_its_file_and_flags_only_choose_the_console() -> None:
    routing = OutputRouting.for_flags(
        redirects="0:2", tee="1", local_ranks_filter={0}, has_log_dir=True
    )
    assert routing.route(0, "stdout") == Destinations(console=True, file=True)
    assert routing.route(0, "stderr") == Destinations(console=False, file=True)
    assert routing.route(1, "stdout") == Destinations(console=False, file=True)
    assert routing.route(1, "stderr") == Destinations(console=False, file=True)


def test_local_ranks_filter_hides_other_ranks_on_the_console_only() -> None:
    routing = OutputRouting.for_flags(tee="3", local_ranks_filter=parse_local_ranks_filter("0,2"))
    assert [routing.route(rank, "stdout").console for rank in range(4)] == [
        True,
        False,
        True,
        False,
    ]
    assert all(routing.route(rank, "stderr").file for rank in range(4))


def test_local_ranks_filter_parsing() -> None:
    assert parse_local_ranks_filter("") is None
    assert parse_local_ranks_filter("0, 3,3") == {0, 3}
    for bad in ("a", "0,,1", "-1", ","):
        with pytest.raises(ValueError, match=r"^--local-ranks-filter"):
            parse_local_ranks_filter(bad)
