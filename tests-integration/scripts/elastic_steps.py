"""An elastic training job: all_reduce steps, one progress line per step, as torchrun runs it.

Every line starts with a word the tests parse: ``start`` (before init), ``step`` (after
each all_reduce), ``done`` (the last step of the last attempt). Each carries
``attempt=`` (TORCHELASTIC_RESTART_COUNT: failure restarts, not membership changes),
``host=``, ``rank=``, ``group_rank=``, ``world=`` and, for steps, ``sum=``.

Read from the environment:
    STEPS: all_reduce steps of the attempt that finishes (default 3).
    FINISH_ATTEMPT: the job finishes after STEPS steps once TORCHELASTIC_RESTART_COUNT
        reaches it (with none of the three FINISH_ variables set, the first attempt
        finishes).
    FINISH_WORLD: ... or once the world has at least this many ranks (default: never).
    FINISH_FILE: ... or once this file exists (checked before each step: the test
        creates it when the job may end).
        Until one of the two holds, steps go on until the group breaks (a peer gone),
        at most MAX_STEPS.
    MAX_STEPS: bound on the steps of an attempt that does not finish (default 1000).
    STEP_SECONDS: a simulated training step's duration (default 0.05).
    FAIL_HOST: the workers on the host of this name exit 1 before joining the group,
        in every attempt.
    STARTED_DIR: each worker marks its start there (a file ``<host>.<pid>``); a
        FAIL_HOST worker starting for the k-th time fails only once k x WORLD_SIZE
        starts are marked (bounded by START_WAIT_SECONDS, default 60), so that the
        peers' ``start`` lines of its round are printed before the failure makes their
        launchers stop them. Counting starts, not attempts, holds also where a
        launcher starts a round's workers without counting it as an attempt.
    COLLECTIVE_TIMEOUT: seconds gloo waits for a peer (default 60).
    HANG_RANK: after its first step, this rank waits for ever (a hang, for dist-launch's
        --hang-timeout); its peers block in the next all_reduce.
    RAISE_RANK: after step RAISE_STEP (default 2), this rank raises ValueError, saying
        ``raising rank=<r> time=<wall clock>`` on stderr first; its peers block in the
        next all_reduce until their launcher stops them (or gloo's timeout).
    CHECKPOINT_DIR: on SIGTERM a worker writes its checkpoint there (a file
        ``<host>.rank<r>.attempt<a>`` holding its last step) and exits 143.
"""

import datetime
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist


def say(line: str, fd: int = 1) -> None:
    """One whole line in one write: ranks sharing a pipe never interleave within a line."""
    os.write(fd, f"{line}\n".encode())


attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
host = socket.gethostname()
ids = (
    f"attempt={attempt} host={host} rank={os.environ['RANK']} "
    f"group_rank={os.environ.get('GROUP_RANK', '?')} world={os.environ['WORLD_SIZE']}"
)
say(f"start {ids}")
step = 0
checkpoint_dir = os.environ.get("CHECKPOINT_DIR")
if checkpoint_dir:

    def save_and_exit(signum: int, frame: object) -> None:
        name = f"{host}.rank{os.environ['RANK']}.attempt{attempt}"
        with open(os.path.join(checkpoint_dir, name), "w") as checkpoint:
            checkpoint.write(str(step))
        say(f"checkpoint {ids} step={step}")
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, save_and_exit)
started_dir = os.environ.get("STARTED_DIR")
if started_dir:
    with open(os.path.join(started_dir, f"{host}.{os.getpid()}"), "w"):
        pass
if os.environ.get("FAIL_HOST") == host:
    if started_dir:
        deadline = time.monotonic() + float(os.environ.get("START_WAIT_SECONDS", "60"))
        mine = sum(name.startswith(f"{host}.") for name in os.listdir(started_dir))
        wanted = mine * int(os.environ["WORLD_SIZE"])
        while time.monotonic() < deadline and len(os.listdir(started_dir)) < wanted:
            time.sleep(0.05)  # polls files a worker in another network namespace writes
    say(f"failing {ids}", 2)
    sys.exit(1)

timeout = datetime.timedelta(seconds=float(os.environ.get("COLLECTIVE_TIMEOUT", "60")))
dist.init_process_group("gloo", timeout=timeout)
rank, world = dist.get_rank(), dist.get_world_size()
finish_attempt = os.environ.get("FINISH_ATTEMPT")
finish_world = os.environ.get("FINISH_WORLD")
finish_file = os.environ.get("FINISH_FILE")
# With no condition given, the first attempt finishes.
finishing = not (finish_attempt or finish_world or finish_file)
finishing |= finish_attempt is not None and attempt >= int(finish_attempt)
finishing |= finish_world is not None and world >= int(finish_world)
steps = int(os.environ.get("STEPS", "3")) if finishing else int(os.environ.get("MAX_STEPS", "1000"))
pause = float(os.environ.get("STEP_SECONDS", "0.05"))
while step < steps:
    step += 1
    if not finishing and finish_file and os.path.exists(finish_file):
        finishing, steps = True, step - 1 + int(os.environ.get("STEPS", "3"))
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    say(f"step {ids} step={step} sum={int(value.item())} time={time.time():.6f}")
    if os.environ.get("HANG_RANK") == str(rank):
        time.sleep(100_000)  # a data loader that never answers
    if os.environ.get("RAISE_RANK") == str(rank) and step == int(os.environ.get("RAISE_STEP", "2")):
        say(f"raising rank={rank} time={time.time():.6f}", 2)
        raise ValueError(f"rank {rank} found a bad batch at step {step}")
    time.sleep(pause)  # the training step itself
if not finishing:
    say(f"never broken {ids}: {steps} steps and no peer went away", 2)
    sys.exit(3)
dist.barrier()  # nobody tears the group down while a peer still talks to it
say(f"done {ids} steps={steps}")
dist.destroy_process_group()
