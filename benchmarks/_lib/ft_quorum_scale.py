"""Quorum at scale: N simulated replicas against one TCPStore on loopback.

Each simulated replica is what a :class:`dist_collectives.ft.Manager` does with the
store, through the store coordinator's own functions (``Liveness``, ``compute_quorum``), on
the same three connections a Manager opens for them:

- a watcher thread that ticks every 100 ms: it beats every fifth tick (``Liveness.beat``,
  every 500 ms: a quarter of the 2 s heartbeat timeout) and reads the registry
  version with it, polls the quorum's error key every tick and, every second tick,
  reads who of the quorum is alive (``Liveness.alive_members``: the quorum's first member reads
  every heartbeat and publishes whom it found gone; the others read that record and
  the first member's heartbeat), as the Manager's watcher does while a step runs;
- ``compute_quorum`` with ``min_replicas=N`` on a bounded connection (the Manager's
  ``BoundedStore``, whose link thread waits for the decision), its ticker on a second.

The replicas run as threads spread over ``PROCESSES`` processes (on a machine of
2 cores, 3N threads: the replicas' own Python work shares the cores with the store,
which a real job's replicas, each on its own host, would not). Measured per N:

- quorum: from the moment every replica is told to ask until the last one has the
  decision of a quorum of all N, and the store calls each replica made for it;
- death: one replica (not the first member) stops beating; the time until the last
  of the others sees it gone (the heartbeat timeout, 2 s, is part of it);
- load: the store requests and keys read per second during the watch, counted at the
  clients; and the limit: the store's own rate of ``add`` round trips and of keys
  read by ``multi_get`` of 2N keys, measured from as many client threads with the
  simulation idle, in the same run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from _lib.processes import collect, reap

# How many processes the replicas' threads are spread over (FT_BENCH_SCALE_PROCESSES):
# fewer threads per process hand the GIL around less.
PROCESSES = int(os.environ.get("FT_BENCH_SCALE_PROCESSES", "4"))
HEARTBEAT_S = 0.1  # the Manager's default heartbeat_interval: the watcher's tick
CHECK_TICKS = 2  # the Manager's watcher reads liveness every second tick
HEARTBEAT_TIMEOUT = timedelta(seconds=2)  # the Manager's default
# The Manager's beat: a quarter of the heartbeat timeout (ManagerConfig.beat_interval).
BEAT_TICKS = 5
LIMIT_THREADS = 8  # per process, for the store's own rate
LIMIT_SECONDS = 1.5
# How long a process waits for the others between phases: the processes connect one
# after the other, 3N clients in all (minutes at 4,096 on a loaded machine).
SETUP_WAIT = timedelta(seconds=1800)


class _Counting:
    """A store client that counts its requests and the keys they carry."""

    def __init__(self, store: Any, counts: list[int]) -> None:
        self._store = store
        self._counts = counts  # [requests, keys]

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self._counts[0] += 1
            keys = args[0] if args and isinstance(args[0], list) else [None]
            self._counts[1] += len(keys)
            return method(*args, **kwargs)

        return call


def _bounded(port: int, namespace: str, rid: str) -> Any:
    from dist_collectives.ft.coordination.bounded_store import BoundedStore

    return BoundedStore(
        "127.0.0.1", port, prefix=namespace, timeout=timedelta(seconds=120), label=rid
    )


def _connect(port: int, namespace: str) -> Any:
    from torch.distributed import PrefixStore

    from dist_collectives.ft.store import connect_tcp_store

    client = connect_tcp_store("127.0.0.1", port, timedelta(seconds=120), shared=False)
    return PrefixStore(namespace, client)


def _store_limit(port: int, n: int, seconds: float) -> dict[str, float]:
    """``add`` round trips per second, and keys per second read by ``multi_get`` of 2n keys."""
    stores = [_connect(port, f"limit{n}") for _ in range(LIMIT_THREADS)]
    stores[0].set("k", "1")
    keys = [f"key{i}" for i in range(2 * n)]
    for key in keys:
        stores[0].set(key, "1")
    counts = [0] * LIMIT_THREADS
    rates = {}
    for kind in ("add", "multi_get"):
        stop = time.monotonic() + seconds

        def run(i: int, kind: str = kind, stop: float = stop) -> None:
            store, done = stores[i], 0
            while time.monotonic() < stop:
                if kind == "add":
                    store.add("counter", 1)
                    done += 1
                else:
                    store.multi_get(keys)
                    done += len(keys)
            counts[i] = done

        threads = [threading.Thread(target=run, args=(i,)) for i in range(LIMIT_THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        rates[kind] = sum(counts) / seconds
    return rates


def _worker(index: int, port: int, n: int, queue: Any, connecting: Any) -> None:
    from dist_collectives.ft.coordination.store_coordinator import Keys, Liveness, compute_quorum

    namespace = f"scale{n}"
    ids = [f"r{i:04d}" for i in range(index, n, PROCESSES)]
    victim = f"r{n - 1:04d}"  # not the first member, which reads for the others
    counts = [0, 0]
    round_counts = [0, 0]  # the calls of compute_quorum alone
    # One process connects at a time: a storm of connects from several processes
    # makes some wait seconds for a retry here (gVisor's loopback).
    with connecting:
        control = _connect(port, namespace)
        watchers = {
            rid: Liveness(_Counting(_connect(port, namespace), counts), HEARTBEAT_TIMEOUT)
            for rid in ids
        }
        bounded = {rid: _bounded(port, namespace, rid) for rid in ids}
        for store in bounded.values():  # connects now, as a Manager does when it starts
            store.add("connected_probe", 0)
        quorum_stores = {rid: _Counting(bounded[rid], round_counts) for rid in ids}
        tickers = {
            rid: Liveness(_Counting(_connect(port, namespace), round_counts), HEARTBEAT_TIMEOUT)
            for rid in ids
        }
    for rid in ids:
        watchers[rid].announce(rid)
    control.add("connected", 1)
    if index == 0:  # the store's own rate, while nothing else uses it
        while int(control.add("connected", 0)) < PROCESSES:
            time.sleep(0.01)
        limit = _store_limit(port, n, LIMIT_SECONDS)
        control.set("limit_done", "1")
    else:
        limit = None
        control.wait(["limit_done"], SETUP_WAIT)
    stopped = threading.Event()  # the victim's heartbeat
    done = threading.Event()
    watching = threading.Event()
    learned: dict[str, float] = {}
    late_beats = [0]
    quorums: dict[str, Any] = {}

    def watch(rid: str) -> None:
        liveness = watchers[rid]
        store = liveness.store
        ticks = 0
        next_beat = time.monotonic()
        while not done.is_set():
            # A tick without a store call (before the watch, all but the beat's) is left
            # out: the thread sleeps to the next one with a call, to spare the cores.
            skip = 1 if watching.is_set() else BEAT_TICKS - ticks % BEAT_TICKS
            next_beat += HEARTBEAT_S * skip
            delay = next_beat - time.monotonic()
            if delay > 0:
                done.wait(delay)
            else:
                late_beats[0] += 1
                next_beat = time.monotonic()
            ticks += skip
            if rid == victim and stopped.is_set():
                continue
            slow = ticks % CHECK_TICKS == 0
            if ticks % BEAT_TICKS == 0:
                liveness.beat(rid)
                store.add(Keys.REGISTRY_VERSION, 0)  # the Manager reads newcomers with the beat
            if not watching.is_set():
                continue
            quorum = quorums[rid]
            store.check([Keys.error(quorum)])
            if slow and rid not in learned:
                alive = liveness.alive_members(
                    quorum.quorum_id, quorum.members, rid, monitor=rid == quorum.members[0]
                )
                if victim not in alive:
                    learned[rid] = time.time()

    threads = [threading.Thread(target=watch, args=(rid,), daemon=True) for rid in ids]
    for thread in threads:
        thread.start()
    control.add("ready", 1)
    control.wait(["go"], SETUP_WAIT)
    asked_at = float(control.get("go"))
    decided: dict[str, float] = {}
    sizes: list[int] = []

    def ask(rid: str) -> None:
        quorum = compute_quorum(
            quorum_stores[rid],
            rid,
            0,
            liveness=tickers[rid],
            min_replicas=n,
            join_timeout=timedelta(seconds=60),
            timeout=timedelta(seconds=120),
        )
        decided[rid] = time.time()
        quorums[rid] = quorum
        sizes.append(len(quorum.members))

    askers = [threading.Thread(target=ask, args=(rid,)) for rid in ids]
    for thread in askers:
        thread.start()
    for thread in askers:
        thread.join()
    control.add("decided", 1)
    control.wait(["watch"], SETUP_WAIT)
    watching.set()
    before = list(counts)
    started = time.monotonic()
    control.wait(["kill"], SETUP_WAIT)
    load_seconds = time.monotonic() - started
    load = [(after - b) / load_seconds for after, b in zip(counts, before, strict=True)]
    if victim in watchers:
        stopped.set()
        control.set("killed_at", repr(time.time()))
    killed_at = float(control.get("killed_at"))
    deadline = time.monotonic() + 60
    others = [rid for rid in ids if rid != victim]
    while time.monotonic() < deadline and not all(rid in learned for rid in others):
        time.sleep(0.05)  # the watcher threads record when they saw the death
    done.set()
    queue.put(
        {
            "quorum_s": [decided[rid] - asked_at for rid in ids],
            "sizes": sizes,
            "death_s": [learned[rid] - killed_at for rid in others if rid in learned],
            "missed": len([rid for rid in others if rid not in learned]),
            "load": load,
            "round_requests": round_counts[0],
            "late_beats": late_beats[0],
            "limit": limit,
        }
    )


def measure_one(port: int, n: int) -> dict[str, Any]:
    """One N: quorum formation, death detection, store load and limit."""
    from torch.distributed import PrefixStore, TCPStore

    client = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    control = PrefixStore(f"scale{n}", client)
    context = mp.get_context("spawn")
    queue = context.Queue()
    # torch's store client looks up a name for each connection's address; this
    # sandbox's resolver lets about one lookup in 25 wait out its 5 s timeout, which
    # makes 3N connections take minutes. glibc's RES_OPTIONS bounds the wait to 1 s.
    os.environ.setdefault("RES_OPTIONS", "timeout:0 attempts:1")
    connecting = context.Lock()
    procs = [
        context.Process(target=_worker, args=(i, port, n, queue, connecting))
        for i in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    started = time.monotonic()

    def phase(name: str) -> None:
        print(f"  [{n}] {name} at {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)

    try:
        while int(control.add("ready", 0)) < PROCESSES:
            time.sleep(0.05)  # the processes connect 3N clients and measure the limit
        phase("connected")
        load_before = os.getloadavg()[0]
        control.set("go", repr(time.time()))
        while int(control.add("decided", 0)) < PROCESSES:
            time.sleep(0.05)
        phase("decided")
        control.set("watch", "1")
        time.sleep(2.0)  # the watch's steady load
        control.set("kill", "1")
        reports = collect(queue, procs, len(procs), 120)
        phase("death seen")
        load_after = os.getloadavg()[0]
    finally:
        reap(procs, 30)
    limit = next(r["limit"] for r in reports if r["limit"] is not None)
    quorum = [t for r in reports for t in r["quorum_s"]]
    death = [t for r in reports for t in r["death_s"]]
    requests = sum(r["load"][0] for r in reports)
    keys = sum(r["load"][1] for r in reports)
    assert all(size == n for r in reports for size in r["sizes"]), "a quorum missed replicas"
    return {
        "replicas": n,
        "quorum_s": round(max(quorum), 3),
        "quorum_median_s": round(statistics.median(quorum), 3),
        "death_all_s": round(max(death), 3) if death else None,
        "death_median_s": round(statistics.median(death), 3) if death else None,
        "death_missed": sum(r["missed"] for r in reports),
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT.total_seconds(),
        "round_requests_per_replica": round(sum(r["round_requests"] for r in reports) / n, 1),
        "requests_per_s": round(requests),
        "keys_per_s": round(keys),
        "limit_adds_per_s": round(limit["add"]),
        "limit_keys_per_s": round(limit["multi_get"]),
        "late_beats": sum(r["late_beats"] for r in reports),
        "load_average": [round(load_before, 1), round(load_after, 1)],
    }


def demand(measured: dict[str, Any], n: int) -> dict[str, Any]:
    """The store load of ``n`` replicas, scaled from a measured row: requests and keys
    read grow as N (one replica reads every replica's two keys, the others a few)."""
    base = measured["replicas"]
    return {
        "replicas": n,
        "simulated": False,
        "scaled_from": base,
        "requests_per_s": round(measured["requests_per_s"] * n / base),
        "keys_per_s": round(measured["keys_per_s"] * n / base),
        "limit_adds_per_s": measured["limit_adds_per_s"],
        "limit_keys_per_s": measured["limit_keys_per_s"],
    }


def carried(rows: list[dict[str, Any]]) -> int:
    """The most replicas whose watch stays within the store's measured rates.

    What each replica costs (requests and keys per second) comes from the smallest run
    (whose watchers kept their beat), the store's rates from the largest run that did
    not saturate it; both grow as N.
    """
    simulated = [row for row in rows if row.get("simulated", True)]
    within = [row for row in simulated if row["keys_per_s"] < row["limit_keys_per_s"]]
    smallest, largest = simulated[0], (within or simulated)[-1]
    keys = smallest["keys_per_s"] / smallest["replicas"]
    requests = smallest["requests_per_s"] / smallest["replicas"]
    return int(min(largest["limit_keys_per_s"] / keys, largest["limit_adds_per_s"] / requests))


def measure(port: int, simulated: list[int], scaled: list[int]) -> list[dict[str, Any]]:
    """Every N in ``simulated`` run one after the other; those in ``scaled`` computed from
    the largest run (see :func:`demand`)."""
    rows = [measure_one(port, n) | {"simulated": True} for n in simulated]
    return rows + [demand(rows[-1], n) for n in scaled]
