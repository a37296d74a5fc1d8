"""docker/credentials.py: per-holder folders, 0600 keys, strict X.509, rotation."""

from __future__ import annotations

import datetime
import os
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from tests.deployment.cluster import load_script

credentials = load_script("credentials")


@pytest.fixture
def made(tmp_path: Path) -> Path:
    return credentials.make_credentials(tmp_path / "c", ips=["10.9.8.7"], nodes=2, days=3)


def _handshake(server_pem: Path, server_key: Path, cafile: Path, *, strict: bool) -> None:
    """A TLS handshake on loopback: our certificate served, verified by a client."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(server_pem, server_key)
    client = ssl.create_default_context(cafile=str(cafile))
    if strict:
        client.verify_flags |= ssl.VERIFY_X509_STRICT
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)

        def accept() -> None:
            connection, _ = listener.accept()
            try:
                with server.wrap_socket(connection, server_side=True):
                    pass
            except (ssl.SSLError, OSError):
                pass

        thread = threading.Thread(target=accept)
        thread.start()
        try:
            with (
                socket.create_connection(listener.getsockname(), timeout=5) as raw,
                client.wrap_socket(raw, server_hostname="localhost") as tls,
            ):
                assert tls.version() is not None
        finally:
            thread.join(timeout=5)


def test_each_holder_gets_only_its_own_secrets(made: Path) -> None:
    files = {str(p.relative_to(made)) for p in made.rglob("*") if p.is_file()}
    assert {f for f in files if f.endswith(".key") or f.split("/")[-1].startswith("node")} >= {
        "ca/ca.key",
        "superlink/server.key",
        "proxy/proxy.key",
        "node0/node0",
        "node1/node1",
    }
    assert [f for f in files if f.endswith("ca.key")] == ["ca/ca.key"]
    assert sorted(f for f in files if f.startswith("node0/")) == [
        "node0/ca.crt",
        "node0/node0",
        "node0/node0.pub",
    ]
    assert sorted(f for f in files if f.startswith("operator/")) == [
        "operator/ca.crt",
        "operator/nodes/node0.pub",
        "operator/nodes/node1.pub",
    ]
    superlink = sorted(f for f in files if f.startswith("superlink/"))
    assert superlink == [
        "superlink/ca.crt",
        "superlink/nodes/node0.pub",
        "superlink/nodes/node1.pub",
        "superlink/server.key",
        "superlink/server.pem",
    ]
    # The public keys the SuperLink and the operator hold are the nodes' own.
    assert (made / "superlink/nodes/node1.pub").read_bytes() == (
        made / "node1/node1.pub"
    ).read_bytes()


def test_private_keys_are_0600_from_their_first_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[tuple[str, int, int]] = []
    real_open = os.open

    def recording_open(path: str | os.PathLike[str], flags: int, mode: int = 0o777) -> int:
        opened.append((str(path), flags, mode))
        return real_open(path, flags, mode)

    monkeypatch.setattr(credentials.os, "open", recording_open)
    old_umask = os.umask(0)  # a permissive umask must not widen the modes
    try:
        out = credentials.make_credentials(tmp_path / "c", ips=[], nodes=1)
    finally:
        os.umask(old_umask)
    private = [
        p for p in out.rglob("*") if p.is_file() and (p.suffix == ".key" or p.name == "node0")
    ]
    assert len(private) == 4
    for path in private:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        # created by os.open with O_EXCL and mode 0600 (then renamed into place)
        created = [o for o in opened if Path(o[0]).name.startswith(f".{path.name}.tmp")]
        assert created, path
        assert all(mode == 0o600 and flags & os.O_EXCL for _, flags, mode in created)
    assert stat.S_IMODE((out / "ca" / "ca.crt").stat().st_mode) == 0o644


def test_certificates_pass_strict_verification(made: Path) -> None:
    for folder, stem in (("superlink", "server"), ("proxy", "proxy")):
        _handshake(
            made / folder / f"{stem}.pem",
            made / folder / f"{stem}.key",
            made / "node0" / "ca.crt",
            strict=True,
        )
    server = x509.load_pem_x509_certificate((made / "superlink/server.pem").read_bytes())
    ca = x509.load_pem_x509_certificate((made / "ca/ca.crt").read_bytes())
    aki = server.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert aki.key_identifier == ski.digest
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    lifetime = server.not_valid_after_utc - server.not_valid_before_utc
    assert datetime.timedelta(days=3) <= lifetime <= datetime.timedelta(days=3, minutes=6)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {
        "127.0.0.1",
        "10.9.8.7",
    }


def test_strict_verification_rejects_certificates_without_key_identifiers(
    tmp_path: Path,
) -> None:
    """The control: what the previous credentials.py made fails the strict check."""
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "old CA")])
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(ca_key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "superlink")]))
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(2)
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    (tmp_path / "ca.crt").write_bytes(ca.public_bytes(pem))
    (tmp_path / "leaf.pem").write_bytes(leaf.public_bytes(pem))
    (tmp_path / "leaf.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    _handshake(tmp_path / "leaf.pem", tmp_path / "leaf.key", tmp_path / "ca.crt", strict=False)
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(tmp_path / "leaf.pem", tmp_path / "leaf.key", tmp_path / "ca.crt", strict=True)


def test_rotate_renews_servers_and_rekeys_nodes(made: Path) -> None:
    old_server = (made / "superlink/server.pem").read_bytes()
    old_node = (made / "node1/node1.pub").read_bytes()
    untouched = (made / "node0/node0").read_bytes()
    retired = credentials.rotate(made, days=10, nodes=[1])
    assert (made / "superlink/server.pem").read_bytes() != old_server
    assert retired == [made / "operator/nodes/node1.pub.retired"]
    assert retired[0].read_bytes() == old_node
    assert (made / "node1/node1.pub").read_bytes() != old_node
    assert (made / "superlink/nodes/node1.pub").read_bytes() == (
        made / "node1/node1.pub"
    ).read_bytes()
    assert (made / "node0/node0").read_bytes() == untouched
    # Devices keep their CA and verify the renewed certificate, which kept its addresses.
    _handshake(
        made / "superlink/server.pem",
        made / "superlink/server.key",
        made / "node0/ca.crt",
        strict=True,
    )
    left = dict(credentials.status(made))
    assert 2.9 < left["ca/ca.crt"] < 3.01  # the CA's own lifetime caps the renewal
    assert left["superlink/server.pem"] <= left["ca/ca.crt"]
    server = x509.load_pem_x509_certificate((made / "superlink/server.pem").read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "10.9.8.7" in {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["init", "--days", "0"], "lifetime of 1 to 3650 days"),
        (["init", "--superlink-ip", "superlink"], "is not an IP address"),
        (["init", "--nodes", "0"], "need nodes >= 1"),
        (["rotate"], "holds no CA"),
        (["rotate", "--nodes", "x"], "give indices like 0,2"),
    ],
)
def test_bad_input_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    if argv[0] == "rotate" and argv[1:]:
        credentials.make_credentials(tmp_path, ips=[], nodes=1)
    with pytest.raises(SystemExit) as stopped:
        credentials.main([*argv, "--out", str(tmp_path)])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_init_never_overwrites_an_existing_ca(made: Path) -> None:
    key = (made / "ca/ca.key").read_bytes()
    with pytest.raises(credentials.CredentialsError, match="already holds a CA"):
        credentials.make_credentials(made, ips=[], nodes=1)
    assert (made / "ca/ca.key").read_bytes() == key
    with pytest.raises(credentials.CredentialsError, match="has no node5"):
        credentials.rotate(made, nodes=[5])
