"""The fault-tolerant path: MoE replicas that survive losing one of them mid-run.

    python examples/train_ft.py --replicas 4 --steps 40 --kill-replica 3 --kill-at-step 15

This process hosts the job's store (a TCPStore, as dist-launch's master does) and
starts one process per replica. Each replica holds the whole model of ``moe.py`` and
averages its gradients with the others through a ``dist_collectives.ft.Manager``,
which forms a quorum of the live replicas every step. ``--kill-replica`` SIGKILLs one
replica in the middle of a step: the step is discarded everywhere (``should_commit``
is False), the survivors form a quorum of three and finish. At the end the survivors
compare their weights, which must be bit-identical.

Each replica trains alone in its process, so this path does not go through
dist-launch: dist-launch stops every rank when one fails, which is what a job without
replicas wants.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from moe import ExpertParallelMoE, MoEConfig, batch, digest, teacher

import dist_core
from dist_collectives.ft import Manager, ProcessGroupGloo

logger = logging.getLogger("moe-ft-demo")


def _replica(options: argparse.Namespace) -> int:
    """One replica's training loop; writes its final weights' digests to a report."""
    torch.set_num_threads(1)
    config = MoEConfig()
    model = ExpertParallelMoE(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=options.lr)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    manager = Manager(
        ProcessGroupGloo(timeout=timedelta(seconds=20)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        # Start with all but one: a replica that starts late heals from the others, and
        # the job goes on when one is lost.
        min_replica_size=max(1, options.replicas - 1),
        replica_id=f"replica{options.replica}",
        store_addr="127.0.0.1",
        store_port=options.store_port,
        timeout=timedelta(seconds=30),
    )
    started = time.perf_counter()
    tokens_seen = 0
    while manager.current_step() < options.steps:
        manager.start_quorum()
        step = manager.current_step()
        tokens = batch(config, options.replica, step, torch.device("cpu"))
        loss = torch.nn.functional.mse_loss(model(tokens), teacher(tokens, config))
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        futures = []
        for parameter in model.parameters():
            if parameter.grad is None:  # every replica reduces every parameter
                parameter.grad = torch.zeros_like(parameter)
            futures.append(manager.allreduce(parameter.grad))
        everyone_in = manager.num_participants() == options.replicas
        if options.replica == options.kill_replica and step >= options.kill_at_step and everyone_in:
            logger.warning("replica %d: SIGKILL mid-step %d, as asked", options.replica, step)
            os.kill(os.getpid(), signal.SIGKILL)
        for future in futures:
            future.wait()
        if manager.should_commit():
            optimizer.step()
            tokens_seen += config.tokens_per_rank * manager.num_participants()
            if manager.replica_rank() == 0 and (step % 10 == 0 or step + 1 == options.steps):
                logger.info(
                    "step %d/%d loss %.5f replicas %d tokens/s %.0f",
                    step + 1,
                    options.steps,
                    loss.item(),
                    manager.num_participants(),
                    tokens_seen / (time.perf_counter() - started),
                )
        # A discarded step: the Manager logs why, and the recovery, one line each.
    report = {name: digest(value) for name, value in sorted(model.state_dict().items())}
    Path(options.report).write_text(json.dumps({"step": manager.current_step(), "digests": report}))
    manager.shutdown()
    return 0


def _coordinator(options: argparse.Namespace) -> int:
    """Hosts the store, starts the replicas, and checks how they ended."""
    port = dist_core.get_unused_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    scratch = Path(tempfile.mkdtemp(prefix="moe-ft-"))
    replicas = []
    for replica in range(options.replicas):
        argv = [
            sys.executable,
            __file__,
            "--replica",
            str(replica),
            "--store-port",
            str(port),
            "--report",
            str(scratch / f"replica{replica}.json"),
            *[f"--{key.replace('_', '-')}={value}" for key, value in _shared(options).items()],
        ]
        replicas.append(subprocess.Popen(argv))
    deadline = time.monotonic() + options.timeout
    codes = []
    for process in replicas:
        try:
            codes.append(process.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            process.kill()
            codes.append(process.wait())
    del store
    survivors = [r for r in range(options.replicas) if r != options.kill_replica]
    failed = [r for r in survivors if codes[r] != 0]
    if failed:
        logger.error("replicas %s failed: exit codes %s", failed, [codes[r] for r in failed])
        return 1
    if options.kill_replica >= 0 and codes[options.kill_replica] != -signal.SIGKILL:
        logger.error("replica %d was to be killed but ended with %s", options.kill_replica, codes)
        return 1
    reports = [json.loads((scratch / f"replica{r}.json").read_text()) for r in survivors]
    identical = all(report["digests"] == reports[0]["digests"] for report in reports)
    logger.info(
        "%d survivor(s) finished %d steps; replica %s was killed; weights bit-identical: %s",
        len(survivors),
        reports[0]["step"],
        options.kill_replica if options.kill_replica >= 0 else "none",
        "yes" if identical else "NO",
    )
    return 0 if identical else 1


def _shared(options: argparse.Namespace) -> dict[str, object]:
    return {
        "steps": options.steps,
        "lr": options.lr,
        "kill_replica": options.kill_replica,
        "kill_at_step": options.kill_at_step,
        "replicas": options.replicas,
    }


def main(argv: list[str] | None = None) -> int:
    """Coordinator by default; ``--replica N`` runs one replica (started by it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--kill-replica", type=int, default=-1)
    parser.add_argument("--kill-at-step", type=int, default=15)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--replica", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--store-port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--report", default="", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if options.replica >= 0:
        return _replica(options)
    return _coordinator(options)


if __name__ == "__main__":
    raise SystemExit(main())
