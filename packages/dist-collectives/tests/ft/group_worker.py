"""One rank of a replica group, run as a script by test_replica_groups.py.

Each replica group trains one small MLP with torch's FSDP (``fully_shard``, FSDP2) on
the group's own gloo process group: rank ``r`` of the group owns the ``r``-th half of
every parameter (and of its Adam state); the forward all-gathers the full parameters
inside the group, the backward reduce-scatters the gradients inside the group (each
rank of the group trains on its own batch), so the loss depends on the whole model and
on both ranks of the group. Rank ``r`` of each group then averages its shard's
gradients with rank ``r`` of the other groups through its Manager, and steps its
shard's optimizer only when the step commits. A healing rank receives its shard's
parameters and optimizer state, as local tensors, from rank ``r`` of a healthy group.
At the end it writes a JSON report with a hash of its shard and optimizer state.

The group's process group comes from the launcher's variables (``MASTER_ADDR``,
``MASTER_PORT``: one dist-launch per group) or, without a launcher, from the quorum
store under a prefix of its own per group and start.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dist_collectives.ft import Manager, ProcessGroupGloo

WIDTH = 16
# How long a collective inside a group may wait for its peer: a rank whose peer died
# is stopped by the test (or the group's launcher) long before this runs out.
GROUP_TIMEOUT = timedelta(seconds=60)


def _as_bytes(tensor: torch.Tensor) -> bytes:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return bytes(local.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def _digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """A hash of this rank's shard: its parameters and its optimizer state."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(_as_bytes(tensor))
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            h.update(f"{index}.{key}".encode())
            if isinstance(value, torch.Tensor):
                h.update(_as_bytes(value))
    return h.hexdigest()


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def shard_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shard as plain tensors (what the Manager sends to a healing rank)."""
    optim = optimizer.state_dict()
    return {
        "model": {name: _local(p.detach()) for name, p in model.named_parameters()},
        "optim": {
            "state": {i: {k: _local(v) for k, v in s.items()} for i, s in optim["state"].items()},
            "param_groups": optim["param_groups"],
        },
    }


def load_shard_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Writes a healthy peer's shard into this rank's sharded parameters and optimizer.

    The optimizer of a restarted rank has no state yet, so its sharded tensors are
    built from the received local ones with the placements of their parameters.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            _local(param).copy_(state["model"][name])
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def sharded(index: int, value: torch.Tensor) -> torch.Tensor:
        param = params[index]
        if value.dim() == 0 or not isinstance(param, DTensor):
            return value  # Adam's step counter is a plain scalar
        return DTensor.from_local(
            value,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )

    optim = state["optim"]
    optimizer.load_state_dict(
        {
            "state": {
                int(i): {k: sharded(int(i), v) for k, v in s.items()}
                for i, s in optim["state"].items()
            },
            "param_groups": optim["param_groups"],
        }
    )


def _init_group(args: argparse.Namespace, attempt: int) -> None:
    """The group's own process group: the launcher's store, else a prefix of ours."""
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
        return
    client = dist.TCPStore("127.0.0.1", args.port, is_master=False, wait_for_workers=False)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"test/intra/{args.group}/{attempt}", client),
        rank=args.group_rank,
        world_size=args.group_size,
        timeout=GROUP_TIMEOUT,
    )


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
    parser.add_argument(
        "--fail-first-load",
        action="store_true",
        help="this rank's first load of a healed state fails, once group rank 0 loaded its own",
    )
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

    incarnation = attempt if attempt > 0 else int(args.restarted)
    _init_group(args, incarnation)
    mesh = init_device_mesh("cpu", (args.group_size,))
    # Every group starts from the same full model; FSDP keeps this rank's shard of it.
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(8, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 2))
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def state_dict() -> dict[str, Any]:
        return shard_state(model, optimizer)

    loads = f"test/loads/{args.group}/{incarnation}"
    failed_loads: list[str] = []

    def load_state_dict(state: dict[str, Any]) -> None:
        if args.fail_first_load and not failed_loads:
            # After rank 0 of the group loaded its shard: the group's ranks then disagree
            # on the step they hold, which the group's quorum request must not hide.
            store.wait([f"{loads}/0"], timedelta(seconds=60))
            failed_loads.append("failed")
            raise RuntimeError(f"{args.group}/{args.group_rank}: a load that fails once")
        load_shard_state(model, optimizer, state)
        store.add(f"{loads}/{args.group_rank}", 1)

    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, wait_for_workers=False)
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
        y = torch.stack([x.sum(dim=1), x[:, 0] * x[:, 1]], dim=1)
        optimizer.zero_grad()
        # FSDP: all-gather the parameters in the group, reduce-scatter the gradients.
        nn.functional.mse_loss(model(x), y).backward()
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        futures = [manager.allreduce(grad) for grad in grads]
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
                # After the step: where two groups' shards first differ, if they do.
                "digest": _digest(model, optimizer)[:16],
                "healed": quorum.is_behind(args.group) if quorum else None,
            }
        )
        store.set(f"test/progress/{me}", str(manager.current_step()))
        if args.restarted and committed and not rejoined:
            rejoined = True
            store.add(f"test/rejoined/{args.group}", 1)
    report = {
        "me": me,
        "step": manager.current_step(),
        "digest": _digest(model, optimizer),
        "log": log,
    }
    manager.shutdown()
    dist.destroy_process_group()
    with open(args.out, "w") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    main()
