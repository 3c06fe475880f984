"""One replica of the fault-tolerance tests, run as a script by test_manager_faults.py.

It trains a small model with a Manager and records, per step, what the Manager said,
then writes a JSON report with a hash of its final weights and optimizer state.
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

from dist_collectives.ft import (
    DistributedDataParallel,
    Manager,
    ProcessGroupGloo,
    ProcessGroupReconfigurableGloo,
)


def _digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            h.update(f"{index}.{key}".encode())
            if isinstance(value, torch.Tensor):
                h.update(
                    value.detach()
                    .cpu()
                    .contiguous()
                    .reshape(-1)
                    .view(torch.uint8)
                    .numpy()
                    .tobytes()
                )
    return h.hexdigest()


def _torch_reconfigurable_group(port: int) -> dist.ProcessGroup:
    """torch's own reconfigurable gloo group (torch 2.14+), as torchft 0.3's users build it.

    Each replica initialises its default group on a bootstrap prefix of the job's store
    with a rank of its own (torch's gloo tells reconfigurable members apart by it), and
    the Manager moves it to the quorum's members from then on.
    """
    client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    member = client.add("test/native/members", 1) - 1
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("test/native", client),
        rank=member,
        world_size=member + 1,
        timeout=timedelta(seconds=20),
        enable_reconfigure=True,  # type: ignore[call-arg]  # torch 2.14+
    )
    group = dist.group.WORLD
    assert group is not None
    return group


def _kill_self(store: dist.Store, manager: Manager) -> None:
    quorum = manager._quorum
    assert quorum is not None
    store.set(
        "test/killed",
        json.dumps({"quorum_id": quorum.quorum_id, "step": quorum.max_step, "time": time.time()}),
    )
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=["manager", "ddp"], default="manager")
    parser.add_argument("--kill-at-step", type=int, default=-1)
    parser.add_argument("--kill-when-count", type=int, default=4)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--restarted", action="store_true")
    parser.add_argument("--device", default="cpu", help="where the model lives (cuda: a GPU check)")
    parser.add_argument(
        "--group",
        choices=["gloo", "reconfigurable-gloo", "torch"],
        default="gloo",
        help=(
            "gloo: rebuilt per quorum; reconfigurable-gloo: torch 2.14's, reconfigured in "
            "place; torch: torch's own reconfigurable default group, handed to the Manager"
        ),
    )
    args = parser.parse_args()
    # The Manager's event lines (failure, discarded step, quorum, recovery) go to stderr.
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    torch.manual_seed(0)  # every replica starts from the same weights
    torch.set_num_threads(1)
    device = torch.device(args.device)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    group: dist.ProcessGroup
    if args.group == "torch":
        group = _torch_reconfigurable_group(args.port)
    elif args.group == "gloo":
        group = ProcessGroupGloo(timeout=timedelta(seconds=20))
    else:
        group = ProcessGroupReconfigurableGloo(timeout=timedelta(seconds=20))
    manager = Manager(
        group,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.min_replicas,
        replica_id=args.replica_id,
        store_addr="127.0.0.1",
        store_port=args.port,
        timeout=timedelta(seconds=30),
    )
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, wait_for_workers=False)
    forward: nn.Module = model
    if args.mode == "ddp":
        forward = DistributedDataParallel(manager, model, bucket_cap_mb=0.0001)
    generator = torch.Generator().manual_seed(abs(hash(args.replica_id)) % 2**31)
    log: list[dict[str, Any]] = []
    rejoined = False
    while True:
        if store.check(["test/stop_at"]) and manager.current_step() >= int(
            store.get("test/stop_at")
        ):
            break
        manager.start_quorum()
        x = torch.randn(32, 8, generator=generator).to(device)
        y = x.sum(dim=1, keepdim=True)
        optimizer.zero_grad()
        kill_now = (
            args.kill_at_step >= 0
            and manager.current_step() >= args.kill_at_step
            and manager.replica_count() == args.kill_when_count
        )
        if kill_now and args.mode == "ddp":
            # Fires after DDP issued the buckets of the later layers: dies mid-allreduce.
            model[0].weight.register_hook(lambda grad: _kill_self(store, manager))
        loss = nn.functional.mse_loss(forward(x), y)
        loss.backward()
        if args.mode == "manager":
            futures = [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]
            if kill_now:
                _kill_self(store, manager)
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
                "error_time": manager._error_wall_time,
            }
        )
        store.set(f"test/progress/{args.replica_id}", str(manager.current_step()))
        if args.restarted and committed and not rejoined:
            rejoined = True
            store.set("test/rejoined", args.replica_id)
    report = {
        "replica_id": args.replica_id,
        "step": manager.current_step(),
        "digest": _digest(model, optimizer),
        "log": log,
    }
    manager.shutdown()
    with open(args.out, "w") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    main()
