"""Make the TLS certificates and SuperNode keys of a fedpers deployment.

    python docker/credentials.py --out docker/credentials --superlink-ip 10.213.0.2 \
        --nodes 3 [--extra-nodes 1]

Writes (never commit them; docker/.gitignore ignores the folder):
- ``ca.crt``, ``ca.key``: a private certificate authority;
- ``server.pem``, ``server.key``: the SuperLink's certificate, signed by the CA, valid for
  the DNS names ``superlink`` and ``localhost`` and the given IP addresses (127.0.0.1
  always);
- ``node<i>``, ``node<i>.pub``: ECDSA P-384 key pairs in OpenSSH format, one per
  SuperNode (what ``ssh-keygen -t ecdsa -b 384`` makes). Register the public keys with
  ``flwr supernode register node<i>.pub <superlink>``; ``--extra-nodes`` makes keys that
  are deliberately left unregistered (to check that the SuperLink refuses them).

Only the ``cryptography`` package is needed (a dependency of flwr), so the script runs
wherever Flower is installed.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 30


def _write(path: Path, data: bytes, *, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_credentials(out: Path, *, ips: list[str], nodes: int, extra_nodes: int = 0) -> Path:
    """Write the CA, the SuperLink certificate and ``nodes + extra_nodes`` key pairs."""
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("fedpers test CA"))
        .issuer_name(_name("fedpers test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP384R1())
    names: list[x509.GeneralName] = [x509.DNSName("superlink"), x509.DNSName("localhost")]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in sorted({"127.0.0.1", *ips})]
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("superlink"))
        .issuer_name(ca_cert.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    unencrypted = serialization.NoEncryption()
    _write(out / "ca.crt", ca_cert.public_bytes(pem))
    _write(
        out / "ca.key",
        ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, unencrypted),
        private=True,
    )
    _write(out / "server.pem", server_cert.public_bytes(pem))
    _write(
        out / "server.key",
        server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, unencrypted),
        private=True,
    )
    for index in range(nodes + extra_nodes):
        key = ec.generate_private_key(ec.SECP384R1())
        _write(
            out / f"node{index}",
            key.private_bytes(pem, serialization.PrivateFormat.OpenSSH, unencrypted),
            private=True,
        )
        _write(
            out / f"node{index}.pub",
            key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
            )
            + b"\n",
        )
    return out


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "credentials")
    parser.add_argument("--superlink-ip", action="append", default=[], help="IP of the SuperLink")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--extra-nodes", type=int, default=0)
    args = parser.parse_args(argv)
    make_credentials(
        args.out, ips=args.superlink_ip, nodes=args.nodes, extra_nodes=args.extra_nodes
    )


if __name__ == "__main__":
    main()
