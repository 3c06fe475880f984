"""One replica of test_recovery_output.py's first-quorum test, run as a script.

Per repetition it waits until every replica is ready, starts after its own delay (so
the replicas start within a second of each other, as processes launched together
do), builds a Manager on a namespace of its own for that repetition, trains one step
and records the first quorum it was in.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dist_collectives.ft import Manager, ProcessGroupGloo


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--stagger", type=float, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1",
        args.port,
        is_master=False,
        wait_for_workers=False,
        timeout=timedelta(seconds=120),
    )
    weights = torch.zeros(4)
    firsts = []
    for repeat in range(args.repeats):
        # Every replica is ready before any starts: process start-up (imports) on a
        # loaded machine varies by seconds, which is not what this test is about.
        if store.add(f"test/ready/{repeat}", 1) == args.replicas:
            store.set(f"test/go/{repeat}", "1")
        store.wait([f"test/go/{repeat}"])
        time.sleep(args.index * args.stagger)  # the start-up spread, not a synchronisation
        manager = Manager(
            ProcessGroupGloo(timeout=timedelta(seconds=30)),
            load_state_dict=lambda state: weights.copy_(state["w"]),
            state_dict=lambda: {"w": weights},
            replica_id=f"replica{args.index}",
            store_addr="127.0.0.1",
            store_port=args.port,
            timeout=timedelta(seconds=60),
            namespace=f"first-quorum-{repeat}",
        )
        manager.start_quorum()
        grad = torch.ones(4)
        manager.allreduce(grad).wait()
        firsts.append(
            {
                "quorum_id": manager.quorum_id(),
                "members": manager.replica_count(),
                "participants": manager.num_participants(),
                "committed": manager.should_commit(),
            }
        )
        # Nobody leaves before everybody voted: a replica that shuts down early is
        # simply left out of the next quorum, which this test does not look at.
        if store.add(f"test/done/{repeat}", 1) == args.replicas:
            store.set(f"test/all-done/{repeat}", "1")
        store.wait([f"test/all-done/{repeat}"])
        manager.shutdown()
    with open(args.out, "w") as handle:
        json.dump(firsts, handle)


if __name__ == "__main__":
    main()
