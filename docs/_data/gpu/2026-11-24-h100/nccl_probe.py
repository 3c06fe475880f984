"""NCCL on one GPU: how long torch's abort takes, and ProcessGroupNCCL over 50 reconfigurations."""

import os
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dist_collectives.ft import ProcessGroupNCCL
from dist_collectives.ft.nccl import create_nccl_backend
from dist_collectives.ft.wrappers import wait_for_retirements
from dist_core import get_unused_port

VARIANTS = {
    "default": {},
    "monitoring off": {"TORCH_NCCL_ENABLE_MONITORING": "0"},
    "coord check 10ms": {"TORCH_NCCL_COORD_CHECK_MILSEC": "10"},
    "heartbeat 1s": {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "1"},
}


def abort_times() -> None:
    torch.cuda.set_device(0)
    port = get_unused_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    times = []
    for i in range(5):
        prefixed = dist.PrefixStore(f"p{i}", store)
        backend = create_nccl_backend(prefixed, 0, 1, timedelta(seconds=30))
        t = torch.ones(4, device="cuda")
        opts = dist.AllreduceOptions()
        backend.allreduce([t], opts).wait()
        torch.cuda.synchronize()
        started = time.perf_counter()
        backend.abort()
        times.append(time.perf_counter() - started)
    print(" ".join(f"{1000 * x:.0f}" for x in times), "ms", flush=True)
    del store


def reconfigure(gap: float) -> None:
    torch.cuda.set_device(0)
    port = get_unused_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    torch.cuda.init()
    free0 = torch.cuda.mem_get_info()[0]
    used = lambda: (free0 - torch.cuda.mem_get_info()[0]) / 2**20  # noqa: E731
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=30))
    times, peak = [], 0.0
    for i in range(50):
        started = time.perf_counter()
        pg.configure(f"127.0.0.1:{port}/r/{i}", 0, 1)
        times.append(time.perf_counter() - started)
        t = torch.full((4,), float(i), device="cuda")
        pg.allreduce([t], dist.AllreduceOptions()).wait()
        torch.cuda.synchronize()
        assert t.tolist() == [float(i)] * 4
        peak = max(peak, used())
        time.sleep(gap)
    live = used()
    ok = wait_for_retirements(60)
    torch.cuda.synchronize()
    after = used()
    pg.shutdown()
    wait_for_retirements(60)
    times.sort()
    print(
        f"gap {gap:.1f}s: configure median {1000 * times[25]:.1f} ms, "
        f"p90 {1000 * times[45]:.1f} ms, max {1000 * times[-1]:.1f} ms; device memory peak "
        f"+{peak:.0f} MiB, at the end +{live:.0f} MiB, after the aborts +{after:.0f} MiB "
        f"(retired: {ok}); after shutdown +{used():.0f} MiB",
        flush=True,
    )
    del store


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "abort":
        abort_times()
    elif len(sys.argv) > 1 and sys.argv[1] == "reconfigure":
        reconfigure(float(sys.argv[2]))
    else:
        for gap in (0.0, 0.6):
            subprocess.run([sys.executable, __file__, "reconfigure", str(gap)], timeout=150)
        for name, env in VARIANTS.items():
            print(f"torch abort of a world-1 communicator, {name}: ", end="", flush=True)
            subprocess.run(
                [sys.executable, __file__, "abort"], env={**os.environ, **env}, timeout=60
            )
