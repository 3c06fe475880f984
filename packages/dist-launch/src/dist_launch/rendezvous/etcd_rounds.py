"""How the rounds of a job on etcd form, at a bounded number of etcd requests per node.

torch's dynamic rendezvous keeps a job's whole rendezvous state in one value that
every node rewrites by compare-and-set: N nodes joining at once retry one another's
writes, so a node's cost grows with N (23.6 requests per node at 64 nodes, growing;
see the benchmarks page). Here a node's join is its own key, and no node rewrites
another's:

1. one read of the job (``closed``, the last formed round ``L``): the node joins
   round ``L + 1``;
2. one write of its key ``<round>/join/<id>`` (its address, a free port, its worker
   count), bound to its lease, so a node that dies before the round forms drops out;
3. one read of the round (how many joined, its last call, whether it formed);
4. when ``MAX`` nodes joined, one create-only write of the round's ``formed`` record
   (the first ``MAX`` joined, in the order they joined), after one read of their keys;
   when ``MIN`` did, a create-only write of the round's last call (when it ends);
5. a watch of the round's ``round/`` keys (``formed``, ``last-call``, ``closed``) until
   the round forms: one request per :data:`WATCH_SECONDS` of waiting (a member that
   goes out of reach meanwhile ends the watch within seconds; one read follows). Once its last
   call ends, the node that wrote it closes the round as in 4; the others wait
   :data:`CLOSE_GRACE_SECONDS` longer before they try it too.

A node the ``formed`` record leaves out (it came after ``MAX``, or too late) joins the
next round, where the nodes of the formed one see it waiting. Nodes waiting to join
are those with a key in the round after the current one.

Keys, under ``<prefix>rounds/``: ``job/closed``, ``job/last``,
``<round>/join/<id>``, ``<round>/round/{formed,last-call,closed}``.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from torch.distributed import (  # type: ignore[attr-defined]  # public, not re-exported in the stubs
    PrefixStore,
    Store,
)
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from dist_core.ports import get_unused_port
from dist_launch.rendezvous.etcd_gateway import EtcdError, EtcdGateway, KeyValue, Range
from dist_launch.rendezvous.etcd_lease import NodeLease

logger = logging.getLogger(__name__)

# How long one watch of a round waits before it is made again (each one is a request);
# a member that goes out of reach ends it within seconds (etcd_http.PROBES).
WATCH_SECONDS = 30.0
# How much later than the node that wrote a round's last call the others close it.
CLOSE_GRACE_SECONDS = 2.0
# The pause before a watch is tried again when etcd refused or dropped one.
WATCH_RETRY_SECONDS = 0.5


@dataclass(frozen=True)
class Joiner:
    """One node's key in a round: who it is and what the round needs from it."""

    node: str  # unique per join
    addr: str
    port: int  # a free port of its host: the workers' store's, if it is rank 0
    nproc: int

    def encode(self) -> bytes:
        """The key's value."""
        return json.dumps([self.node, self.addr, self.port, self.nproc]).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Joiner:
        """A joiner from its key's value."""
        node, addr, port, nproc = json.loads(raw)
        return cls(str(node), str(addr), int(port), int(nproc))


@dataclass(frozen=True)
class FormedRound:
    """A formed round, as :meth:`EtcdRounds.next_rendezvous` returns it.

    The fields torch's ``RendezvousInfo`` has (``store``, ``rank``, ``world_size``,
    ``bootstrap_store_info``), and the round's number and each node's worker count.
    """

    store: Store
    rank: int
    world_size: int
    bootstrap_store_info: RendezvousStoreInfo
    round: int
    nprocs: list[int] = field(default_factory=list)


class EtcdRounds:
    """The rounds of one job on etcd: join, last call, closing, nodes waiting.

    Offers what :class:`~dist_launch.rendezvous.c10d.C10dRendezvous` calls on torch's
    handler: ``next_rendezvous``, ``num_nodes_waiting``, ``is_closed``, ``set_closed``,
    ``shutdown``. Reads no environment variable.

    Args:
        gateway: The etcd client.
        prefix: The job's keys (``dist-launch/<rdzv-id>/``).
        store: The job's store on etcd; each round's store is a prefix of it.
        nodes: ``(MIN, MAX)`` nodes of a round.
        timeouts: ``(join_timeout, last_call_timeout)`` in seconds.
        addr: The address this node's peers reach it at.
        nproc: This node's worker count.
        lease: This node's lease (a lapsed one is replaced at the join's write).
    """

    def __init__(
        self,
        gateway: EtcdGateway,
        prefix: str,
        store: Store,
        nodes: tuple[int, int],
        timeouts: tuple[float, float],
        addr: str,
        nproc: int,
        lease: NodeLease | None = None,
    ) -> None:
        self._gateway = gateway
        self._root = prefix + "rounds/"
        self._store = store
        self.min_nodes, self.max_nodes = nodes
        self.join_timeout, self.last_call_timeout = timeouts
        self._addr = addr
        self._nproc = nproc
        self.lease = lease
        self.round: int | None = None  # the round this node is in

    # -- keys -----------------------------------------------------------------------

    def _key(self, *parts: object) -> bytes:
        return (self._root + "/".join(str(part) for part in parts)).encode()

    def _round_key(self, number: int, *parts: object) -> bytes:
        return self._key(f"{number:010d}", *parts)

    # -- the job --------------------------------------------------------------------

    def _job(self) -> tuple[bool, int]:
        """Whether the job was closed, and its last formed round (-1: none): one read."""
        found, _ = self._gateway.read([Range(self._key("job", ""), prefix=True)])
        keys = dict(found[0].keys)
        last = keys.get(self._key("job", "last"))
        return self._key("job", "closed") in keys, int(last.value) if last else -1

    def is_closed(self) -> bool:
        """True once a node closed the job (one read)."""
        return self._gateway.get(self._key("job", "closed")) is not None

    def set_closed(self) -> None:
        """Closes the job: no round forms any more; nodes waiting for one are told."""
        self._gateway.put(self._key("job", "closed"), b"1")
        _, last = self._job()
        self._gateway.put(self._round_key(last + 1, "round", "closed"), b"1")

    def shutdown(self) -> bool:
        """The job ended on this node: closes it, as torch's handler does."""
        self.set_closed()
        return True

    def num_nodes_waiting(self) -> int:
        """Nodes that joined the round after this node's (one read)."""
        if self.round is None:
            return 0
        found, _ = self._gateway.read(
            [Range(self._round_key(self.round + 1, "join", ""), prefix=True, count_only=True)]
        )
        return found[0].count

    def _stop_heartbeats(self) -> None:
        """Nothing: this node's lease is its heartbeat (the benchmark calls it)."""

    def leave(self) -> None:
        """Takes this node out of its round's next one (its join keys go with its lease)."""

    # -- a round --------------------------------------------------------------------

    def next_rendezvous(self) -> FormedRound:
        """Joins the next round; returns it once formed.

        Raises:
            RendezvousClosedError: A node closed the job.
            RendezvousTimeoutError: The round did not form within ``join_timeout``.
            EtcdError: etcd did not answer.
        """
        deadline = time.monotonic() + self.join_timeout
        closed, last = self._job()
        number = last + 1
        if self.round is not None:
            number = max(number, self.round + 1)
        while True:
            if closed:
                raise RendezvousClosedError()
            me = Joiner(uuid.uuid4().hex, self._addr, get_unused_port(0), self._nproc)
            formed = self._join(number, me, deadline)
            if formed is None:
                closed = True
                continue
            nodes = [Joiner.decode(raw) for raw in json.loads(formed)["nodes"]]
            ids = [node.node for node in nodes]
            if me.node not in ids:  # came too late for this round: the next one
                self._gateway.delete(self._round_key(number, "join", me.node))
                number += 1
                continue
            self.round = number
            rank = ids.index(me.node)
            master = nodes[0]
            logger.debug("etcd round %d formed: node %d of %d", number, rank, len(nodes))
            return FormedRound(
                store=PrefixStore(f"round.{number}", self._store),
                rank=rank,
                world_size=len(nodes),
                bootstrap_store_info=RendezvousStoreInfo(master.addr, master.port),
                round=number,
                nprocs=[node.nproc for node in nodes],
            )

    def _join(self, number: int, me: Joiner, deadline: float) -> str | None:
        """Joins round ``number``; its formed record once it formed, None if the job closed."""
        key = self._round_key(number, "join", me.node)
        if self.lease is None:  # rounds joined without a rendezvous hold no lease
            self._gateway.put(key, me.encode())
        else:
            self.lease.put(key, me.encode())
        joined, round_keys, revision = self._read_round(number)
        formed = round_keys.get(b"formed")
        if formed is not None:
            return formed.value.decode()
        last_call: float | None = None
        first_to_close = False
        if joined >= self.max_nodes:
            made = self._close_round(number)
            if made is not None:
                return made
        elif joined >= self.min_nodes:
            if b"last-call" in round_keys:
                last_call = float(round_keys[b"last-call"].value)
            else:
                ends = time.time() + self.last_call_timeout
                done, now = self._gateway.create(
                    self._round_key(number, "round", "last-call"), repr(ends).encode()
                )
                first_to_close = done
                last_call = ends if done or now is None else float(now.value)
        return self._wait(number, me, (revision, deadline), (last_call, first_to_close))

    def _read_round(self, number: int) -> tuple[int, dict[bytes, KeyValue], int]:
        """How many joined round ``number``, its ``round/`` keys, at which revision: one read."""
        found, revision = self._gateway.read(
            [
                Range(self._round_key(number, "join", ""), prefix=True, count_only=True),
                Range(self._round_key(number, "round", ""), prefix=True),
            ]
        )
        skip = len(self._round_key(number, "round", ""))
        keys = {key[skip:]: kv for key, kv in found[1].keys}
        if b"closed" in keys:
            raise RendezvousClosedError()
        return found[0].count, keys, revision

    def _close_round(self, number: int) -> str | None:
        """Forms round ``number`` of the nodes that joined it, if ``MIN`` did; its record."""
        found, _ = self._gateway.read(
            [Range(self._round_key(number, "join", ""), prefix=True, by_creation=True)]
        )
        joined = [Joiner.decode(kv.value) for _, kv in found[0].keys][: self.max_nodes]
        if len(joined) < self.min_nodes:
            return None
        record = json.dumps({"nodes": [node.encode().decode() for node in joined]}).encode()
        last = {self._key("job", "last"): b"%d" % number}
        _, now = self._gateway.create(self._round_key(number, "round", "formed"), record, last)
        return None if now is None else now.value.decode()

    def _wait(
        self,
        number: int,
        me: Joiner,
        since: tuple[int, float],
        last_call: tuple[float | None, bool],
    ) -> str | None:
        """Watches round ``number`` until it forms (its record), or the job closes (None).

        Args:
            number: The round.
            me: This node's join.
            since: The revision the round was read at, and the join's deadline.
            last_call: When the round's last call ends (None: not begun), and whether
                this node began it.

        Raises:
            RendezvousClosedError: A node closed the job (seen on a read).
            RendezvousTimeoutError: Not formed within ``join_timeout``.
        """
        revision, deadline = since
        ends, first_to_close = last_call
        prefix = self._round_key(number, "round", "")
        while True:
            now = time.monotonic()
            if now >= deadline:
                self._gateway.delete(self._round_key(number, "join", me.node))
                raise RendezvousTimeoutError(
                    f"round {number} did not form within join_timeout={self.join_timeout:g} s"
                )
            wait = min(WATCH_SECONDS, deadline - now)
            if ends is not None:
                close_at = ends + (0.0 if first_to_close else CLOSE_GRACE_SECONDS)
                if time.time() >= close_at:
                    made = self._close_round(number)
                    if made is not None:
                        return made
                    ends = None  # fewer than MIN left: wait for more, or the timeout
                else:
                    wait = min(wait, close_at - time.time())
            try:
                changes = self._gateway.watch(prefix, revision + 1, max(wait, 0.01))
            except EtcdError as error:
                logger.debug("etcd: watch of round %d: %s", number, error)
                time.sleep(min(WATCH_RETRY_SECONDS, max(deadline - time.monotonic(), 0.0)))
                _, keys, revision = self._read_round(number)
                changes = [(prefix + key, value) for key, value in keys.items()]
            for key, value in changes:
                if value is None:
                    continue
                name = key[len(prefix) :]
                revision = max(revision, value.mod_revision)
                if name == b"formed":
                    return value.value.decode()
                if name == b"closed":
                    return None
                if name == b"last-call" and ends is None:
                    ends = float(value.value)
