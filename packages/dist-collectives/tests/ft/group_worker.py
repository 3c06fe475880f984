"""One rank of a replica group, run as a script by test_replica_groups.py.

Each replica group holds one model sharded across its ranks: rank ``r`` owns the rows
``r`` of every layer (a column-parallel split) and trains its shard on its own slice
of the loss. Rank ``r`` of each group averages its shard's gradients with rank ``r``
of the other groups through its Manager. At the end it writes a JSON report with a
hash of its shard and optimizer state.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dist_collectives.ft import Manager, ProcessGroupGloo

FULL_WIDTH = 16


def _digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            h.update(f"{index}.{key}".encode())
            if isinstance(value, torch.Tensor):
                h.update(
                    value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                )
    return h.hexdigest()


def main() -> None:
    # Under dist-launch (one launch per group) the group comes from the environment:
    # RANK and WORLD_SIZE are the group's, FT_STORE the quorum store outside the group.
    env = os.environ
    attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=int(env.get("FT_STORE", ":0").split(":")[1]))
    parser.add_argument("--group", default=f"group{env.get('GROUP_ID', '')}")
    parser.add_argument("--group-rank", type=int, default=int(env.get("RANK", "0")))
    parser.add_argument("--group-size", type=int, default=int(env.get("WORLD_SIZE", "1")))
    parser.add_argument("--out", required=True, help="may hold {group} and {rank}")
    parser.add_argument("--kill-at-step", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=-1, help="only this rank kills itself")
    parser.add_argument("--kill-when-count", type=int, default=3)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--restarted", action="store_true")
    args = parser.parse_args()
    args.out = args.out.format(group=args.group, rank=args.group_rank)
    if attempt > 0:  # restarted by dist-launch: the kill happened in the first attempt
        args.restarted, args.kill_at_step = True, -1
    if args.kill_rank >= 0 and args.kill_rank != args.group_rank:
        args.kill_at_step = -1
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.restarted:
        # The test lets a restarted group in once the others went on without it, so that
        # it sees both the smaller quorum and the rejoin.
        waiter = dist.TCPStore("127.0.0.1", args.port, is_master=False, wait_for_workers=False)
        waiter.wait(["test/restart_ok"], timedelta(seconds=120))
        del waiter

    # Every group starts from the same full model; this rank keeps its shard of it.
    torch.manual_seed(0)
    torch.set_num_threads(1)
    full = nn.Linear(8, FULL_WIDTH)
    rows = FULL_WIDTH // args.group_size
    shard = nn.Linear(8, rows)
    with torch.no_grad():
        window = slice(args.group_rank * rows, (args.group_rank + 1) * rows)
        shard.weight.copy_(full.weight[window])
        shard.bias.copy_(full.bias[window])
    optimizer = torch.optim.Adam(shard.parameters(), lr=0.01)

    def state_dict() -> dict[str, Any]:
        return {"model": shard.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        shard.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    manager = Manager(
        ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.min_replicas,
        replica_id=args.group,
        group_rank=args.group_rank,
        group_world_size=args.group_size,
        store_addr="127.0.0.1",
        store_port=args.port,
        timeout=timedelta(seconds=30),
    )
    me = f"{args.group}/{args.group_rank}"
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, wait_for_workers=False)
    generator = torch.Generator().manual_seed(abs(hash(me)) % 2**31)
    log: list[dict[str, Any]] = []
    rejoined = False
    while True:
        if store.check(["test/stop_at"]) and manager.current_step() >= int(
            store.get("test/stop_at")
        ):
            break
        manager.start_quorum()
        x = torch.randn(32, 8, generator=generator)
        y = x.sum(dim=1, keepdim=True).expand(32, rows)
        optimizer.zero_grad()
        nn.functional.mse_loss(shard(x), y).backward()
        futures = [manager.allreduce(p.grad) for p in shard.parameters() if p.grad is not None]
        if (
            args.kill_at_step >= 0
            and manager.current_step() >= args.kill_at_step
            and manager.replica_count() == args.kill_when_count
        ):
            quorum = manager._quorum
            assert quorum is not None
            store.set(
                "test/killed",
                json.dumps(
                    {"quorum_id": quorum.quorum_id, "step": quorum.max_step, "time": time.time()}
                ),
            )
            os.kill(os.getpid(), signal.SIGKILL)
        for future in futures:
            future.wait()
        quorum = manager._quorum
        committed = manager.should_commit()
        if committed:
            optimizer.step()
        error = manager.errored()
        log.append(
            {
                "quorum_id": quorum.quorum_id if quorum else None,
                "members": len(quorum.members) if quorum else None,
                "step": quorum.max_step if quorum else None,
                "committed": committed,
                "error": repr(error) if error else None,
            }
        )
        store.set(f"test/progress/{me}", str(manager.current_step()))
        if args.restarted and committed and not rejoined:
            rejoined = True
            store.add(f"test/rejoined/{args.group}", 1)
    report = {
        "me": me,
        "step": manager.current_step(),
        "digest": _digest(shard, optimizer),
        "log": log,
    }
    manager.shutdown()
    with open(args.out, "w") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    main()
