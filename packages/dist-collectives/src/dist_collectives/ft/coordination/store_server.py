"""``python -m dist_collectives.ft.store_server``: hosts a quorum store until stopped.

Replica groups that each run under their own launcher (one ``dist-launch`` per group)
need a store that none of them hosts, so that no group's death takes it down::

    python -m dist_collectives.ft.store_server --port 29600

Any ``TCPStore(host, port, is_master=True)`` kept alive elsewhere serves as well. The
server runs until SIGINT or SIGTERM and exits with status 0 then.
"""

from __future__ import annotations

import argparse
import signal
import threading
from datetime import timedelta
from types import FrameType

from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not re-exported in the stubs


def main(argv: list[str] | None = None) -> int:
    """Parses the command line, hosts the store and waits for SIGINT or SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="python -m dist_collectives.ft.store_server",
        description="Hosts a TCPStore for the quorum of replica groups until stopped.",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (0.0.0.0)")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    args = parser.parse_args(argv)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    store = TCPStore(
        args.host, args.port, is_master=True, wait_for_workers=False, timeout=timedelta(hours=1)
    )
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(f"quorum store listening on {args.host}:{args.port}", flush=True)
    stop.wait()
    del store
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
