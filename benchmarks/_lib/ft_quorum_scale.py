"""Quorum at scale: N simulated replicas against one TCPStore on loopback.

Each simulated replica is a ``StoreCoordinator``
(``dist_collectives.ft.coordination.store_coordinator``), the object a
:class:`dist_collectives.ft.Manager` speaks to the other replicas through, built from
the Manager's own settings (``ManagerConfig``) on its own TCPStore connections. What
the simulation runs of it is the product's code:

- ``join`` (announce), then ``quorum`` from one thread per replica, as the Manager's
  quorum worker asks, on a bounded connection (the Manager's ``BoundedStore``, whose
  link thread waits for the decision), with ``min_replicas=N``;
- the watcher's store calls on the watcher's own schedule
  (:class:`~dist_collectives.ft.replica.manager_watcher.WatchSchedule`: a tick every
  100 ms, a beat every 500 ms, a look at the step every second tick, the registry
  version every second while no step runs): ``beat``, ``watch`` and
  ``registry_version``.

What is simulated, and why: a Manager runs its watcher on a thread of its own and
its replica on a host of its own. Here the replicas are spread over ``PROCESSES``
processes on a machine of 2 cores, where 3N threads that wake every tick starve the
store and each other (the simulation measured its own scheduler, not the protocol).
So ``DRIVERS`` threads per process each step the watchers of a slice of the replicas,
one tick after the other, through each replica's coordinator and connection; a tick
that a driver starts late is counted (``late_ticks``). A Manager's watcher also expires
futures and checks deadlines on each tick, without the store: left out. The
watcher and the quorum's round ticks share one plain connection per replica (the
Manager gives each its own bounded one): neither waits on the server, and 2N
connections connect in half the time of 3N on this sandbox's loopback.

Measured per N:

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

# How many processes the replicas are spread over (FT_BENCH_SCALE_PROCESSES), and how
# many threads of each step the replicas' watchers (FT_BENCH_SCALE_DRIVERS). Each
# simulated replica has two threads (its quorum's, its bounded store's link), and all of
# a process's threads take turns on one interpreter lock: with 128 replicas to a
# process the decision reached the last of 1,024 replicas 1.9-2.9 s after it was
# written, with 64 (16 processes) 0.5-1.3 s in three runs and 3.3 s in a fourth (a
# real replica has a process, and a host, of its own). With 32 processes on 2 cores
# the processes themselves queued for the cores (the ask reached them up to 10 s late).
PROCESSES = int(os.environ.get("FT_BENCH_SCALE_PROCESSES", "16"))
DRIVERS = int(os.environ.get("FT_BENCH_SCALE_DRIVERS", "1"))

HEARTBEAT_INTERVAL = timedelta(milliseconds=100)  # the Manager's default: the watcher's tick
HEARTBEAT_S = HEARTBEAT_INTERVAL.total_seconds()
HEARTBEAT_TIMEOUT = timedelta(seconds=2)  # the Manager's default
LIMIT_THREADS = 8  # per process, for the store's own rate
LIMIT_SECONDS = 1.5
# How long a process waits for the others between phases: the processes connect one
# after the other, 2N clients in all (minutes at 4,096 on a loaded machine).
SETUP_WAIT = timedelta(seconds=1800)
STORE_TIMEOUT = timedelta(seconds=120)
# How long a replica waits for the quorum (the Manager's ``timeout``): a replica that
# gets none is counted in ``quorum_failed`` with the error it got.
QUORUM_TIMEOUT = timedelta(seconds=300)


def _config(replica_id: str, n: int) -> Any:
    """The settings of one simulated replica's Manager."""
    from dist_collectives.ft.replica.manager_config import ManagerConfig

    return ManagerConfig(
        replica_id=replica_id,
        host="127.0.0.1",
        port=0,
        min_replica_size=n,
        timeout=STORE_TIMEOUT,
        heartbeat_interval=HEARTBEAT_INTERVAL,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        join_timeout=timedelta(seconds=60),
        first_quorum_window=timedelta(0),
        namespace=f"scale{n}",
        group_rank=0,
        group_world_size=1,
        init_sync=False,
    )


def beat_seconds() -> float:
    """How often a simulated replica beats (the Manager's beat interval)."""
    return _config("r", 1).beat_interval.total_seconds()


class _Counting:
    """A store client that counts its requests and the keys they carry."""

    def __init__(self, store: Any, counts: list[int], ended: list[float] | None = None) -> None:
        self._store = store
        self._counts = counts  # [requests, keys]
        self._ended = ended  # when each call returned, if kept

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self._counts[0] += 1
            keys = args[0] if args and isinstance(args[0], list) else [None]
            self._counts[1] += len(keys)
            result = method(*args, **kwargs)
            if self._ended is not None:
                self._ended.append(time.time())
            return result

        return call


class _NoGroup:
    """The Manager's side of the coordinator's waits, for a replica of one rank."""

    def group_wait(self, *, arrival: str | None = None, awaited: str | None = None) -> str | None:
        return None

    def vote_wait(self, deadline: float | None) -> None:
        return None


class _Replica:
    """One simulated replica: its coordinator, and what the round and the watch cost it."""

    def __init__(self, rid: str, n: int, port: int, shared: Any) -> None:
        from dist_collectives.ft.coordination.store_coordinator import StoreCoordinator

        self.rid = rid
        self.round_counts = [0, 0]  # the calls of the quorum round on its second connection
        # When each call on the quorum's connection returned: the fourth ends its join
        # (read the round, append, bump the version, elect the closer).
        self.quorum_calls_ended: list[float] = []
        self.watch_counts = [0, 0]  # the watcher's
        namespace = f"scale{n}"
        plain = _connect(port, namespace)
        # The calls the quorum's link thread makes, counted apart (another thread).
        self.link_counts = [0, 0]
        bounded = _bounded(port, namespace, rid, self.link_counts, self.quorum_calls_ended)
        bounded.add("connected_probe", 0)  # connects now, as a Manager does when it starts
        self.link_counts[:] = [0, 0]
        self.quorum_calls_ended.clear()
        stores = {
            "vote": shared,  # the simulation never votes
            "quorum": bounded,
            "round": _Counting(plain, self.round_counts),
            "watch": _Counting(plain, self.watch_counts),
        }
        settings = _config(rid, n).coordinator_settings()
        self.coordinator = StoreCoordinator(settings, stores.__getitem__, _NoGroup())
        self.bounded = bounded
        self.quorum: Any = None
        self.error: str | None = None
        self.decided_at: float | None = None
        self.learned_at: float | None = None


def _bounded(port: int, namespace: str, rid: str, counts: list[int], ended: list[float]) -> Any:
    """The Manager's bounded connection, counting each call its link makes on the store.

    Counted on the link, not at the caller: the coordinator hands several calls to the
    link at once (its join, its wait for the decision), each one a request to the store.
    """
    from dist_collectives.ft.coordination.bounded_store import BoundedStore

    class CountedBoundedStore(BoundedStore):
        def _connect(self) -> Any:
            return _Counting(super()._connect(), counts, ended)

    return CountedBoundedStore(
        "127.0.0.1", port, prefix=namespace, timeout=STORE_TIMEOUT, label=rid
    )


def _connect(port: int, namespace: str) -> Any:
    from torch.distributed import PrefixStore

    from dist_collectives.ft.store import connect_tcp_store

    client = connect_tcp_store("127.0.0.1", port, STORE_TIMEOUT, shared=False)
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


class _Driver:
    """Steps the watchers of a slice of the replicas, tick by tick (see the module doc)."""

    def __init__(self, replicas: list[_Replica], victim: str, schedule: Any) -> None:
        self._replicas = replicas
        self._victim = victim
        self._schedule = schedule
        self.stopped = threading.Event()  # the victim's heartbeat
        self.watching = threading.Event()
        self.done = threading.Event()
        self.late_ticks = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        ticks = 0
        next_tick = time.monotonic()
        while not self.done.is_set():
            next_tick += HEARTBEAT_S
            delay = next_tick - time.monotonic()
            if delay > 0:
                self.done.wait(delay)
            else:
                self.late_ticks += 1
                next_tick = time.monotonic()
            ticks += 1
            duties = self._schedule.duties(ticks)
            watching = self.watching.is_set()
            for replica in self._replicas:
                if replica.rid == self._victim and self.stopped.is_set():
                    continue
                self._tick(replica, duties, watching)

    def _tick(self, replica: _Replica, duties: Any, watching: bool) -> None:
        """The store calls of one tick of one replica's watcher (``Watcher._tick``'s)."""
        coordinator = replica.coordinator
        if duties.beat:
            coordinator.beat()
        if watching and duties.look and replica.quorum is not None:
            seen = coordinator.watch(replica.quorum)
            if replica.learned_at is None and self._victim not in seen.alive:
                replica.learned_at = time.time()
        elif not watching and duties.registry:
            coordinator.registry_version()


def _worker(index: int, port: int, n: int, queue: Any, connecting: Any) -> None:
    from dist_collectives.ft.coordination.coordinator import JoinRequest
    from dist_collectives.ft.replica.manager_watcher import WatchSchedule

    namespace = f"scale{n}"
    ids = [f"r{i:04d}" for i in range(index, n, PROCESSES)]
    victim = f"r{n - 1:04d}"  # not the first member, which reads for the others
    # One process connects at a time: a storm of connects from several processes
    # makes some wait seconds for a retry here (gVisor's loopback).
    with connecting:
        control = _connect(port, namespace)
        replicas = [_Replica(rid, n, port, control) for rid in ids]
    for replica in replicas:
        replica.coordinator.join()
    control.add("connected", 1)
    if index == 0:  # the store's own rate, while nothing else uses it
        while int(control.add("connected", 0)) < PROCESSES:
            time.sleep(0.01)
        limit = _store_limit(port, n, LIMIT_SECONDS)
        control.set("limit_done", "1")
    else:
        limit = None
        control.wait(["limit_done"], SETUP_WAIT)
    schedule = WatchSchedule.of(_config(ids[0], n))
    drivers = [
        _Driver(replicas[i::DRIVERS], victim, schedule) for i in range(min(DRIVERS, len(replicas)))
    ]
    for driver in drivers:
        driver.thread.start()
    go = threading.Event()

    def ask(replica: _Replica) -> None:
        go.wait()
        deadline = time.monotonic() + QUORUM_TIMEOUT.total_seconds()
        try:
            replica.quorum = replica.coordinator.quorum(JoinRequest(number=0, step=0), deadline)
        except Exception as error:  # counted and reported: a row says what N could not do
            replica.error = f"{type(error).__name__}: {error}"[:300]
            return
        replica.decided_at = time.time()

    askers = [threading.Thread(target=ask, args=(replica,)) for replica in replicas]
    for thread in askers:
        thread.start()  # waiting, as the Manager's quorum worker waits for a request
    control.add("ready", 1)
    control.wait(["go"], SETUP_WAIT)
    asked_at = float(control.get("go"))
    go.set()
    for thread in askers:
        thread.join()
    control.add("decided", 1)
    control.wait(["watch"], SETUP_WAIT)
    before = [sum(r.watch_counts[i] for r in replicas) for i in (0, 1)]
    for driver in drivers:
        driver.watching.set()
    started = time.monotonic()
    control.wait(["kill"], SETUP_WAIT)
    load_seconds = time.monotonic() - started
    after = [sum(r.watch_counts[i] for r in replicas) for i in (0, 1)]
    load = [(a - b) / load_seconds for a, b in zip(after, before, strict=True)]
    if victim in ids:
        for driver in drivers:
            driver.stopped.set()
        control.set("killed_at", repr(time.time()))
    killed_at = float(control.get("killed_at"))
    deadline = time.monotonic() + 60
    others = [r for r in replicas if r.rid != victim and r.quorum is not None]
    while time.monotonic() < deadline and not all(r.learned_at is not None for r in others):
        time.sleep(0.05)  # the drivers record when each replica saw the death
    for driver in drivers:
        driver.done.set()
    for driver in drivers:
        driver.thread.join(10)
    queue.put(
        {
            "quorum_s": [r.decided_at - asked_at for r in replicas if r.decided_at is not None],
            "joined_s": [
                r.quorum_calls_ended[3] - asked_at
                for r in replicas
                if len(r.quorum_calls_ended) > 3
            ],
            "sizes": [len(r.quorum.members) for r in replicas if r.quorum is not None],
            "errors": [r.error for r in replicas if r.error is not None],
            "death_s": [r.learned_at - killed_at for r in others if r.learned_at is not None],
            "missed": len([r for r in others if r.learned_at is None]),
            "load": load,
            "round_requests": sum(r.round_counts[0] + r.link_counts[0] for r in replicas),
            "late_ticks": sum(d.late_ticks for d in drivers),
            "limit": limit,
        }
    )
    for replica in replicas:
        replica.bounded.close()  # its link thread; the plain connections end with the process


def measure_one(port: int, n: int) -> dict[str, Any]:
    """One N: quorum formation, death detection, store load and limit."""
    from torch.distributed import PrefixStore, TCPStore

    from dist_collectives.ft.coordination.store_coordinator import Keys

    client = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    control = PrefixStore(f"scale{n}", client)
    context = mp.get_context("spawn")
    queue = context.Queue()
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
            time.sleep(0.05)  # the processes connect 2N clients and measure the limit
        phase("connected")
        load_before = os.getloadavg()[0]
        asked_at = time.time()
        control.set("go", repr(asked_at))
        try:  # the closer wrote the decision
            control.wait([Keys.decision(0)], QUORUM_TIMEOUT + timedelta(seconds=30))
            decision_s: float | None = time.time() - asked_at
        except Exception:  # none within the replicas' own timeout
            decision_s = None
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
    errors = [e for r in reports for e in r["errors"]]
    joined = [t for r in reports for t in r["joined_s"]]
    return {
        "replicas": n,
        "quorum_s": round(max(quorum), 3) if quorum and not errors else None,
        "quorum_median_s": round(statistics.median(quorum), 3) if quorum else None,
        "quorum_failed": len(errors),
        "quorum_error": errors[0] if errors else None,
        # The last replica's join, and the decision's write (both from the ask).
        "joined_s": round(max(joined), 3) if len(joined) == n else None,
        "decision_s": round(decision_s, 3) if decision_s is not None else None,
        "death_all_s": round(max(death), 3) if death else None,
        "death_median_s": round(statistics.median(death), 3) if death else None,
        "death_missed": sum(r["missed"] for r in reports),
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT.total_seconds(),
        "round_requests_per_replica": round(sum(r["round_requests"] for r in reports) / n, 1),
        "requests_per_s": round(requests),
        "keys_per_s": round(keys),
        "limit_adds_per_s": round(limit["add"]),
        "limit_keys_per_s": round(limit["multi_get"]),
        "late_ticks": sum(r["late_ticks"] for r in reports),
        "drivers": DRIVERS,
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
