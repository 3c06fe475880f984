"""Trains, and on SIGUSR1 (a notification) records it and keeps going: 5 more steps.

``notify_on_usr1.py DIR``: gloo all_reduce steps; the ranks agree at a step that a
SIGUSR1 came (an all_reduce of the flag), each writes ``DIR/notified-<rank>`` holding
how many SIGUSR1s it got, and all run 5 more steps, then exit 0. Prints ``training``
once the first step is done.
"""

import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

directory = Path(sys.argv[1])
notified = 0


def note(signum: int, frame: object) -> None:
    global notified
    notified += 1


signal.signal(signal.SIGUSR1, note)
dist.init_process_group("gloo")
rank = dist.get_rank()
step, more = 0, None
while more is None or more > 0:
    flag = torch.tensor([float(notified > 0)])
    dist.all_reduce(flag)
    if step == 0:
        print("training", flush=True)
    if more is None and flag.item() > 0:
        more = 5
    elif more is not None:
        more -= 1
    step += 1
    time.sleep(0.02)  # the step's computation
(directory / f"notified-{rank}").write_text(str(notified))
print(f"done at step {step}", flush=True)
dist.destroy_process_group()
