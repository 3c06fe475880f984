"""The parts of benchmarks/launch.py about losing a node, on c10d and on etcd.

- ``reform``: K nodes (2 to 4) of one ``--nnodes 1:K`` job, each a launcher process on
  this host (loopback; not network namespaces, so that etcd and the launchers need no
  root), 1 rank each; the last node is SIGKILLed with its worker mid-step, and the time
  from its death to the survivors' round forming and to that round's first step is
  measured, on c10d (the store on node 0) and on etcd (one member). Both with the
  guide's fast re-forming settings (``FAST_REFORM``) and, for K=2, torch's defaults.
- ``rdzv-cost``: N simulated agents (threads, 64 to a process, no workers: 64, 256,
  1,024) joining one round through dist-launch's own rendezvous on c10d (torch's
  dynamic rendezvous below it) and on etcd (dist-launch's rounds on etcd). Each agent
  has its own store client, wrapped to count its operations (on etcd not its lease's
  renewals, which are its heartbeat); the time to the round and the operations per
  agent are printed beside the store's own rate (one client reading one key in a loop).

Both parts are run only when named (``--only reform rdzv-cost``): each takes minutes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

# rdzv-cost: agents (threads) per process, as several nodes' agents share no interpreter.
AGENTS_PER_PROCESS = 64
RUN_SECONDS = 180.0  # one measurement; past it the run counts as failed (or unfinished)
# docs/guides/surviving-node-loss.md's settings: keep-alive 2 s x 4, last call 3 s.
FAST_REFORM = "keep_alive_interval=2,keep_alive_max_attempt=4,last_call_timeout=3"

# rdzv-cost's --rdzv-conf: waits long enough for N agents in one process, and a 30 s
# keep-alive (x 3: etcd's leases live 90 s): on 2 cores the agents' threads renew
# their leases too rarely for torch's 15 s default, and a lapsed lease takes its key.
COST_CONF = "join_timeout=900,read_timeout=300,keep_alive_interval=30"
STEPS = """\
import os, sys, time, torch, torch.distributed as dist
from datetime import timedelta
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
world, rank = dist.get_world_size(), dist.get_rank()
t = torch.ones(1)
while True:
    dist.all_reduce(t)
    print(f"step world={world} rank={rank} at={time.time():.6f}", flush=True)
    if os.path.exists(sys.argv[1]):
        break
    time.sleep(0.05)
dist.destroy_process_group()
"""
STEP = re.compile(r"step world=(\d+) rank=(\d+) at=([0-9.]+)")
ROUND = re.compile(r"round \d+: node \d+ of (\d+),")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def etcd_server(directory: Path) -> Iterator[str]:
    """One etcd member on loopback (packages/dist-launch/tests/etcd_cluster.py)."""
    tests = Path(__file__).resolve().parents[2] / "packages" / "dist-launch" / "tests"
    sys.path.insert(0, str(tests))
    try:
        from etcd_cluster import etcd_cluster

        with etcd_cluster(directory) as cluster:
            yield cluster.endpoints
    finally:
        sys.path.remove(str(tests))


class _Node:
    """One launcher; its output lines with their arrival times, read by a thread."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self.process = subprocess.Popen(
            argv, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.time(), line))

    def first(self, pattern: re.Pattern[str], world: int, after: float) -> float | None:
        """Arrival time of the first line after ``after`` matching with world ``world``."""
        for at, line in list(self.lines):
            found = pattern.search(line)
            if found and int(found[1]) == world and at >= after:
                return at
        return None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def tail(self, count: int = 12) -> str:
        return "".join(line for _, line in self.lines[-count:])


def _reform_once(
    backend: str, endpoint: str, nodes: int, conf: str, scratch: Path, env: dict[str, str]
) -> tuple[float, float] | str:
    """(death to round, death to first step) of one run, or why it failed."""
    finish = scratch / f"finish-{backend}-{nodes}-{time.monotonic_ns()}"
    script = scratch / "steps.py"
    script.write_text(STEPS)
    rdzv_conf = ",".join(filter(None, ["join_timeout=120", conf]))
    flags = [
        "--nnodes", f"1:{nodes}", "--nproc-per-node", "1", "--max-restarts", "3",
        "--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
        "--rdzv-id", f"reform-{time.monotonic_ns()}", "--rdzv-conf", rdzv_conf,
    ]  # fmt: skip
    launched = []
    for index in range(nodes):
        # c10d: node 0 serves the store, named, not left to whichever binds first (the
        # killed last node must not be the store's: c10d does not outlive its store).
        serves = "" if backend != "c10d" else f",is_host={int(index == 0)}"
        argv = [sys.executable, "-m", "dist_launch", *flags[:-1], flags[-1] + serves,
                str(script), str(finish)]  # fmt: skip
        launched.append(_Node(argv, env))
    try:
        deadline = time.monotonic() + RUN_SECONDS
        started = time.time()
        while not all(node.first(STEP, nodes, started) for node in launched):
            if time.monotonic() > deadline or any(n.process.poll() is not None for n in launched):
                return "never stepped together:\n" + launched[0].tail()
            time.sleep(0.1)  # polls the output threads' lists
        launched[-1].kill()  # the last node: not c10d's store
        died = time.time()
        survivor = launched[0]
        while survivor.first(STEP, nodes - 1, died) is None:
            if time.monotonic() > deadline or survivor.process.poll() is not None:
                return "never re-formed:\n" + survivor.tail()
            time.sleep(0.05)
        formed = survivor.first(ROUND, nodes - 1, died)
        stepped = survivor.first(STEP, nodes - 1, died)
        assert stepped is not None
        finish.touch()
        for node in launched[:-1]:
            node.process.wait(timeout=max(deadline - time.monotonic(), 1))
        return (formed or stepped) - died, stepped - died
    except subprocess.TimeoutExpired:
        return "the survivors did not finish"
    finally:
        for node in launched:
            node.kill()


def reform_part(scratch: Path, env: dict[str, str], counts: list[int]) -> dict[str, object]:
    """A node's death to the re-formed round and its first step, c10d against etcd."""
    print("\nre-forming after a lost node: K launchers on this host (loopback), 1 rank each, "
          "--nnodes 1:K; the last node SIGKILLed mid-step; its death to the survivors' "
          "round, and to that round's first all_reduce:")  # fmt: skip
    env = {**env, "LOGLEVEL": "INFO"}
    results: dict[str, object] = {}
    header = f"  {'backend':<7} {'K':>2} {'settings':<16} | {'to round s':>10} {'to step s':>9}"
    print(header)
    with (
        tempfile.TemporaryDirectory(prefix="etcd-", dir=scratch) as data,
        etcd_server(Path(data)) as etcd_endpoint,
    ):
        cases = [(k, "fast", FAST_REFORM) for k in counts] + [(2, "torch defaults", "")]
        for nodes, label, conf in cases:
            for backend in ("c10d", "etcd"):
                endpoint = f"127.0.0.1:{_free_port()}" if backend == "c10d" else etcd_endpoint
                got = _reform_once(backend, endpoint, nodes, conf, scratch, env)
                key = f"{backend} K={nodes} {label}"
                if isinstance(got, str):
                    print(f"  {backend:<7} {nodes:>2} {label:<16} | failed: {got}")
                    results[key] = None
                    continue
                print(f"  {backend:<7} {nodes:>2} {label:<16} | {got[0]:>10.1f} {got[1]:>9.1f}",
                      flush=True)  # fmt: skip
                results[key] = {"to_round_s": round(got[0], 2), "to_step_s": round(got[1], 2)}
    print(f"  fast = --rdzv-conf {FAST_REFORM} (bound 2 x 4 + 3 = 11 s); "
          "torch defaults: 5 x 3 + 30 = 45 s")  # fmt: skip
    return {"reform_after_loss": results}


# -- the cost of one round --------------------------------------------------------------


def _counting_store(inner: Any) -> Any:
    """``inner`` (a torch Store) wrapped to count every operation."""
    from torch.distributed import Store

    class CountingStore(Store):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0
            self.kinds: dict[str, int] = {}

        def _count(self, kind: str) -> None:
            self.ops += 1
            self.kinds[kind] = self.kinds.get(kind, 0) + 1

        def set(self, key: str, value: Any) -> None:
            self._count("set")
            inner.set(key, value)

        def get(self, key: str) -> bytes:
            self._count("get")
            return bytes(inner.get(key))

        def add(self, key: str, amount: int) -> int:
            self._count("add")
            return int(inner.add(key, amount))

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            self._count("compare_set")
            return bytes(inner.compare_set(key, expected, desired))

        def check(self, keys: list[str]) -> bool:
            self._count("check")
            return bool(inner.check(keys))

        def multi_get(self, keys: list[str]) -> list[bytes]:
            self._count("multi_get")
            return [bytes(v) for v in inner.multi_get(keys)]

        def multi_set(self, keys: list[str], values: list[Any]) -> None:
            self._count("multi_set")
            inner.multi_set(keys, values)

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            self._count("wait")
            if timeout is None:
                inner.wait(keys)
            else:
                inner.wait(keys, timeout)

        def delete_key(self, key: str) -> bool:
            self._count("delete_key")
            return bool(inner.delete_key(key))

        def num_keys(self) -> int:
            self._count("num_keys")
            return int(inner.num_keys())

    return CountingStore()


def _plan(backend: str, endpoint: str, agents: int, run_id: str) -> Any:
    from dist_launch.cli import build_parser
    from dist_launch.plan.build import build_plan

    argv = ["--nnodes", str(agents), "--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id, "--rdzv-conf", COST_CONF,
            "--local-addr", "127.0.0.1", "--no-python", "true"]  # fmt: skip
    return build_plan(vars(build_parser().parse_args(argv)), {})


def _c10d_agent(plan: Any, host: str, port: int) -> tuple[Any, Any]:
    """(dist-launch's rendezvous, its counting store) of one simulated c10d agent."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        create_handler,
    )

    from dist_launch.rendezvous.c10d import C10dRendezvous

    client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=300))
    store = _counting_store(client)
    params = RendezvousParameters(
        backend="c10d", endpoint=f"{host}:{port}", run_id=plan.rdzv_id,
        min_nodes=plan.min_nodes, max_nodes=plan.max_nodes, local_addr="127.0.0.1",
        **plan.rdzv_conf,
    )  # fmt: skip
    handler = create_handler(store, C10dRendezvousBackend(store, plan.rdzv_id), params)
    return C10dRendezvous(plan, handler), store


def _etcd_agent(plan: Any) -> tuple[Any, Any]:
    """(dist-launch's rendezvous, its counting gateway) of one simulated etcd agent."""
    from dist_launch.rendezvous import etcd
    from dist_launch.rendezvous.etcd_gateway import EtcdGateway

    class CountingGateway(EtcdGateway):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.ops = 0
            self.kinds: dict[str, int] = {}

        def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
            kind = path.rsplit("/", 1)[-1]
            # The lease's renewals are the node's heartbeat, one per period whatever
            # the round does: counted apart (as torch's beats are stopped on c10d).
            self.ops += kind != "keepalive"
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            return super().call(path, body)

        def watch(self, prefix: bytes, start_revision: int, seconds: float) -> Any:
            self.ops += 1
            self.kinds["watch"] = self.kinds.get("watch", 0) + 1
            return super().watch(prefix, start_revision, seconds)

    made: list[CountingGateway] = []

    def counting(*args: Any, **kwargs: Any) -> CountingGateway:
        gateway = CountingGateway(*args, **kwargs)
        made.append(gateway)
        return gateway

    with _patched(etcd, "EtcdGateway", counting):
        rendezvous = etcd.connect_etcd(plan)
    return rendezvous, made[0]


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    with _PATCH_LOCK:
        saved = getattr(module, name)
        setattr(module, name, value)
        try:
            yield
        finally:
            setattr(module, name, saved)


def _one_round(backend: str, agents: int, endpoint: str, run_id: str, nodes: int) -> dict[str, Any]:
    """``agents`` threads joining one round of ``nodes``: how long, each one's operations.

    Returns ``{"joined", "seconds", "ops", "kinds", "error"}``: ``joined`` below
    ``agents`` when the round did not form within :data:`RUN_SECONDS` (the counts are
    then those made so far).
    """
    plan = _plan(backend, endpoint, nodes, run_id)
    host, _, port = endpoint.rpartition(":")
    counters: list[Any] = []
    errors: list[str] = []
    joined: list[int] = []
    lock = threading.Lock()

    def agent() -> None:
        try:
            if backend == "c10d":
                made, counter = _c10d_agent(plan, host, int(port))
            else:
                made, counter = _etcd_agent(plan)
            with lock:
                counters.append(counter)
            made.next_round()
            # The round is what is measured: neither torch's nor the launcher's beats.
            made.handler._stop_heartbeats()
            made._stop_heartbeat()
            with lock:
                joined.append(1)
        except Exception as error:  # any agent's failure fails the point
            with lock:
                errors.append(f"{type(error).__name__}: {error}")

    started = time.perf_counter()
    threads = [threading.Thread(target=agent, daemon=True) for _ in range(agents)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max(RUN_SECONDS - (time.perf_counter() - started), 0.0))
    took = time.perf_counter() - started
    kinds: dict[str, int] = {}
    with lock:
        for counter in counters:
            for kind, count in counter.kinds.items():
                kinds[kind] = kinds.get(kind, 0) + count
        ops = [int(counter.ops) for counter in counters]
        return {
            "joined": len(joined), "seconds": took, "ops": ops, "kinds": kinds,
            "error": errors[0] if errors else None,
        }  # fmt: skip


def _round_in_processes(backend: str, agents: int, endpoint: str) -> dict[str, Any] | str:
    """:func:`_one_round` over processes of :data:`AGENTS_PER_PROCESS` agents at most.

    Thousands of threads in one process spent the 2 cores on its interpreter lock (a
    lease's renewal waited longer than its 15 s); separate processes, as nodes are,
    do not share one. Each process imports, says it is ready, and starts its agents
    when every process is (a line on its stdin): the round's time is from then.
    Threads left at a timeout die with their process.
    """
    run_id = f"cost{agents}-{time.monotonic_ns()}"
    shares = [
        min(AGENTS_PER_PROCESS, agents - first) for first in range(0, agents, AGENTS_PER_PROCESS)
    ]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    argv = [sys.executable, __file__, backend, endpoint, run_id, str(agents)]
    procs = [
        subprocess.Popen([*argv, str(share)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
        for share in shares
    ]  # fmt: skip
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdin is not None
            if proc.stdout.readline().strip() != "ready":
                return f"exit {proc.wait(60)}: {proc.stderr.read()[-500:] if proc.stderr else ''}"
        started = time.perf_counter()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        points = []
        for proc in procs:
            out, err = proc.communicate(timeout=RUN_SECONDS + 120)
            lines = out.strip().splitlines()
            if not lines:
                return f"exit {proc.returncode}: {err.strip()[-500:]}"
            points.append(json.loads(lines[-1]))
    except subprocess.TimeoutExpired:
        return f"the processes did not end within {RUN_SECONDS + 120:g} s"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    kinds: dict[str, int] = {}
    for point in points:
        for kind, count in point["kinds"].items():
            kinds[kind] = kinds.get(kind, 0) + count
    errors = [point["error"] for point in points if point["error"]]
    return {
        "joined": sum(point["joined"] for point in points),
        "seconds": max(point["done_at"] for point in points) - started,
        "ops": [count for point in points for count in point["ops"]],
        "kinds": kinds,
        "error": errors[0] if errors else None,
        "processes": len(procs),
    }


def _store_rate(backend: str, endpoint: str) -> float:
    """Operations a second one client gets from the store (a small key, read in a loop)."""
    host, _, port = endpoint.rpartition(":")
    if backend == "c10d":
        from torch.distributed import TCPStore

        client = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
        client.set("rate", "x")

        def read() -> None:
            client.get("rate")
    else:
        from dist_launch.rendezvous.etcd_gateway import EtcdGateway

        gateway = EtcdGateway([(host, int(port))])
        gateway.put(b"rate", b"x")

        def read() -> None:
            gateway.get(b"rate")

    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < 1.0:
        read()
        count += 1
    return count / (time.perf_counter() - started)


def rdzv_cost_part(scratch: Path, counts: list[int]) -> dict[str, object]:
    """N simulated agents joining one round, c10d and etcd: time and store operations."""
    from torch.distributed import TCPStore

    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    print("\nround cost: N simulated agents (threads, 64 to a process, no workers) joining one "
          "round through dist-launch's rendezvous; each agent's store operations "
          "counted:")  # fmt: skip
    header = (f"  {'backend':<7} {'N':>5} | {'round s':>8} {'ops/agent':>9} {'max':>6} "
              f"{'total ops':>9} | {'store ops/s':>11} {'round at that rate s':>20}")  # fmt: skip
    print(header)
    results: dict[str, object] = {}
    with (
        tempfile.TemporaryDirectory(prefix="etcd-", dir=scratch) as data,
        etcd_server(Path(data)) as etcd_endpoint,
    ):
        port = _free_port()
        server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=300))  # fmt: skip
        endpoints = {"c10d": f"127.0.0.1:{port}", "etcd": etcd_endpoint.split(",")[0]}
        for backend in ("c10d", "etcd"):
            rate = _store_rate(backend, endpoints[backend])
            for agents in counts:
                got = _round_in_processes(backend, agents, endpoints[backend])
                key = f"{backend} N={agents}"
                if isinstance(got, str) or got["error"]:
                    why = got if isinstance(got, str) else got["error"]
                    print(f"  {backend:<7} {agents:>5} | failed: {why}", flush=True)
                    results[key] = None
                    continue
                formed = got["joined"] == agents
                ops, kinds = got["ops"], got["kinds"]
                total = sum(ops)
                by_kind = ", ".join(f"{k} {v / agents:.1f}" for k, v in sorted(kinds.items()))
                took = (
                    f"{got['seconds']:>8.1f}" if formed else f"{'>' + format(RUN_SECONDS, 'g'):>8}"
                )
                late = (
                    ""
                    if formed
                    else (
                        f"\n          only {got['joined']} of {agents} agents had their round "
                        f"after {RUN_SECONDS:g} s: the counts are those made so far"
                    )
                )
                print(f"  {backend:<7} {agents:>5} | {took} {total / agents:>9.1f} "
                      f"{max(ops, default=0):>6} {total:>9} | {rate:>11.0f} "
                      f"{total / rate:>20.2f}\n          per agent: {by_kind}{late}",
                      flush=True)  # fmt: skip
                results[key] = {
                    "round_s": round(got["seconds"], 2) if formed else None,
                    "joined": got["joined"],
                    "ops_per_agent": round(total / agents, 1),
                    "max_ops": max(ops, default=0),
                    "store_ops_per_s": round(rate),
                    "ops_per_agent_by_kind": {k: round(v / agents, 1) for k, v in kinds.items()},
                }
        del server
    print("  round at that rate: the total operations at one client's rate, i.e. the part of "
          "the round's time the store's own speed explains")  # fmt: skip
    return {"round_cost": results}


if __name__ == "__main__":
    # A share of one rdzv-cost point: python survive.py BACKEND ENDPOINT RUN_ID NODES
    # AGENTS; says "ready", starts at "go" on stdin, prints JSON (its "done_at" on the
    # parent's clock: perf_counter is the machine's monotonic clock).
    import logging

    logging.disable(logging.WARNING)  # torch's warnings of slow heartbeats, per agent
    print("ready", flush=True)
    sys.stdin.readline()
    point = _one_round(sys.argv[1], int(sys.argv[5]), sys.argv[2], sys.argv[3], int(sys.argv[4]))
    point["done_at"] = time.perf_counter()
    print(json.dumps(point), flush=True)
    os._exit(0)  # agents still waiting at a timeout end with the process
