"""Make, rotate and inspect the TLS certificates and SuperNode keys of a deployment.

    python docker/credentials.py init --out docker/credentials --nodes 3 \
        [--superlink-ip 10.213.0.2] [--days 30] [--uid 10001] [--extra-nodes 1]
    python docker/credentials.py rotate --out docker/credentials [--days 30] [--nodes 0,2]
    python docker/credentials.py status --out docker/credentials

One folder per holder, so that each container mounts only its own secrets:

- ``ca/``: ``ca.crt`` and ``ca.key``, the private certificate authority. The CA key stays
  with the operator: it is never mounted into a container.
- ``superlink/``: ``ca.crt``, ``server.pem`` and ``server.key`` (the SuperLink's
  certificate, for the DNS names ``superlink`` and ``localhost`` and the given IP
  addresses, 127.0.0.1 always), and ``nodes/node<i>.pub``, the nodes' public keys.
- ``proxy/``: ``ca.crt``, ``proxy.pem`` and ``proxy.key``: the certificate of the Fleet
  proxy that devices connect to (DNS name ``fleet``).
- ``operator/``: ``ca.crt`` and ``nodes/node<i>.pub``, what ``flwr supernode register``
  needs (no private key at all).
- ``node<i>/``: ``ca.crt`` and SuperNode i's ECDSA P-384 key pair in OpenSSH format
  (``node<i>``, ``node<i>.pub``, what ``ssh-keygen -t ecdsa -b 384`` makes).
  ``--extra-nodes`` makes key pairs that are left unregistered (to check that the
  SuperLink refuses them) or kept as spares.

Private keys are created with mode 0600 from their first byte (``os.open`` with 0o600, then
an atomic rename), public files 0644. Certificates carry Subject and Authority Key
Identifiers, KeyUsage and BasicConstraints, so they pass strict X.509 verification
(``ssl.VERIFY_X509_STRICT``, Python 3.13's default). ``--uid`` gives the folders of the
containers (superlink, proxy, node<i>) to that user, the images' non-root user.

Rotation: ``rotate`` issues new SuperLink and proxy keys and certificates from the same CA
(restart the SuperLink and the proxy; devices keep trusting the CA). ``rotate --nodes 0,2``
also makes new key pairs for those nodes and keeps each old public key as
``operator/nodes/node<i>.pub.retired``: register the new key, restart the node, then
unregister the old node id (``flwr supernode unregister ID``). A new CA is a new ``init``
in a new folder, and its ``ca.crt`` must reach every device. ``status`` prints how many days
each certificate has left and exits 1 when one has expired or expires within ``--warn``
days.

Only the ``cryptography`` package is needed (a dependency of flwr).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import shutil
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 30
SERVER_NAMES = ("superlink", "localhost")
PROXY_NAMES = ("fleet", "localhost")
PEM = serialization.Encoding.PEM


class CredentialsError(ValueError):
    """A credentials folder that cannot be used as asked (the message names the fix)."""


def _write(path: Path, data: bytes, *, private: bool = False) -> None:
    """Write ``data`` atomically; a private file is 0600 from its first byte."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp{os.getpid()}")
    descriptor = os.open(
        temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644
    )
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _key_usage(**allowed: bool) -> x509.KeyUsage:
    """digitalSignature plus ``allowed`` (e.g. key_cert_sign=True); every other use off."""
    uses = ("content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
            "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")  # fmt: skip
    return x509.KeyUsage(digital_signature=True, **{u: allowed.get(u, False) for u in uses})


def _check_days(days: int) -> None:
    if not 1 <= days <= 3650:
        raise CredentialsError(f"--days {days}: give a lifetime of 1 to 3650 days")


def _issue_ca(days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP384R1())
    now = datetime.datetime.now(datetime.UTC)
    public = key.public_key()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(_name("fedpers CA"))
        .issuer_name(_name("fedpers CA"))
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            _key_usage(key_cert_sign=True, crl_sign=True),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False)
        .sign(key, hashes.SHA384())
    )
    return key, certificate


def _issue_server(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    common: str,
    dns: tuple[str, ...],
    ips: list[str],
    days: int,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP384R1())
    now = datetime.datetime.now(datetime.UTC)
    names: list[x509.GeneralName] = [x509.DNSName(name) for name in dns]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in sorted({"127.0.0.1", *ips})]
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    certificate = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            _key_usage(key_agreement=True),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA384())
    )
    return key, certificate


def _node_pair(out: Path, index: int) -> bytes:
    """A new key pair for node ``index`` in ``node<i>/``; returns the public key line."""
    key = ec.generate_private_key(ec.SECP384R1())
    folder = out / f"node{index}"
    _write(
        folder / f"node{index}",
        key.private_bytes(PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()),
        private=True,
    )
    public = (
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        + b"\n"
    )
    _write(folder / f"node{index}.pub", public)
    _write(out / "superlink" / "nodes" / f"node{index}.pub", public)
    _write(out / "operator" / "nodes" / f"node{index}.pub", public)
    return public


def _servers(out: Path, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate,
             ips: list[str], days: int) -> None:  # fmt: skip
    for folder, stem, common, dns in (
        ("superlink", "server", "superlink", SERVER_NAMES),
        ("proxy", "proxy", "fleet", PROXY_NAMES),
    ):
        key, certificate = _issue_server(ca_key, ca_cert, common, dns, ips, days)
        _write(out / folder / f"{stem}.key", _private_pem(key), private=True)
        _write(out / folder / f"{stem}.pem", certificate.public_bytes(PEM))


def _node_indices(out: Path) -> list[int]:
    return sorted(
        int(path.name[4:])
        for path in out.glob("node*")
        if path.is_dir() and path.name[4:].isdigit()
    )


def _give(out: Path, uid: int | None) -> None:
    """Give the containers' folders (not ca/ nor operator/) to ``uid``."""
    if uid is None:
        return
    for folder in ["superlink", "proxy", *[f"node{i}" for i in _node_indices(out)]]:
        for path in [out / folder, *(out / folder).rglob("*")]:
            os.chown(path, uid, uid)


def make_credentials(
    out: Path,
    *,
    ips: list[str],
    nodes: int,
    extra_nodes: int = 0,
    days: int = VALID_DAYS,
    uid: int | None = None,
    force: bool = False,
) -> Path:
    """Write the CA, the SuperLink and proxy certificates and ``nodes + extra_nodes`` key pairs.

    Refuses a folder that already holds a CA (``force`` replaces it), so that an existing
    deployment's identities are never overwritten by mistake.
    """
    _check_days(days)
    if nodes < 1 or extra_nodes < 0:
        raise CredentialsError(f"--nodes {nodes} --extra-nodes {extra_nodes}: need nodes >= 1")
    for ip in ips:
        try:
            ipaddress.ip_address(ip)
        except ValueError as error:
            raise CredentialsError(f"--superlink-ip {ip!r} is not an IP address") from error
    if (out / "ca" / "ca.key").exists() and not force:
        raise CredentialsError(
            f"{out} already holds a CA: use `rotate` to renew its certificates, or a new "
            "folder (or --force, which replaces every identity in it)"
        )
    if force:
        for child in (
            "ca",
            "superlink",
            "proxy",
            "operator",
            *(f"node{i}" for i in _node_indices(out)),
        ):
            shutil.rmtree(out / child, ignore_errors=True)
    ca_key, ca_cert = _issue_ca(days)
    _write(out / "ca" / "ca.key", _private_pem(ca_key), private=True)
    for folder in ("ca", "superlink", "proxy", "operator"):
        _write(out / folder / "ca.crt", ca_cert.public_bytes(PEM))
    _servers(out, ca_key, ca_cert, ips, days)
    for index in range(nodes + extra_nodes):
        _write(out / f"node{index}" / "ca.crt", ca_cert.public_bytes(PEM))
        _node_pair(out, index)
    _give(out, uid)
    return out


def _load_ca(out: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key_path, cert_path = out / "ca" / "ca.key", out / "ca" / "ca.crt"
    if not key_path.exists() or not cert_path.exists():
        raise CredentialsError(
            f"{out}/ca/ holds no CA (ca.key, ca.crt): make one with "
            f"`python docker/credentials.py init --out {out}`"
        )
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CredentialsError(f"{key_path} is not an EC private key")
    return key, x509.load_pem_x509_certificate(cert_path.read_bytes())


def _san_ips(path: Path) -> list[str]:
    certificate = x509.load_pem_x509_certificate(path.read_bytes())
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(ip) for ip in names.get_values_for_type(x509.IPAddress)]


def rotate(
    out: Path,
    *,
    days: int = VALID_DAYS,
    nodes: list[int] | None = None,
    uid: int | None = None,
    ips: list[str] | None = None,
) -> list[Path]:
    """New SuperLink/proxy certificates from the same CA, and new keys for ``nodes``.

    Returns the retired public keys (``operator/nodes/node<i>.pub.retired``) to unregister.
    """
    _check_days(days)
    ca_key, ca_cert = _load_ca(out)
    known = _node_indices(out)
    for index in nodes or []:
        if index not in known:
            raise CredentialsError(f"--nodes {index}: {out} has no node{index}/ (nodes: {known})")
    server_ips = ips if ips is not None else _san_ips(out / "superlink" / "server.pem")
    _servers(out, ca_key, ca_cert, server_ips, days)
    retired = []
    for index in nodes or []:
        old = out / "operator" / "nodes" / f"node{index}.pub"
        keep = old.with_name(old.name + ".retired")
        _write(keep, old.read_bytes())
        retired.append(keep)
        _node_pair(out, index)
    _give(out, uid)
    return retired


def status(out: Path) -> list[tuple[str, float]]:
    """Each certificate of ``out`` with the days it has left (negative: expired)."""
    now = datetime.datetime.now(datetime.UTC)
    found = []
    for path in sorted(out.glob("*/*.pem")) + sorted(out.glob("ca/ca.crt")):
        certificate = x509.load_pem_x509_certificate(path.read_bytes())
        left = (certificate.not_valid_after_utc - now).total_seconds() / 86400
        found.append((str(path.relative_to(out)), left))
    return found


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")


def main(argv: list[str] | None = None) -> None:
    """Command line entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    default_out = Path(__file__).parent / "credentials"
    init = commands.add_parser("init", help="a new CA, certificates and node keys")
    init.add_argument("--out", type=Path, default=default_out)
    init.add_argument("--superlink-ip", action="append", default=[], help="IP of the SuperLink")
    init.add_argument("--nodes", type=int, default=3)
    init.add_argument("--extra-nodes", type=int, default=0)
    init.add_argument("--days", type=int, default=VALID_DAYS, help="certificate lifetime")
    init.add_argument("--uid", type=int, help="owner of the containers' folders")
    init.add_argument("--force", action="store_true", help="replace an existing CA")
    renew = commands.add_parser("rotate", help="renew the server certificates (and node keys)")
    renew.add_argument("--out", type=Path, default=default_out)
    renew.add_argument("--days", type=int, default=VALID_DAYS)
    renew.add_argument("--nodes", default="", help="comma-separated node indices to re-key")
    renew.add_argument("--uid", type=int)
    show = commands.add_parser("status", help="days left on each certificate")
    show.add_argument("--out", type=Path, default=default_out)
    show.add_argument("--warn", type=float, default=7.0)
    args = parser.parse_args(argv)
    try:
        if args.command == "init":
            make_credentials(
                args.out,
                ips=args.superlink_ip,
                nodes=args.nodes,
                extra_nodes=args.extra_nodes,
                days=args.days,
                uid=args.uid,
                force=args.force,
            )
            _say(f"credentials for {args.nodes} nodes in {args.out} (valid {args.days} days)")
        elif args.command == "rotate":
            try:
                indices = [int(i) for i in args.nodes.split(",") if i.strip()]
            except ValueError as error:
                raise CredentialsError(f"--nodes {args.nodes!r}: give indices like 0,2") from error
            retired = rotate(args.out, days=args.days, nodes=indices, uid=args.uid)
            _say(f"new SuperLink and proxy certificates in {args.out}: restart both")
            for path in retired:
                _say(
                    f"retired {path}: register the new key, restart the node, unregister the old id"
                )
        else:
            expiring = False
            for name, left in status(args.out):
                flag = "EXPIRED" if left < 0 else ("renew soon" if left < args.warn else "ok")
                expiring |= left < args.warn
                _say(f"{name}: {left:.1f} days left ({flag})")
            sys.exit(1 if expiring else 0)
    except CredentialsError as error:
        parser.exit(2, f"error: {error}\n")


if __name__ == "__main__":
    main()
