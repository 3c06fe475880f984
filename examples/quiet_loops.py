"""Healthy training loops that are quiet: no output, one Python stack for seconds.

Each loop completes a collective every step, and between two collectives its main
thread sits in one native call for a while: a sleep standing in for the device's work,
a data loader's queue, an evaluation pass, a checkpoint written to slow storage. None
of them is hung, and ``dist-launch --hang-timeout`` must leave them alone as long as
the timeout is longer than the longest quiet interval (the ``--hang-timeout`` each
loop's docstring names). dist-launch's tests and ``benchmarks/launch.py --only
quiet-soak`` run them::

    dist-launch -n 2 --hang-timeout 5 examples/quiet_loops.py sleeps 6

Arguments: the loop's name (``sleeps``, ``queue``, ``evaluation``, ``checkpoint``)
and its number of steps. Every rank prints ``finished <loop>`` at the end, and only
then.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time

import torch
import torch.distributed as dist

# The quiet interval of each loop, in seconds: --hang-timeout 5 is twice the longest.
STEP_SECONDS = 1.5
EVALUATION_SECONDS = 2.5
CHECKPOINT_SECONDS = 2.5


def sleeps(steps: int, value: torch.Tensor) -> None:
    """An all_reduce, then the step's work in one native call (``--hang-timeout 5``)."""
    for _ in range(steps):
        dist.all_reduce(value)
        time.sleep(STEP_SECONDS)


def queue_wait(steps: int, value: torch.Tensor) -> None:
    """Each step waits for its batch from a loader thread (``--hang-timeout 5``)."""
    batches: queue.Queue[int] = queue.Queue()

    def load() -> None:
        for batch in range(steps):
            time.sleep(STEP_SECONDS)
            batches.put(batch)

    threading.Thread(target=load, daemon=True).start()
    for _ in range(steps):
        batches.get(timeout=60)
        dist.all_reduce(value)


def run_on_device(seconds: float) -> None:
    """One native call that lasts ``seconds``: a step's (or an evaluation's) device time."""
    time.sleep(seconds)


def evaluation(steps: int, value: torch.Tensor) -> None:
    """Short steps; every eighth an evaluation pass of 2.5 s (``--hang-timeout 5``)."""
    for step in range(steps * 8):
        dist.all_reduce(value)
        run_on_device(EVALUATION_SECONDS if step % 8 == 7 else 0.05)


def checkpoint(steps: int, value: torch.Tensor) -> None:
    """Each step writes a checkpoint in one ``write`` to slow storage (``--hang-timeout 5``).

    The storage is a pipe its reader drains only after 2.5 s: the write blocks in the
    kernel, as a write to a slow network file system does.
    """
    data = bytes(4 << 20)  # larger than a pipe's buffer: the write waits for the reader
    for _ in range(steps):
        dist.all_reduce(value)
        read_end, write_end = os.pipe()

        def drain(fd: int = read_end) -> None:
            time.sleep(CHECKPOINT_SECONDS)
            with os.fdopen(fd, "rb") as storage:
                while storage.read(1 << 20):
                    pass

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        with os.fdopen(write_end, "wb", buffering=0) as storage:
            storage.write(data)
        reader.join(timeout=60)


LOOPS = {"sleeps": sleeps, "queue": queue_wait, "evaluation": evaluation, "checkpoint": checkpoint}


def main() -> None:
    """Runs the loop named by argv[1] for argv[2] steps."""
    name, steps = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    value = torch.ones(4)
    LOOPS[name](steps, value)
    print(f"finished {name}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
