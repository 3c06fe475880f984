"""dist_collectives.ft against torchft 0.2.0: reconfiguration, per-step overhead, recovery.

Real processes on this machine share one TCPStore hosted by this script.

1. ``ProcessGroupGloo.configure`` on a new prefix with 4 ranks, and with 3 survivors
   after one rank leaves: ours and torchft's, in the same processes, interleaved.
2. Per-step time of two MLPs (a small one, about 15 ms a step here, and a large one,
   at least 50 ms) whose gradients are averaged by a plain gloo group, and by a
   :class:`dist_collectives.ft.Manager` (quorum, allreduce, commit vote), 4 processes,
   in many short alternating blocks so that both see the same load from other jobs
   (with 4 processes on 2 cores the step time drifts by 20 % within seconds). The
   first step of a block is not counted: it pays for the skew the other kind left
   between ranks.
3. Replica groups (the HSDP shape): 3 groups of 2 ranks, each rank holding a shard of
   ``SHARD_MIB`` MiB; one rank is SIGKILLed mid-step and its group's other rank is
   stopped (as the group's launcher would). Measured: the time from the death to the
   first step the other groups commit without the group, and, once the group
   restarted, the time from its ranks' first ``start_quorum`` to their first commit
   (round, reconfiguration, state transfer and one step), with the bytes each rank
   received and the transfer's rate.

4. State transfer of a ``--transfer-gib`` GiB state between two processes against the
   machine's limit for the same bytes (raw gloo, raw socket), in the same run: see
   ``_lib/ft_transfer.py``.
5. Quorum at scale: N simulated replicas (``--scale``, 64, 256, 1024 and 4096), each the
   ``StoreCoordinator`` a Manager builds, against one TCPStore on the watcher's schedule
   (100 ms ticks, 500 ms beats): time to form a quorum of N, the store calls each replica
   made for it, time until every replica saw one die, and the store load against
   the store's own rate (a count left out of ``--scale`` is scaled from the largest
   run): see ``_lib/ft_quorum_scale.py``.
6. DDP's memory: peak resident memory and step time of torch's DDP on a plain gloo
   group and of ``dist_collectives.ft.DistributedDataParallel`` through a Manager, the
   large MLP, each kind in processes of its own (a process has one peak): see
   ``_lib/ft_ddp_memory.py``. The managed step keeps one extra copy of the gradients
   (its exchange buffer); the peak above the model is printed with the gradients'
   size beside it.
7. The soak, only with ``--only soak``: the replica groups' lose-a-rank-and-rejoin
   scenario of the tests, ``--soak-runs`` times in a row (30), counting the runs whose
   shards differ between groups at the end (target: none); see ``_lib/ft_soak.py``.
   ``nox -s soak`` runs it on the newest torch. The count of the run before the fix
   that made it 0 stays in the JSON as ``soak.before_fix``.

Prints the medians and the ratios with the targets (reconfigure <= 0.25x torchft's,
managed step <= 1.05x the plain one on the large MLP), and the commit vote's own cost
per step: the time spent in ``should_commit()`` once the step's allreduces are done
(the last voter's ``add`` and ``compare_set`` on the store, the others' read of the
decision once their ``wait`` ends, and the ranks' skew). torchft's live recovery rate
is the one it reports (about 2.5 GB/s over its process-group transport), not measured
here. Without torchft installed it measures ours alone and says so. The measurements
also go to ``docs/_data/bench/ft.json`` (``--json``), which the docs draw as a figure.
``--blocks`` and ``--repeats`` make a quick run (fewer samples, noisier numbers).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
from datetime import timedelta
from importlib.metadata import version
from pathlib import Path
from typing import Any

WORLD = 4
REPEATS = 15
WARMUP_STEPS = 5
BLOCKS = 30
BLOCK_STEPS = 6
# name: (hidden width, batch); "large" is the one the 1.05x target is about.
STEP_MODELS = {"small": (256, 64), "large": (1024, 256)}
LARGE_STEP_MS = 50.0
GROUPS, GROUP_SIZE = 3, 2
SHARD_MIB = 32  # per rank: two tensors of half that (weights and a momentum)
KILL_AT_STEP = 4
TORCHFT_RECOVERY_GBPS = 2.5  # torchft's reported live-recovery rate, not measured here
TRANSFER_TARGET_GBPS = 2.5  # per rank, for a state of at least 1 GiB
SCALE_SIMULATED = "64,256,1024,4096"
SCALE_COMPUTED = (4096,)
SCENARIO_TIMEOUT = 180.0
SOAK_RUNS = 30
DDP_STEPS = 30


def _barrier(store: Any, name: str, count: int) -> None:
    if store.add(f"barrier/{name}", 1) == count:
        store.set(f"barrier/{name}/done", "1")
    store.wait([f"barrier/{name}/done"], timedelta(seconds=120))


def _reconfigure_times(
    make_pg: Any,
    configure: Any,
    rank: int,
    world: int,
    tag: str,
    store: Any,
    port: int,
    repeats: int,
) -> list[float]:
    import torch
    import torch.distributed as dist

    pg = make_pg()
    configure(pg, f"127.0.0.1:{port}/{tag}/warm", rank, world)
    times = []
    for i in range(repeats):
        _barrier(store, f"{tag}/{i}", world)
        started = time.perf_counter()
        configure(pg, f"127.0.0.1:{port}/{tag}/{i}", rank, world)
        times.append(time.perf_counter() - started)
        check = torch.ones(1)
        pg.allreduce([check], dist.AllreduceOptions()).wait()
        assert float(check) == world, f"{tag}: allreduce gave {float(check)}"
    return times


def _time_model(
    name: str, manager: Any, plain_pg: Any, store: Any, blocks: int, current: list[Any]
) -> dict[str, list[float]]:
    """Plain and managed steps of one model in short alternating blocks (same load)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    width, batch = STEP_MODELS[name]
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )
    current[:] = [model]  # what the Manager's state_dict callbacks read
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    times: dict[str, list[float]] = {"plain": [], "managed": [], "vote": [], "ratio": []}

    def plain_step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        works = [plain_pg.allreduce([g], dist.AllreduceOptions()) for g in grads]
        for work, grad in zip(works, grads, strict=True):
            work.wait()
            grad.div_(WORLD)
        optimizer.step()

    def managed_step() -> None:
        manager.start_quorum()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for future in [manager.allreduce(g) for g in grads]:
            future.wait()
        voting = time.perf_counter()
        committed = manager.should_commit()
        times["vote"].append(time.perf_counter() - voting)
        if committed:
            optimizer.step()

    _barrier(store, f"train/{name}/start", WORLD)
    for _ in range(WARMUP_STEPS):
        plain_step()
        managed_step()
    times["vote"].clear()
    for _ in range(blocks):
        block: dict[str, list[float]] = {"plain": [], "managed": []}
        for kind, step in (("plain", plain_step), ("managed", managed_step)):
            for i in range(BLOCK_STEPS):
                started = time.perf_counter()
                step()
                if i > 0:
                    block[kind].append(time.perf_counter() - started)
                elif kind == "managed":
                    times["vote"].pop()  # the block's first step is not counted
            times[kind] += block[kind]
        # Each managed block against the plain block just before it: the load drifts
        # over seconds, so a pair's ratio is steadier than the ratio of two medians.
        pair = statistics.median(block["managed"]) / statistics.median(block["plain"])
        times["ratio"].append(pair)
    return times


def _train_steps(rank: int, port: int, store: Any, blocks: int) -> dict[str, list[float]]:
    """Each model's plain and managed step times, through one Manager and one plain group."""
    from dist_collectives.ft import Manager, ProcessGroupGloo

    current: list[Any] = []
    plain_pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
    plain_pg.configure(f"127.0.0.1:{port}/plain", rank, WORLD)
    manager = Manager(
        ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=lambda state: current[0].load_state_dict(state),
        state_dict=lambda: current[0].state_dict(),
        min_replica_size=WORLD,
        replica_id=f"bench{rank}",
        store_addr="127.0.0.1",
        store_port=port,
        timeout=timedelta(seconds=60),
        namespace="bench-managed",
    )
    times: dict[str, list[float]] = {}
    for name in STEP_MODELS:
        for kind, values in _time_model(name, manager, plain_pg, store, blocks, current).items():
            times[f"{name}/{kind}"] = values
    manager.shutdown()
    plain_pg.shutdown()
    _barrier(store, "train/end", WORLD)
    return times


def _worker(
    rank: int, port: int, queue: Any, with_torchft: bool, repeats: int, blocks: int
) -> None:
    import torch
    import torch.distributed as dist

    from dist_collectives.ft import ProcessGroupGloo

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    ours_make = lambda: ProcessGroupGloo(timeout=timedelta(seconds=30))  # noqa: E731
    ours_configure = lambda pg, addr, r, w: pg.configure(addr, r, w)  # noqa: E731
    results: dict[str, list[float]] = {}
    if with_torchft:
        from torchft.process_group import ProcessGroupGloo as TorchftGloo

        tf_make = lambda: TorchftGloo(timeout=timedelta(seconds=30))  # noqa: E731
        tf_configure = lambda pg, addr, r, w: pg.configure(addr, f"replica{r}", r, w)  # noqa: E731
    for world in (WORLD, WORLD - 1):
        if rank < world:
            results[f"ours/{world}"] = _reconfigure_times(
                ours_make, ours_configure, rank, world, f"ours{world}", store, port, repeats
            )
            if with_torchft:
                results[f"torchft/{world}"] = _reconfigure_times(
                    tf_make, tf_configure, rank, world, f"torchft{world}", store, port, repeats
                )
        _barrier(store, f"phase-{world}", WORLD)
    results.update(_train_steps(rank, port, store, blocks))
    queue.put((rank, results))


# -- replica groups -----------------------------------------------------------------


class _TransferLog(logging.Handler):
    """Keeps the size and time of each state this rank received (from the log record)."""

    def __init__(self) -> None:
        super().__init__()
        self.transfers: list[tuple[int, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        size, seconds = getattr(record, "state_bytes", None), getattr(record, "state_seconds", None)
        if size is not None and seconds is not None:
            self.transfers.append((int(size), float(seconds)))


def _group_worker(
    group: int, rank: int, port: int, queue: Any, kill: bool, restarted: bool
) -> None:
    """One rank of a replica group: its shard's gradient averaged with the other groups'."""
    import torch
    import torch.distributed as dist

    from dist_collectives.ft import Manager, ProcessGroupGloo

    torch.set_num_threads(1)
    # The Manager's event lines (failure, discarded step, quorum) would bury the table.
    logging.getLogger("dist_collectives.ft").setLevel(logging.ERROR)
    transfers = _TransferLog()
    state_logger = logging.getLogger("dist_collectives.ft.replica.state_transfer")
    state_logger.addHandler(transfers)
    state_logger.setLevel(logging.INFO)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    if restarted:
        store.wait(["groups/restart"], timedelta(seconds=SCENARIO_TIMEOUT))
    numel = SHARD_MIB * 2**20 // 4 // 2
    weight = torch.full((numel,), float(rank))
    momentum = torch.zeros(numel)

    def load_state_dict(state: dict[str, torch.Tensor]) -> None:
        weight.copy_(state["weight"])
        momentum.copy_(state["momentum"])

    manager = Manager(
        ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=load_state_dict,
        state_dict=lambda: {"weight": weight, "momentum": momentum},
        min_replica_size=GROUPS - 1,
        replica_id=f"group{group}",
        group_rank=rank,
        group_world_size=GROUP_SIZE,
        store_addr="127.0.0.1",
        store_port=port,
        timeout=timedelta(seconds=60),
        namespace="bench-groups",
    )
    commits: list[tuple[float, int]] = []  # (wall time, members) of each committed step
    first_ask: float | None = None
    grad = torch.empty(numel)
    while True:
        if store.check(["groups/stop_at"]) and manager.current_step() >= int(
            store.get("groups/stop_at")
        ):
            break
        if first_ask is None:
            first_ask = time.time()
        manager.start_quorum()
        grad.fill_(0.001 * (group + 1))
        future = manager.allreduce(grad)
        if kill and manager.current_step() >= KILL_AT_STEP and manager.replica_count() == GROUPS:
            store.set("groups/killed", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        future.wait()
        members = manager.replica_count() if manager.errored() is None else 0
        if manager.should_commit():
            momentum.mul_(0.9).add_(grad)
            weight.sub_(momentum)
            commits.append((time.time(), members))
        # A restarted rank reports under a key of its own: the old one holds the steps
        # of the rank it replaces.
        progress = "rejoined" if restarted else "progress"
        store.set(f"groups/{progress}/{group}/{rank}", str(manager.current_step()))
    manager.shutdown()
    queue.put(
        (
            (group, rank, restarted),
            {"commits": commits, "first_ask": first_ask, "transfers": transfers.transfers},
        )
    )


def _replica_groups(port: int, store: Any) -> dict[str, Any]:
    """Runs the scenario; returns the death-to-commit time and the heal of the group."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    victim = GROUPS - 1

    def start(group: int, rank: int, *, kill: bool = False, restarted: bool = False) -> Any:
        proc = context.Process(
            target=_group_worker, args=(group, rank, port, queue, kill, restarted)
        )
        proc.start()
        return proc

    procs = {
        (g, r): start(g, r, kill=(g, r) == (victim, GROUP_SIZE - 1))
        for g in range(GROUPS)
        for r in range(GROUP_SIZE)
    }
    deadline = time.monotonic() + SCENARIO_TIMEOUT

    def wait_until(condition: Any, what: str) -> None:
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica-group scenario: timed out waiting for {what}")
            time.sleep(0.05)  # polling progress that other processes write to the store

    try:
        store.wait(["groups/killed"], timedelta(seconds=SCENARIO_TIMEOUT))
        killed_at = float(store.get("groups/killed"))
        procs[victim, GROUP_SIZE - 1].join(SCENARIO_TIMEOUT)
        for rank in range(GROUP_SIZE):  # what the group's launcher does
            procs[victim, rank].kill()
            procs[victim, rank].join(30)

        survivors = [(g, r) for g in range(GROUPS) if g != victim for r in range(GROUP_SIZE)]
        killed_step = KILL_AT_STEP

        def moved_on() -> bool:
            keys = [f"groups/progress/{g}/{r}" for g, r in survivors]
            return store.check(keys) and all(int(store.get(k)) > killed_step + 1 for k in keys)

        wait_until(moved_on, "the other groups to commit without the victim")
        for rank in range(GROUP_SIZE):
            procs[victim, rank] = start(victim, rank, restarted=True)
        store.set("groups/restart", "1")
        rejoined = [f"groups/rejoined/{victim}/{r}" for r in range(GROUP_SIZE)]
        wait_until(
            lambda: store.check(rejoined) and all(int(store.get(k)) > 0 for k in rejoined),
            "the restarted group to commit a step",
        )
        progress = [int(store.get(k)) for k in rejoined]
        progress += [int(store.get(f"groups/progress/{g}/{r}")) for g, r in survivors]
        store.set("groups/stop_at", str(max(progress) + 2))
        reports = {}
        for _ in range(len(procs)):
            key, report = queue.get(timeout=max(deadline - time.monotonic(), 1.0))
            reports[key] = report
        for proc in procs.values():
            proc.join(30)
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join()
    first_without = max(
        min(
            t
            for t, members in reports[g, r, False]["commits"]
            if t > killed_at and members == GROUPS - 1
        )
        for g, r in survivors
    )
    healed = [reports[victim, r, True] for r in range(GROUP_SIZE)]
    heal_seconds = max(h["commits"][0][0] for h in healed) - min(h["first_ask"] for h in healed)
    transfers = [t for h in healed for t in h["transfers"]]
    state_bytes = max(size for size, _ in transfers)
    transfer_seconds = max(seconds for _, seconds in transfers)
    return {
        "groups": GROUPS,
        "group_size": GROUP_SIZE,
        "death_to_commit_s": round(first_without - killed_at, 3),
        "heal_s": round(heal_seconds, 3),
        "state_bytes_per_rank": state_bytes,
        "transfer_s": round(transfer_seconds, 4),
        "transfer_gbps": round(state_bytes / transfer_seconds / 1e9, 3),
        # Every rank of the group heals at once, each from its own peer.
        "group_transfer_gbps": round(
            sum(size for size, _ in transfers) / transfer_seconds / 1e9, 3
        ),
        "torchft_reported_gbps": TORCHFT_RECOVERY_GBPS,
    }


def _load_text(row: dict[str, Any]) -> str:
    """The load average before the quorum and after the death (a scaled row has none)."""
    load = row.get("load_average")
    return f"{load[0]:.1f}-{load[1]:.1f}" if load else ""


def _seconds(value: float | None, width: int) -> str:
    """A time of the scale table, or "none" where the run got none."""
    return f"{value:>{width}.2f}" if value is not None else f"{'none':>{width}}"


def _transfer_and_scale(port: int, args: Any, only: str | None) -> dict[str, Any]:
    """Parts 4 and 5 (see the module doc): measures, prints, returns their JSON entries."""
    from _lib import ft_quorum_scale, ft_transfer

    results: dict[str, Any] = {}
    if only in (None, "transfer"):
        transfer = ft_transfer.measure(port, int(args.transfer_gib * 2**30), args.transfer_repeats)
        transfer["target_gbps"] = TRANSFER_TARGET_GBPS
        transfer["torchft_reported_gbps"] = TORCHFT_RECOVERY_GBPS
        results["transfer"] = transfer
        gbps, size = transfer["gbps"], transfer["state_bytes"] / 2**30
        print(
            f"state transfer of {size:.2f} GiB between 2 processes (median of "
            f"{transfer['repeats']}; ratios: median of per-repeat ratios)"
        )
        print(f"{'':<46}{'GB/s':>8}{'/ gloo':>9}{'/ socket':>10}  target")
        for kind, label in (
            ("fresh", "recv_state, fresh tensors (Manager today)"),
            ("in place", "recv_state(into=own state), in place"),
        ):
            print(
                f"{'  ' + label:<46}{gbps[kind]:>8.2f}{transfer['ratio_to_gloo'][kind]:>8.2f}x"
                f"{transfer['ratio_to_socket'][kind]:>9.2f}x  >= {TRANSFER_TARGET_GBPS} GB/s"
            )
        print(f"{'  limit: raw gloo send/recv, same bytes':<46}{gbps['gloo']:>8.2f}")
        print(f"{'  limit: raw loopback socket, same bytes':<46}{gbps['socket']:>8.2f}")
        print(
            f"{'  limit: map fresh memory of that size':<46}{gbps['map']:>8.2f}  (receiver alone)"
        )
        print(f"{'  torchft, its reported pg transport rate':<46}{TORCHFT_RECOVERY_GBPS:>8.2f}")
    if only in (None, "scale"):
        simulated = [int(n) for n in args.scale.split(",") if n]
        computed = [n for n in SCALE_COMPUTED if n not in simulated]
        rows = ft_quorum_scale.measure(port, simulated, computed)
        carried = ft_quorum_scale.carried(rows)
        results["quorum_scale"] = {
            "heartbeat_s": ft_quorum_scale.HEARTBEAT_S,
            "beat_s": ft_quorum_scale.beat_seconds(),
            "drivers": ft_quorum_scale.DRIVERS,
            "heartbeat_timeout_s": ft_quorum_scale.HEARTBEAT_TIMEOUT.total_seconds(),
            "processes": ft_quorum_scale.PROCESSES,
            "rows": rows,
            "carried_replicas": carried,
        }
        print(
            "quorum at scale: one TCPStore, replicas ticking every 100 ms and beating "
            f"every 500 ms ({ft_quorum_scale.PROCESSES} processes, "
            f"{ft_quorum_scale.DRIVERS} watch drivers each; heartbeat timeout 2 s)"
        )
        print(
            f"{'replicas':>9}{'quorum s':>10}{'joined':>8}{'decided':>8}{'calls/replica':>14}"
            f"{'death seen':>12}"
            f"{'requests/s':>12}{'keys/s':>11}{'limit keys/s':>14}{'used':>7}"
            f"{'store adds/s':>14}{'load avg':>12}"
        )
        for row in rows:
            used = row["keys_per_s"] / row["limit_keys_per_s"]
            if row["simulated"]:
                death = row["death_all_s"]
                death_text = f"{death:>11.2f}s" if death is not None else f"{'none':>12}"
                timing = (
                    f"{_seconds(row['quorum_s'], 10)}{_seconds(row['joined_s'], 8)}"
                    f"{_seconds(row['decision_s'], 8)}"
                    f"{row['round_requests_per_replica']:>14}{death_text}"
                )
            else:
                timing = f"{'(scaled from ' + str(row['scaled_from']) + ')':>52}"
            print(
                f"{row['replicas']:>9}{timing}{row['requests_per_s']:>12}"
                f"{row['keys_per_s']:>11}{row['limit_keys_per_s']:>14}{used:>6.0%}"
                f"{row['limit_adds_per_s']:>14}{_load_text(row):>12}"
            )
        for row in rows:
            if row.get("quorum_failed"):
                print(
                    f"  {row['replicas']}: {row['quorum_failed']} replicas got no quorum; the "
                    f"first error: {row['quorum_error']}"
                )
        print(
            f"  one store carries about {carried} replicas' watch at this heartbeat "
            "(requests and keys read grow as N); joined, decided: the last join and the "
            "decision's write, from the ask; calls/replica: store calls of one "
            "quorum round per replica; death seen: heartbeat timeout 2 s included"
        )
    sys.stdout.flush()
    return results


def _ddp_memory(port: int, steps: int) -> dict[str, Any]:
    """Part 6 (see the module doc): measures, prints and returns DDP's memory entry."""
    from _lib import ft_ddp_memory

    ddp = ft_ddp_memory.measure(port, WORLD, STEP_MODELS["large"], steps)
    print(
        f"DDP step, large MLP (64-{ddp['width']}-{ddp['width']}-10, batch {ddp['batch']}), "
        f"{ddp['processes']} processes per kind, gradients {ddp['grad_mib']:.2f} MiB"
    )
    print(f"{'':<46}{'peak MiB':>10}{'step ms':>10}  (peak above the model, {ddp['peak_source']})")
    for kind, label in (
        ("plain", "torch DDP, plain gloo group"),
        ("managed", "ft DistributedDataParallel, Manager"),
    ):
        row = ddp[kind]
        print(f"{'  ' + label:<46}{row['peak_above_model_mib']:>10.2f}{row['step_ms']:>10.2f}")
    extra = ddp["managed"]["peak_above_model_mib"] - ddp["plain"]["peak_above_model_mib"]
    print(
        f"{'  managed - plain':<46}{extra:>10.2f}{'':>10}  (the Manager's threads, group and "
        f"store clients, and its one exchange buffer of {ddp['grad_mib']:.2f} MiB)"
    )
    sys.stdout.flush()
    return {"ddp_memory": ddp}


def _print_steps(results: dict[int, dict[str, list[float]]]) -> dict[str, Any]:
    """Part 2 (see the module doc): prints each model's step times and ratio; their JSON."""

    def median_ms(key: str) -> float:
        return statistics.median(statistics.median(results[r][key]) for r in results) * 1000

    steps = {}
    for name, (width, batch) in STEP_MODELS.items():
        plain, managed, vote = (
            median_ms(f"{name}/{kind}") for kind in ("plain", "managed", "vote")
        )
        ratio = median_ms(f"{name}/ratio") / 1000
        steps[name] = {
            "width": width,
            "batch": batch,
            "plain_ms": round(plain, 3),
            "managed_ms": round(managed, 3),
            "ratio": round(ratio, 4),
            "vote_ms": round(vote, 3),
        }
        model = f"{name} MLP (64-{width}-{width}-10, batch {batch})"
        target = "<= 1.05x" if name == "large" else "(reference)"
        print(f"{'step, plain gloo allreduce, ' + name + ' MLP':<46}{plain:>8.2f}ms  {model}")
        print(
            f"{'step, Manager (quorum+allreduce+commit)':<46}{managed:>8.2f}ms"
            f"{'':>15}{ratio:>8.2f}x  {target} (median of paired blocks)"
        )
        print(
            f"{'  of which the commit vote (should_commit)':<46}{vote:>8.2f}ms"
            f"{'':>15}{'':>9}  {100 * vote / managed:.1f}% of the managed step"
        )
        if name == "large" and plain < LARGE_STEP_MS:
            print(f"  (the plain step took under {LARGE_STEP_MS:.0f} ms: a faster machine)")
    return steps


def _merge_part(path: str, previous: dict[str, Any], part: str, new: dict[str, Any]) -> None:
    """Writes one part's entries into the JSON of earlier runs (``--only``).

    The other parts' numbers stay as they were, from the run that measured them; each
    part's run is described under ``runs``.
    """
    from _lib.results import describe_run, write_results

    previous.pop("benchmark", None)
    runs = previous.pop("runs", {})
    last = previous.pop("run", None)
    if last is not None and "others" not in runs:
        runs["others"] = last
    previous["runs"] = runs | {part: describe_run()}
    write_results(path, "ft", previous | new)


def _steps_entries(steps: dict[str, Any]) -> dict[str, Any]:
    """The JSON entries of part 2: every model's steps, the large one's at the top level."""
    large = steps["large"]
    return {
        "step_model": f"MLP 64-{large['width']}-{large['width']}-10, batch {large['batch']}",
        "step_ms": {"plain gloo": large["plain_ms"], "Manager": large["managed_ms"]},
        "vote_ms": large["vote_ms"],
        "steps": steps,
    }


def _soak(runs: int, previous: dict[str, Any] | None) -> dict[str, Any]:
    """Part 7 (see the module doc): runs, prints and returns the soak's JSON entry.

    The entry keeps the previous one's ``before_fix``, the count before the fix.
    """
    from _lib import ft_soak

    soak = ft_soak.measure(runs)
    if previous is not None and previous.get("before_fix") is not None:
        soak["before_fix"] = previous["before_fix"]
    print(
        f"soak on torch {soak['torch']}: {soak['scenario']}: {soak['diverged']} of "
        f"{soak['runs']} runs ended with shards that differ between groups (target 0), "
        f"{soak['failed']} failed otherwise"
    )
    for line in soak["divergences"] + soak["failures"]:
        print(f"  {line[:300]}")
    sys.stdout.flush()
    return {"soak": soak}


def main() -> None:
    import torch.distributed as dist
    from _lib.results import add_json_argument, write_results

    from dist_core.ports import get_unused_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_argument(parser, "ft")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="reconfigurations per case")
    parser.add_argument(
        "--blocks", type=int, default=BLOCKS, help="alternating blocks of steps per model"
    )
    parser.add_argument(
        "--transfer-gib", type=float, default=1.0, help="size of the transferred state (GiB)"
    )
    parser.add_argument(
        "--transfer-repeats", type=int, default=5, help="interleaved repeats of the transfer"
    )
    parser.add_argument(
        "--scale",
        default=SCALE_SIMULATED,
        help="replica counts to simulate against one store (comma-separated; 4096, if "
        "left out, is scaled from the largest)",
    )
    parser.add_argument(
        "--only",
        choices=["steps", "transfer", "scale", "ddp", "soak"],
        help="run one part alone (the managed and plain steps, the transfer, the quorum "
        "at scale, DDP's peak memory, or the soak)",
    )
    parser.add_argument(
        "--ddp-steps", type=int, default=DDP_STEPS, help="timed DDP steps per rank and kind"
    )
    parser.add_argument(
        "--soak-runs", type=int, default=SOAK_RUNS, help="runs of the soak's scenario in a row"
    )
    args = parser.parse_args()

    try:
        import torchft  # noqa: F401

        with_torchft = True
    except ImportError:
        with_torchft = False
    # torch's store server and clients look up a name for each connection's address;
    # this sandbox's resolver lets about one lookup in 25 wait out its 5 s timeout,
    # which made the scale part's 2N connections take minutes (a stalled lookup in
    # the server's thread holds every connection). glibc's RES_OPTIONS bounds it, read
    # by each thread's resolver when it first looks up: set before the server starts.
    os.environ.setdefault("RES_OPTIONS", "timeout:0 attempts:1")
    port = get_unused_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    target = Path(args.json)
    if args.only not in (None, "steps"):
        previous = json.loads(target.read_text()) if args.json != "-" and target.is_file() else {}
        if args.only == "soak":
            new = _soak(args.soak_runs, previous.get("soak"))
        elif args.only == "ddp":
            new = _ddp_memory(port, args.ddp_steps)
        else:
            new = _transfer_and_scale(port, args, args.only)
        del store
        _merge_part(args.json, previous, args.only, new)
        return
    steps_only = args.only == "steps"
    if steps_only:  # one configure per group kind (the warm-up), no torchft
        with_torchft, args.repeats = False, 0
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [
        context.Process(
            target=_worker, args=(r, port, queue, with_torchft, args.repeats, args.blocks)
        )
        for r in range(WORLD)
    ]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=900) for _ in procs)
    for proc in procs:
        proc.join(60)
    if steps_only:
        del store
        print(f"dist_collectives.ft benchmark: {WORLD} processes, {mp.cpu_count()} CPU cores")
        steps = _print_steps(results)
        previous = json.loads(target.read_text()) if args.json != "-" and target.is_file() else {}
        _merge_part(args.json, previous, "steps", _steps_entries(steps))
        return
    groups = _replica_groups(port, store)
    new = _transfer_and_scale(port, args, None) | _ddp_memory(port, args.ddp_steps)
    del store

    def slowest_median(key: str) -> float:
        """Median over repeats of the slowest rank: a reconfiguration is done when all are."""
        per_rank = [results[r][key] for r in results if key in results[r]]
        return statistics.median(max(values) for values in zip(*per_rank, strict=True))

    print(f"dist_collectives.ft benchmark: {WORLD} processes, {mp.cpu_count()} CPU cores")
    print(f"{'measurement':<46}{'ours':>10}{'torchft 0.2.0':>15}{'ratio':>9}  target")
    reconfigure = []
    for world in (WORLD, WORLD - 1):
        label = (
            f"gloo configure, {world} ranks, new prefix"
            if world == WORLD
            else f"gloo configure, {world} survivors"
        )
        ours = slowest_median(f"ours/{world}") * 1000
        theirs = slowest_median(f"torchft/{world}") * 1000 if with_torchft else None
        reconfigure.append(
            {
                "ranks": world,
                "case": "new prefix" if world == WORLD else "survivors after one left",
                "ours_ms": round(ours, 3),
                "torchft_ms": None if theirs is None else round(theirs, 3),
            }
        )
        if theirs is not None:
            print(f"{label:<46}{ours:>8.2f}ms{theirs:>13.2f}ms{ours / theirs:>8.2f}x  <= 0.25x")
        else:
            print(f"{label:<46}{ours:>8.2f}ms{'n/a':>15}{'n/a':>9}  (torchft not installed)")
    steps = _print_steps(results)
    print(
        f"replica groups: {groups['groups']} groups of {groups['group_size']} ranks, "
        f"one rank SIGKILLed mid-step"
    )
    print(f"{'  death -> first commit without its group':<46}{groups['death_to_commit_s']:>9.2f}s")
    print(f"{'  heal a rejoining group (ask -> commit)':<46}{groups['heal_s']:>9.2f}s")
    transfer = (
        f"{groups['state_bytes_per_rank'] / 2**20:.0f} MiB per rank"
        f" in {groups['transfer_s'] * 1000:.0f} ms"
    )
    print(
        f"{'  state transfer, GB/s (' + transfer + ')':<46}{groups['transfer_gbps']:>8.2f} "
        f"{TORCHFT_RECOVERY_GBPS:>12.2f}  {groups['transfer_gbps'] / TORCHFT_RECOVERY_GBPS:>7.2f}x"
        "  (torchft: its reported rate)"
    )
    print(
        f"{'  the group, both ranks healing at once, GB/s':<46}"
        f"{groups['group_transfer_gbps']:>8.2f}"
    )
    sys.stdout.flush()
    write_results(
        args.json,
        "ft",
        {
            "torchft": version("torchft") if with_torchft else None,
            "reconfigure": reconfigure,
            **_steps_entries(steps),
            "replica_groups": groups,
            "targets": {"reconfigure_ratio": 0.25, "step_ratio": 1.05},
            **new,
        },
    )


if __name__ == "__main__":
    main()
