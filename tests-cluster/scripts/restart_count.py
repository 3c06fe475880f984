"""Writes ``DIR/restart-<TORCHELASTIC_RESTART_COUNT>``; the first run then waits to be requeued."""

import os
import sys
import threading
from pathlib import Path

count = os.environ["TORCHELASTIC_RESTART_COUNT"]
(Path(sys.argv[1]) / f"restart-{count}").touch()
if count == "0":
    threading.Event().wait(120)  # until the requeue stops it (bounded)
