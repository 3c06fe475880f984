"""Test settings every package's tests share: the ``cuda`` marker.

``@pytest.mark.cuda`` marks a test of GPU behaviour; ``@pytest.mark.cuda(devices=2)``
one that needs two GPUs. Such a test runs where torch sees enough CUDA devices and is
skipped, with the count it found, everywhere else. The count comes from NVML
(:func:`dist_core.devices.cuda_device_count`), not ``torch.cuda.is_available()``, so
the pytest process does not initialise CUDA and tests of the ``fork`` start method
still run on a GPU host.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "cuda(devices=1): needs that many CUDA devices; skipped with the count where fewer",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [(item, item.get_closest_marker("cuda")) for item in items]
    marked = [(item, marker) for item, marker in marked if marker is not None]
    if not marked:
        return
    from dist_core.devices import cuda_device_count

    found = cuda_device_count()
    for item, marker in marked:
        needed = int(marker.kwargs.get("devices", 1))
        if found < needed:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs {needed} CUDA device(s); torch sees {found} "
                    "(a GPU check: run it on a GPU machine)"
                )
            )
