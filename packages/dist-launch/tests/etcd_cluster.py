"""Real etcd servers for the tests: one member or several, on loopback, as child processes.

Each member gets its own data directory under the test's temporary directory and two
free loopback ports (client, peer); every member is stopped by its PID (SIGTERM, then
SIGKILL) when the context ends, whatever happened. Without the ``etcd`` program the
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
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

INSTALL = "apt-get install -y etcd-server (etcd 3.4 or later)"
START_SECONDS = 30.0  # how long a cluster may take to elect a leader


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

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

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


def _post(member: EtcdMember, path: str) -> dict[str, Any] | None:
    """etcd's JSON answer to ``/v3/<path>``, or None when the member does not answer."""
    request = urllib.request.Request(f"{member.url}/v3/{path}", data=b"{}")
    try:
        with urllib.request.urlopen(request, timeout=5.0, context=member.tls) as answer:
            found: dict[str, Any] = json.loads(answer.read())
            return found
    except OSError:
        return None


def _member_id(member: EtcdMember) -> str | None:
    status = _post(member, "maintenance/status")
    return None if status is None else str(status["header"]["member_id"])


def _healthy(member: EtcdMember) -> bool:
    try:
        with urllib.request.urlopen(
            f"{member.url}/health", timeout=1, context=member.tls
        ) as answer:
            return b'"true"' in answer.read()
    except OSError:
        return False


def _stop(member: EtcdMember) -> None:
    if member.process.poll() is None:
        member.process.terminate()
        try:
            member.process.wait(10)
        except subprocess.TimeoutExpired:
            member.kill()


@contextlib.contextmanager
def etcd_cluster(
    directory: Path, size: int = 1, tls: TlsFiles | None = None
) -> Iterator[EtcdCluster]:
    """Starts ``size`` members on loopback; yields once every one answers healthy.

    With ``tls``, clients must use https and present a certificate the CA signed.

    Raises:
        TimeoutError: The cluster was not healthy within :data:`START_SECONDS`.
    """
    program = require_etcd()
    ports = _free_ports(2 * size)
    names = [f"m{index}" for index in range(size)]
    peers = ",".join(f"{name}=http://127.0.0.1:{ports[2 * i + 1]}" for i, name in enumerate(names))
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
            log = (directory / f"etcd-{name}.log").open("wb")
            command = [
                program,
                f"--name={name}",
                f"--data-dir={directory / f'etcd-{name}'}",
                f"--listen-client-urls={scheme}://127.0.0.1:{client}",
                f"--advertise-client-urls={scheme}://127.0.0.1:{client}",
                *client_tls,
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster={peers}",
                "--initial-cluster-state=new",
                f"--initial-cluster-token=dist-launch-test-{ports[0]}",
            ]
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            log.close()
            members.append(EtcdMember(name, client, process, context))
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
