"""Real etcd servers for the tests: one member or several, as child processes.

Each member gets its own data directory under the test's temporary directory and two
free loopback ports (client, peer); or, given places (tests-integration's network
namespaces), each member runs in its own place on that place's address and etcd's
default ports, and this process talks to it through a short Python run there. Every
member is stopped by its PID (SIGTERM, then SIGKILL) when the context ends, whatever
happened. Without the ``etcd`` program the
tests skip, saying what to install, unless ``DIST_LAUNCH_REQUIRE_ETCD`` is set (``nox -s
cluster`` sets it, having installed it): then they fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

INSTALL = "apt-get install -y etcd-server (etcd 3.4 or later)"
START_SECONDS = 30.0  # how long a cluster may take to elect a leader
CLIENT_PORT, PEER_PORT = 2379, 2380  # etcd's own, for members each at an address of its own
# Run in a member's place (its network namespace): POSTs argv[2] to the URL argv[1] and
# prints etcd's answer; exits 1 when the member does not answer.
_REQUEST = """
import sys, urllib.request
data = sys.argv[2].encode() if len(sys.argv) > 2 else None
try:
    with urllib.request.urlopen(urllib.request.Request(sys.argv[1], data=data), timeout=5) as a:
        sys.stdout.buffer.write(a.read())
except OSError:
    sys.exit(1)
"""


@dataclass(frozen=True)
class Place:
    """Where a member runs: an address of its own and the command prefix that runs a
    program there (``["ip", "netns", "exec", namespace]``)."""

    address: str
    prefix: tuple[str, ...]


def require_etcd() -> str:
    """The path of ``etcd``; skips the test (fails it under DIST_LAUNCH_REQUIRE_ETCD)."""
    found = shutil.which("etcd")
    if found is not None:
        return found
    reason = f"needs the etcd server program on PATH ({INSTALL})"
    if os.environ.get("DIST_LAUNCH_REQUIRE_ETCD"):
        pytest.fail(f"{reason}: DIST_LAUNCH_REQUIRE_ETCD is set", pytrace=False)
    pytest.skip(reason)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass(frozen=True)
class TlsFiles:
    """A CA, and a certificate and key it signed for 127.0.0.1 (server and client)."""

    cacert: Path
    cert: Path
    key: Path


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def make_tls_files(directory: Path) -> TlsFiles:
    """Makes a throwaway CA and one certificate for 127.0.0.1 with ``openssl``.

    Skips the test when ``openssl`` is missing.
    """
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl program to make test certificates")
    ca_key, ca, key, csr, cert, ext = (
        directory / name for name in ("ca.key", "ca.pem", "k.pem", "c.csr", "c.pem", "san.cnf")
    )
    ext.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    new_key = ["-newkey", "rsa:2048", "-nodes"]
    _openssl(
        "req", "-x509", *new_key, "-days", "1", "-subj", "/CN=ca", "-keyout", ca_key, "-out", ca
    )
    _openssl("req", *new_key, "-subj", "/CN=127.0.0.1", "-keyout", key, "-out", csr)
    signed_by_ca: list[str | Path] = ["-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "1"]
    _openssl("x509", "-req", "-in", csr, *signed_by_ca, "-extfile", ext, "-out", cert)
    return TlsFiles(ca, cert, key)


@dataclass
class EtcdMember:
    """One running member: its name, client port and process."""

    name: str
    client_port: int
    process: subprocess.Popen[bytes]
    tls: ssl.SSLContext | None = None  # how a client reaches it over https
    place: Place | None = None  # None: on loopback here

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    @property
    def endpoint(self) -> str:
        address = "127.0.0.1" if self.place is None else self.place.address
        return f"{address}:{self.client_port}"

    def healthy(self) -> bool:
        """Whether the member says it is healthy (it has a leader and a quorum)."""
        return _healthy(self)

    def kill(self) -> None:
        """SIGKILL, reaped."""
        self.process.kill()
        self.process.wait(10)


@dataclass
class EtcdCluster:
    """The members of a running cluster."""

    members: list[EtcdMember]

    @property
    def endpoints(self) -> str:
        """``--rdzv-endpoint``'s value: every member's client address."""
        return ",".join(member.endpoint for member in self.members)

    def leader(self) -> EtcdMember:
        """The member that leads the cluster now, as the members' status says."""
        by_id = {_member_id(member): member for member in self.members}
        for member in self.members:
            status = _post(member, "maintenance/status")
            if status is not None and str(status.get("leader")) in by_id:
                return by_id[str(status["leader"])]
        raise LookupError("no etcd member names a leader")

    def make_leader(self, member: EtcdMember) -> None:
        """Hands the leadership to ``member`` (etcd's MoveLeader), waiting until it leads.

        Raises:
            TimeoutError: It did not lead within :data:`START_SECONDS`.
        """
        deadline = time.monotonic() + START_SECONDS
        while (leader := self.leader()) is not member:
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd member {member.name} did not take the lead")
            body = json.dumps({"targetID": _member_id(member)})
            _post(leader, "maintenance/transfer-leadership", body)
            time.sleep(0.2)  # polling the members' status, not ordering our own threads


def _request(member: EtcdMember, url: str, body: str | None) -> bytes | None:
    """The member's answer to a GET (``body`` None) or POST of ``url``; None if none."""
    if member.place is not None:
        argv = [*member.place.prefix, sys.executable, "-c", _REQUEST, url]
        try:
            done = subprocess.run(
                [*argv, *([] if body is None else [body])], capture_output=True, timeout=15
            )
        except subprocess.TimeoutExpired:
            return None
        return done.stdout if done.returncode == 0 else None
    data = None if body is None else body.encode()
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, data=data), timeout=5.0, context=member.tls
        ) as answer:
            found: bytes = answer.read()
            return found
    except OSError:
        return None


def _post(member: EtcdMember, path: str, body: str = "{}") -> dict[str, Any] | None:
    """etcd's JSON answer to ``/v3/<path>``, or None when the member does not answer."""
    answer = _request(member, f"{member.url}/v3/{path}", body)
    if answer is None:
        return None
    found: dict[str, Any] = json.loads(answer)
    return found


def _member_id(member: EtcdMember) -> str | None:
    status = _post(member, "maintenance/status")
    return None if status is None else str(status["header"]["member_id"])


def _healthy(member: EtcdMember) -> bool:
    answer = _request(member, f"{member.url}/health", None)
    return answer is not None and b'"true"' in answer


def _stop(member: EtcdMember) -> None:
    if member.process.poll() is None:
        member.process.terminate()
        try:
            member.process.wait(10)
        except subprocess.TimeoutExpired:
            member.kill()


@contextlib.contextmanager
def etcd_cluster(
    directory: Path,
    size: int = 1,
    tls: TlsFiles | None = None,
    places: Sequence[Place] = (),
) -> Iterator[EtcdCluster]:
    """Starts ``size`` members on loopback; yields once every one answers healthy.

    With ``tls``, clients must use https and present a certificate the CA signed. With
    ``places``, one member runs in each place (``size`` is ignored), without TLS.

    Raises:
        TimeoutError: The cluster was not healthy within :data:`START_SECONDS`.
    """
    program = require_etcd()
    if places:
        size = len(places)
        addresses = [place.address for place in places]
        ports = [port for _ in places for port in (CLIENT_PORT, PEER_PORT)]
    else:
        addresses = ["127.0.0.1"] * size
        ports = _free_ports(2 * size)
    names = [f"m{index}" for index in range(size)]
    peers = ",".join(
        f"{name}=http://{addresses[i]}:{ports[2 * i + 1]}" for i, name in enumerate(names)
    )
    members: list[EtcdMember] = []
    scheme, client_tls, context = "http", [], None
    if tls is not None:
        scheme = "https"
        client_tls = [f"--cert-file={tls.cert}", f"--key-file={tls.key}"]
        client_tls += ["--client-cert-auth", f"--trusted-ca-file={tls.cacert}"]
        context = ssl.create_default_context(cafile=str(tls.cacert))
        context.load_cert_chain(str(tls.cert), str(tls.key))
    try:
        for index, name in enumerate(names):
            client, peer = ports[2 * index], ports[2 * index + 1]
            address = addresses[index]
            log = (directory / f"etcd-{name}.log").open("wb")
            command = [
                *(places[index].prefix if places else ()),
                program,
                f"--name={name}",
                f"--data-dir={directory / f'etcd-{name}'}",
                f"--listen-client-urls={scheme}://{address}:{client}",
                f"--advertise-client-urls={scheme}://{address}:{client}",
                *client_tls,
                f"--listen-peer-urls=http://{address}:{peer}",
                f"--initial-advertise-peer-urls=http://{address}:{peer}",
                f"--initial-cluster={peers}",
                "--initial-cluster-state=new",
                f"--initial-cluster-token=dist-launch-test-{ports[0]}",
            ]
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            log.close()
            place = places[index] if places else None
            members.append(EtcdMember(name, client, process, context, place))
        deadline = time.monotonic() + START_SECONDS
        while not all(_healthy(member) for member in members):
            dead = [m.name for m in members if m.process.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(
                    (directory / f"etcd-{m.name}.log").read_text(errors="replace")[-2000:]
                    for m in members
                )
                raise TimeoutError(f"etcd members not healthy (dead: {dead}):\n{logs}")
            time.sleep(0.1)  # polling a server's health, not ordering our own threads
        yield EtcdCluster(members)
    finally:
        for member in members:
            _stop(member)
