"""Pinning the server's identity: `orchard serve` over HTTPS, and a client that trusts only
one CA (``ca_file``) never sends its API key to anything else on the server's address
(the security issue: a process that took the port during a restart collected the key)."""

from __future__ import annotations

import socket
import ssl
import subprocess
import threading
from pathlib import Path

import pytest

from orchard.client import Client
from orchard.errors import OrchardError
from orchard.server.config import ServerConfig
from tests.server.conftest import API_KEY


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def certificate(directory: Path, name: str, ca: str | None) -> tuple[Path, Path]:
    """A key and a certificate for 127.0.0.1, signed by ``ca`` (a name made before) or self-signed."""
    (directory / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    if ca is None:
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem",
                "-subj", f"/CN={name}", "-days", "2", "-addext", "subjectAltName=IP:127.0.0.1", cwd=directory)
    else:
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}", cwd=directory)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=directory)
    return directory / f"{name}.pem", directory / f"{name}.key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    directory = tmp_path_factory.mktemp("pki")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-subj",
            "/CN=orchard-test-ca", "-days", "2", cwd=directory)
    return {"ca": (directory / "ca.pem", directory / "ca.key"), "server": certificate(directory, "server", "ca"),
            "impostor": certificate(directory, "impostor", None)}


def test_a_pinned_client_talks_to_the_server_and_to_nothing_else(server_factory, pki):
    cert, key = pki["server"]
    server = server_factory(tls_cert=str(cert), tls_key=str(key))
    ca = str(pki["ca"][0])
    with Client(f"https://127.0.0.1:{server.port}", API_KEY, ca_file=ca) as client:
        assert isinstance(client.list(), list)  # served, over TLS
    received: list[bytes] = []
    impostor = impostor_server(*pki["impostor"], received)
    try:
        with Client(f"https://127.0.0.1:{impostor.getsockname()[1]}", API_KEY, ca_file=ca, retries=0) as client:
            with pytest.raises(OrchardError):
                client.list()
    finally:
        impostor.close()
    assert not any(API_KEY.encode() in chunk for chunk in received), received  # the handshake failed first


def impostor_server(cert: Path, key: Path, received: list[bytes]) -> socket.socket:
    """What a squatter on the server's port would run: TLS with a certificate of its own,
    keeping every byte a client sends."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def serve() -> None:
        while True:
            try:
                raw, _ = listener.accept()
            except OSError:
                return
            try:
                with context.wrap_socket(raw, server_side=True) as conn:
                    conn.settimeout(5)
                    received.append(conn.recv(65536))
            except (OSError, ssl.SSLError):
                continue

    threading.Thread(target=serve, daemon=True).start()
    return listener


def test_tls_settings_come_in_pairs(tmp_path: Path):
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        ServerConfig(tls_cert=cert)
