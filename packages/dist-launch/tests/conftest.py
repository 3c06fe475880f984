import sys
from collections.abc import Iterator
from pathlib import Path

# Worker functions of the library tests live in a helper module that the worker
# processes import by name; multiprocessing passes sys.path on to them.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


import pytest  # noqa: E402 - after the sys.path set-up above
from etcd_cluster import etcd_cluster  # noqa: E402


@pytest.fixture(autouse=True)
def _gloo_unless_testing_gpus(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Multi-rank tests send CPU tensors, so they pin gloo: on a host with one GPU per
    # rank the default would be nccl. Tests of GPU behaviour (marked cuda) keep the
    # default.
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setenv("TORCH_DISTRIBUTED_BACKEND", "gloo")


@pytest.fixture
def script(tmp_path: Path) -> str:
    """A script file for plans to name (build_plan checks that it exists)."""
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


@pytest.fixture(scope="session")
def etcd_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A one-member etcd on loopback for the whole session (each test its own --rdzv-id).

    Skips without the ``etcd`` program (see :mod:`etcd_cluster`).
    """
    with etcd_cluster(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster.endpoints
