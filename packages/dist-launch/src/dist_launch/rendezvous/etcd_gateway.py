"""A client of etcd's v3 API through etcd's own JSON gateway, with the standard library only.

Every etcd server since 3.3 answers its v3 API as JSON over HTTP on the client port
(``POST /v3/kv/range``, ``/v3/kv/txn``, ``/v3/lease/grant``, ...; keys and values in
base64, 64-bit numbers as strings). Speaking it with :mod:`http.client` needs no gRPC, no
protobuf and no generated code, so no protobuf release can break the launcher; see the
README ("Several nodes") for why no etcd library was chosen.

:class:`EtcdGateway` holds the cluster's endpoints and moves to the next one when one
does not answer, so a job outlives any one etcd member; a member that does not even
accept a connection (cut off) is passed over within a second (:mod:`.etcd_http`). It
knows only the few calls the rendezvous needs: read one key, count a prefix, read
several ranges at one revision, write, create-only and compare-and-set writes, delete,
leases, and a watch bounded in time.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

from dist_launch.rendezvous import etcd_http

logger = logging.getLogger(__name__)

# etcd's client port, as torchrun's etcd backends default it.
DEFAULT_ETCD_PORT = 2379
# The pauses between two rounds of tries while no member answers.
FIRST_RETRY_SECONDS = 0.1
LONGEST_RETRY_SECONDS = 1.0
# etcd's message when a request names a lease it no longer holds (rpctypes.ErrLeaseNotFound).
LEASE_NOT_FOUND = "requested lease not found"


class EtcdError(ConnectionError):
    """etcd did not answer, or refused a request; says which endpoints and why."""


class LeaseNotFoundError(EtcdError):
    """etcd no longer holds the lease a request named: it ended, or was revoked."""


@dataclass(frozen=True)
class EtcdTls:
    """TLS files of ``--rdzv-conf`` (``cacert``, ``cert``, ``key``); None: not used."""

    cacert: str | None = None
    cert: str | None = None
    key: str | None = None


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd holds it: its value and the revision that last wrote it."""

    value: bytes
    mod_revision: int


@dataclass(frozen=True)
class Range:
    """One range of a :meth:`EtcdGateway.read`: a key, or every key under a prefix.

    Attributes:
        key: The key, or the prefix when ``prefix``.
        prefix: Every key that starts with ``key``.
        count_only: Only how many keys there are.
        by_creation: Keys in the order they were created (else by key).
    """

    key: bytes
    prefix: bool = False
    count_only: bool = False
    by_creation: bool = False

    def request(self) -> dict[str, Any]:
        """The range's ``request_range`` body."""
        body: dict[str, Any] = {"key": _b64(self.key)}
        if self.prefix:
            body["range_end"] = _b64(_prefix_end(self.key))
        if self.count_only:
            body["count_only"] = True
        if self.by_creation:
            body |= {"sort_order": "ASCEND", "sort_target": "CREATE"}
        return body


@dataclass(frozen=True)
class Ranged:
    """What one :class:`Range` found: its keys in order (none when count_only), the count."""

    keys: list[tuple[bytes, KeyValue]]
    count: int


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


def _has_events(line: bytes) -> bool:
    """Whether one line of a watch's stream ends the watch (changes, or its end)."""
    result = json.loads(line or b"{}").get("result", {})
    return bool(result.get("events") or result.get("canceled") or result.get("compact_revision"))


def _key_value(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(base64.b64decode(raw.get("value", "")), int(raw.get("mod_revision", 0)))


class EtcdGateway:
    """Calls etcd's v3 API on the first endpoint that answers.

    Args:
        endpoints: ``(host, port)`` of each etcd member to try, in order.
        protocol: ``http`` or ``https``.
        tls: Certificates for ``https`` (a CA to trust, a client certificate and key).
        timeout: Seconds one request may take on one endpoint.
        retry_seconds: How long a call tries again while no member answers.
    """

    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        protocol: str = "http",
        tls: EtcdTls | None = None,
        timeout: float = 5.0,
        retry_seconds: float = 10.0,
    ) -> None:
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint")
        if protocol not in ("http", "https"):
            raise ValueError(f"protocol={protocol!r}: etcd is reached over http or https")
        self.endpoints = list(endpoints)
        self.protocol = protocol
        self.timeout = timeout
        self.retry_seconds = retry_seconds
        self._context = self._tls_context(tls or EtcdTls()) if protocol == "https" else None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified as calls end
        self._calls = 0  # calls under way
        self._stopped = False
        self._current = 0  # the endpoint that answered last
        self._answered = False  # whether any member ever answered this client

    @staticmethod
    def _tls_context(tls: EtcdTls) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=tls.cacert)
        if tls.cert:
            context.load_cert_chain(tls.cert, tls.key)
        return context

    def _url(self, index: int, path: str) -> str:
        host, port = self.endpoints[index]
        host = f"[{host}]" if ":" in host else host
        return f"{self.protocol}://{host}:{port}/v3/{path}"

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POSTs ``body`` to ``/v3/<path>`` on the first member that answers.

        Tries every member in turn; once any member has answered this client, tries
        them again (0.1 s apart, doubling up to 1 s) until ``retry_seconds`` have
        passed: while a cluster elects a new leader (about a second after the old one
        died) every member refuses, and a rendezvous step that fails ends the node's
        part in the job. A cluster never reached is more likely misnamed: that fails
        at once.

        A write whose answer was lost (a timeout) may have been applied and is tried
        again: a compare-and-set then fails and its caller reads the key anew; a
        counter may count once too often, never too rarely.

        Raises:
            EtcdError: No endpoint answered in time (each one's error is named), or
                etcd refused the request (its message).
        """
        data = json.dumps(body).encode()
        deadline = time.monotonic() + self.retry_seconds
        pause = FIRST_RETRY_SECONDS
        with self._lock:
            self._calls += 1
        try:
            while True:
                if self._stopped:
                    raise EtcdError(f"{path} not tried: this node stopped calling etcd")
                answer, errors = self._try_each(path, data)
                if answer is not None:
                    self._answered = True
                    return answer
                left = deadline - time.monotonic()
                if left <= 0 or not self._answered or self._stopped:
                    raise EtcdError("no etcd endpoint answered: " + "; ".join(errors))
                time.sleep(min(pause, left))
                pause = min(pause * 2, LONGEST_RETRY_SECONDS)
        finally:
            with self._lock:
                self._calls -= 1
                self._idle.notify_all()

    def stop(self, wait: float) -> bool:
        """Makes every later call fail at once, and ends the retries of those under way.

        Args:
            wait: Seconds to wait for the calls under way to end (a request already
                sent ends within :attr:`timeout`).

        Returns:
            Whether no call was left under way.
        """
        with self._lock:
            self._stopped = True
            return self._idle.wait_for(lambda: self._calls == 0, wait)

    def _try_each(self, path: str, data: bytes) -> tuple[dict[str, Any] | None, list[str]]:
        """One try on every member, from the one that answered last; each one's error."""
        with self._lock:
            first = self._current
        errors: list[str] = []
        for step in range(len(self.endpoints)):
            index = (first + step) % len(self.endpoints)
            host, port = self.endpoints[index]
            try:
                status, raw = etcd_http.post(
                    host, port, f"/v3/{path}", data, timeout=self.timeout, context=self._context
                )
                answer: dict[str, Any] = json.loads(raw or b"{}") if status < 400 else {}
            except (OSError, ValueError, http.client.HTTPException) as error:
                # Timeouts (a member cut off: see etcd_http), refusals, resets, bad JSON.
                errors.append(f"{self._url(index, path)}: {error}")
                continue
            if status >= 500:
                # A member without a leader or cut off from its quorum (503, 504):
                # another member may have one.
                errors.append(f"{self._url(index, path)}: {raw.decode(errors='replace').strip()}")
                continue
            if status >= 400:
                detail = raw.decode(errors="replace").strip()
                refused = LeaseNotFoundError if LEASE_NOT_FOUND in detail else EtcdError
                raise refused(f"etcd refused {path} ({status}): {detail}")
            if index != first:
                logger.info("etcd: %s answers now", self._url(index, ""))
                with self._lock:
                    self._current = index
            return answer, errors
        return None, errors

    # -- keys -------------------------------------------------------------------------

    def get(self, key: bytes) -> KeyValue | None:
        """The key's value and revision, or None when it is not set."""
        kvs = self.call("kv/range", {"key": _b64(key)}).get("kvs", [])
        return _key_value(kvs[0]) if kvs else None

    def get_prefix(self, prefix: bytes) -> dict[bytes, bytes]:
        """Every key that starts with ``prefix`` and its value, in one request."""
        body = {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))}
        kvs = self.call("kv/range", body).get("kvs", [])
        return {base64.b64decode(kv.get("key", "")): _key_value(kv).value for kv in kvs}

    def count_prefix(self, prefix: bytes) -> int:
        """How many keys start with ``prefix``."""
        body = {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix)), "count_only": True}
        return int(self.call("kv/range", body).get("count", 0))

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        """Sets the key (bound to ``lease`` when not 0: it goes when the lease ends)."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        self.call("kv/put", body)

    def replace(self, key: bytes, value: bytes, mod_revision: int) -> tuple[bool, KeyValue | None]:
        """Sets the key only if it was last written at ``mod_revision`` (0: is not set).

        Returns:
            Whether it was set, and the key as it is now (after the write, or as another
            writer left it).
        """
        if not mod_revision:
            return self.create(key, value)
        compare = {"target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}
        return self._write_if(key, compare, {key: value})

    def read(self, ranges: list[Range]) -> tuple[list[Ranged], int]:
        """Several ranges read at one revision, in one request; what each found, the revision."""
        requests = [{"request_range": one.request()} for one in ranges]
        answer = self.call("kv/txn", {"compare": [], "success": requests, "failure": []})
        found: list[Ranged] = []
        for response in answer.get("responses", []):
            ranged = response.get("response_range", {})
            kvs = [
                (base64.b64decode(kv.get("key", "")), _key_value(kv))
                for kv in ranged.get("kvs", [])
            ]
            found.append(Ranged(kvs, int(ranged.get("count", 0))))
        return found, int(answer.get("header", {}).get("revision", 0))

    def create(
        self, key: bytes, value: bytes, also: dict[bytes, bytes] | None = None
    ) -> tuple[bool, KeyValue | None]:
        """Sets the key only if it is not set, with the keys of ``also`` in the same write.

        Returns:
            Whether this call set it, and the key as it is now.
        """
        compare = {"target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        return self._write_if(key, compare, {key: value, **(also or {})})

    def _write_if(
        self, key: bytes, compare: dict[str, str], puts: dict[bytes, bytes]
    ) -> tuple[bool, KeyValue | None]:
        """Writes ``puts`` at once if ``key`` meets ``compare``; whether it did, and the key now."""
        read = {"request_range": {"key": _b64(key)}}
        writes = [{"request_put": {"key": _b64(k), "value": _b64(v)}} for k, v in puts.items()]
        answer = self.call(
            "kv/txn",
            {"compare": [{"key": _b64(key), **compare}], "success": [*writes, read],
             "failure": [read]},
        )  # fmt: skip
        ranged = answer.get("responses", [])[-1].get("response_range", {}).get("kvs", [])
        return bool(answer.get("succeeded", False)), (_key_value(ranged[0]) if ranged else None)

    def watch(
        self, prefix: bytes, start_revision: int, seconds: float
    ) -> list[tuple[bytes, KeyValue | None]]:
        """The changes under ``prefix`` from ``start_revision`` on, waiting up to ``seconds``.

        One request to the member that answered last: a watch that ends at its first
        batch of changes, or after ``seconds`` with none (``[]``).

        Returns:
            ``(key, its new value)`` of each change, None for a deletion.

        Raises:
            EtcdError: The member did not answer or refused the watch (history
                compacted): read the keys again instead.
        """
        body = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(_prefix_end(prefix)),
                "start_revision": str(start_revision),
            }
        }
        with self._lock:
            if self._stopped:
                raise EtcdError("watch not tried: this node stopped calling etcd")
            self._calls += 1
            index = self._current
        host, port = self.endpoints[index]
        try:
            lines = etcd_http.post_lines(
                host, port, "/v3/watch", json.dumps(body).encode(), seconds=seconds,
                context=self._context, enough=_has_events,
            )  # fmt: skip
        except (OSError, ValueError, http.client.HTTPException) as error:
            raise EtcdError(f"{self._url(index, 'watch')}: {error}") from error
        finally:
            with self._lock:
                self._calls -= 1
                self._idle.notify_all()
        changes: list[tuple[bytes, KeyValue | None]] = []
        for line in lines:
            result = json.loads(line).get("result", {})
            if result.get("canceled") or result.get("compact_revision"):
                raise EtcdError(f"{self._url(index, 'watch')}: watch ended: {line[:200]!r}")
            for event in result.get("events", []):
                kv = event.get("kv", {})
                gone = event.get("type") == "DELETE"
                changes.append(
                    (base64.b64decode(kv.get("key", "")), None if gone else _key_value(kv))
                )
        return changes

    def delete(self, key: bytes) -> None:
        """Removes the key (nothing when it is not set)."""
        self.call("kv/deleterange", {"key": _b64(key)})

    def delete_prefix(self, prefix: bytes) -> None:
        """Removes every key that starts with ``prefix``."""
        self.call("kv/deleterange", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))})

    # -- leases -----------------------------------------------------------------------

    def grant_lease(self, ttl: int) -> int:
        """A new lease that ends ``ttl`` seconds after its last keep-alive; its id."""
        return int(self.call("lease/grant", {"TTL": str(ttl)})["ID"])

    def keep_alive(self, lease: int) -> int:
        """Renews the lease; its seconds left (0: it has already ended)."""
        answer = self.call("lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", {}).get("TTL", 0))

    def revoke_lease(self, lease: int) -> None:
        """Ends the lease now: its keys go at once."""
        self.call("lease/revoke", {"ID": str(lease)})
