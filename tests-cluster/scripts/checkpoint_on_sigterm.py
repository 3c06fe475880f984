"""Trains until told to stop (SIGTERM), then saves a checkpoint that takes a while.

``checkpoint_on_sigterm.py DIR [SECONDS]``: gloo all_reduce steps; SIGTERM sets a flag
the ranks agree on at the next step (an all_reduce of it), then each rank writes
``DIR/ckpt-<rank>`` in 16 chunks over SECONDS (8 by default), fsyncs it and renames it
to ``ckpt-<rank>.done``, whose JSON holds how many SIGTERMs and SIGCONTs the rank got.
Prints ``training`` once the first step is done. A second SIGTERM is only counted.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

directory = Path(sys.argv[1])
seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 8.0
received = {"SIGTERM": 0, "SIGCONT": 0}


def note(signum: int, frame: object) -> None:
    received[signal.Signals(signum).name] += 1


signal.signal(signal.SIGTERM, note)
signal.signal(signal.SIGCONT, note)
dist.init_process_group("gloo")
rank = dist.get_rank()
step = 0
while True:
    stop = torch.tensor([float(received["SIGTERM"] > 0)])
    dist.all_reduce(stop)
    if step == 0:
        print("training", flush=True)
    if stop.item() > 0:
        break
    step += 1
    time.sleep(0.02)  # the step's computation

partial = directory / f"ckpt-{rank}"
with partial.open("wb") as handle:
    for _ in range(16):
        handle.write(os.urandom(1 << 16))
        time.sleep(seconds / 16)  # a slow file system
    handle.flush()
    os.fsync(handle.fileno())
(directory / f"ckpt-{rank}.json").write_text(json.dumps({"step": step, **received}))
partial.rename(directory / f"ckpt-{rank}.done")
print(f"checkpoint saved at step {step}", flush=True)
dist.destroy_process_group()
