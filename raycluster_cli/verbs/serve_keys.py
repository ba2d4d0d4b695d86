"""The service's own API keys and its TLS pair: made and kept on this machine, their digests put on the head.

A key opens the service's routes and nothing else (never the Ray cluster's token, which opens the Jobs API). Each
key made here is kept in a 0600 file of this cluster's state folder (``service-keys/NAME``) and never printed;
the head's container keeps only the keys document (names, SHA-256 digests, limits; ``raycluster_cli.apikeys``),
written whole through ``docker exec`` with the data on stdin, which the ingress reads again whenever it changes:
``add`` and ``revoke`` take effect on the next request, without a restart. A TLS pair (the operator's own, or one
made here on request, self-signed for the head's addresses) goes into the head's container the same way; the
clients raycluster ships verify the service against that certificate.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raycluster_cli.apikeys import (
    DEFAULT_NAME,
    KeyEntry,
    check_key,
    check_name,
    merged,
    new_key,
    parse_keys,
    render_keys,
)
from raycluster_cli.config.inventory import Inventory
from raycluster_cli.config.state import ensure_private_dir, state_dir
from raycluster_cli.errors import OperationError, UsageError
from raycluster_cli.host.containers import container_name
from raycluster_cli.transport import Transport, quote
from raycluster_cli.transport.pool import Connect

KEYS_IN_CONTAINER = "/tmp/raycluster-serve-keys.json"  # beside the launcher's record, in the head's container
TLS_IN_CONTAINER = "/tmp/raycluster-serve-tls"  # cert.pem and key.pem


def keys_dir(inventory: Inventory) -> Path:
    return state_dir(inventory) / "service-keys"


def key_file(inventory: Inventory, name: str = DEFAULT_NAME) -> Path:
    return keys_dir(inventory) / check_name(name)


def tls_dir(inventory: Inventory) -> Path:
    return state_dir(inventory) / "service-tls"


def read_key(inventory: Inventory, name: str = DEFAULT_NAME) -> str | None:
    """The key ``name`` made on this machine, None when this machine has none of that name."""
    path = key_file(inventory, name)
    try:
        return check_key(path.read_text(), str(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise OperationError(
            f"cannot read the service key {path}: {exc}", f"remove it (rm {path}) and add it again"
        ) from None


def _write_private(path: Path, text: str) -> None:
    ensure_private_dir(path.parent)
    temp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    temp.replace(path)


def _head(inventory: Inventory, connect: Connect) -> tuple[Transport, str]:
    return connect(inventory.head_host), quote(container_name(inventory, inventory.head_host))


def put_in_head(transport: Transport, head: str, path: str, data: bytes) -> None:
    """``data`` as a file only root reads in the head's container (written whole, then renamed into place)."""
    folder = os.path.dirname(path)
    script = f"umask 077 && mkdir -p {quote(folder)} && cat > {quote(path + '.tmp')} && mv -f {quote(path + '.tmp')} {quote(path)}"
    result = transport.run(f"docker exec -i {head} sh -c {quote(script)}", stdin=data, timeout=30)
    if not result.ok:
        raise OperationError(
            f"{transport.host}: could not write {path} in the head's container: {result.first_line() or result.rc}",
            "is the cluster up? raycluster status",
        )


def head_keys(inventory: Inventory, connect: Connect) -> list[KeyEntry]:
    """The keys document in the head's container (empty when there is none yet)."""
    transport, head = _head(inventory, connect)
    result = transport.run(f"docker exec {head} cat {quote(KEYS_IN_CONTAINER)}", timeout=30)
    if not result.ok:
        return []
    try:
        return parse_keys(result.stdout)
    except ValueError as exc:
        raise OperationError(
            f"{inventory.head_address}: the service's keys document {KEYS_IN_CONTAINER} is damaged: {exc}",
            "raycluster serve --keys revoke NAME rewrites it; or serve again",
        ) from None


def _write_head_keys(inventory: Inventory, connect: Connect, entries: list[KeyEntry]) -> None:
    transport, head = _head(inventory, connect)
    put_in_head(transport, head, KEYS_IN_CONTAINER, render_keys(entries).encode())


def ensure_default_key(inventory: Inventory, api_key_file: str | None = None) -> tuple[str, Path]:
    """The key ``serve`` deploys with: the operator's own (``--api-key-file``), else this machine's ``default``
    key, made now (random, 0600) when there is none."""
    path = key_file(inventory, DEFAULT_NAME)
    if api_key_file:
        try:
            key = check_key(Path(api_key_file).read_text(), api_key_file)
        except OSError as exc:
            raise UsageError(f"--api-key-file {api_key_file}: {exc.strerror}", "name a readable file") from None
        except ValueError as exc:
            raise UsageError(
                str(exc), "one line: e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"
            ) from None
        _write_private(path, key + "\n")
        return key, path
    kept = read_key(inventory, DEFAULT_NAME)
    if kept is not None:
        return kept, path
    made = new_key()
    _write_private(path, made + "\n")
    return made, path


def put_keys(inventory: Inventory, connect: Connect, api_key_file: str | None = None) -> Path:
    """Before a deployment: the head's keys document holds the ``default`` key (and keeps every other key it
    had); returns the default key's file on this machine."""
    key, path = ensure_default_key(inventory, api_key_file)
    kept = head_keys(inventory, connect)
    old = next((e for e in kept if e.name == DEFAULT_NAME), None)
    entry = KeyEntry.make(DEFAULT_NAME, key)
    if old is not None and old.sha256 == entry.sha256:
        entry = old
    _write_head_keys(inventory, connect, merged(kept, [entry]))
    return path


@dataclass(frozen=True)
class KeyChange:
    name: str
    action: str  # added, revoked, listed
    key_file: str | None = None
    keys: tuple[dict[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "action": self.action, "key_file": self.key_file, "keys": list(self.keys)}


def add_key(
    inventory: Inventory,
    connect: Connect,
    name: str,
    max_requests: int | None = None,
    max_tokens: int | None = None,
) -> KeyChange:
    """A new key ``name`` (replacing one of that name), in effect at once; its file on this machine."""
    try:
        check_name(name)
    except ValueError as exc:
        raise UsageError(str(exc), "e.g. raycluster serve --keys add team-a") from None
    key = new_key()
    path = key_file(inventory, name)
    entry = KeyEntry.make(name, key, max_requests=max_requests, max_tokens=max_tokens)
    _write_head_keys(inventory, connect, merged(head_keys(inventory, connect), [entry]))
    _write_private(path, key + "\n")
    return KeyChange(name, "added", str(path))


def revoke_key(inventory: Inventory, connect: Connect, name: str) -> KeyChange:
    kept = head_keys(inventory, connect)
    if name not in {e.name for e in kept}:
        names = ", ".join(e.name for e in kept) or "none"
        raise UsageError(f"the service has no key {name!r} (its keys: {names})", "raycluster serve --keys list")
    _write_head_keys(inventory, connect, [e for e in kept if e.name != name])
    key_file(inventory, name).unlink(missing_ok=True)
    return KeyChange(name, "revoked")


def list_keys(inventory: Inventory, connect: Connect) -> KeyChange:
    rows = []
    for e in head_keys(inventory, connect):
        here = key_file(inventory, e.name)
        rows.append(
            {
                "name": e.name,
                "created": e.created,
                "max_requests": e.max_requests,
                "max_tokens": e.max_tokens,
                "key_file": str(here) if here.exists() else None,
            }
        )
    return KeyChange("", "listed", keys=tuple(rows))


# TLS -------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    made: bool = False  # self-signed here


def self_signed(inventory: Inventory) -> TlsFiles:
    """A self-signed pair for the head's addresses (kept: made again only when the head's addresses change)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder = ensure_private_dir(tls_dir(inventory))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    names = sorted({inventory.node_ip(inventory.head_host), str(inventory.head_address)})
    wanted = [x509.IPAddress(ipaddress.ip_address(n)) for n in names]
    if cert_path.exists() and key_path.exists():
        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            have = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            fresh = cert.not_valid_after_utc > datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=7)
            if fresh and set(have.get_values_for_type(x509.IPAddress)) == {w.value for w in wanted}:
                return TlsFiles(cert_path, key_path, made=True)
        except (ValueError, x509.ExtensionNotFound):
            pass
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"raycluster {inventory.cluster} service")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=825))
        .add_extension(x509.SubjectAlternativeName(wanted), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write_private(key_path, pem_key.decode())
    _write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM).decode())
    return TlsFiles(cert_path, key_path, made=True)


def given_pair(inventory: Inventory, cert: str, key: str) -> TlsFiles:
    """The operator's pair, checked to be one (the key signs for the certificate), copied into the state folder
    so that `status` and `bench --serve` verify the service with it later."""
    try:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"--tls-cert {cert} / --tls-key {key}: {exc}", "give a PEM certificate and its key") from None
    folder = ensure_private_dir(tls_dir(inventory))
    _write_private(folder / "cert.pem", Path(cert).read_text())
    _write_private(folder / "key.pem", Path(key).read_text())
    return TlsFiles(folder / "cert.pem", folder / "key.pem")


def put_tls(inventory: Inventory, connect: Connect, files: TlsFiles) -> tuple[str, str]:
    """The pair into the head's container; the paths the launcher gives Ray Serve's proxy."""
    transport, head = _head(inventory, connect)
    cert, key = f"{TLS_IN_CONTAINER}/cert.pem", f"{TLS_IN_CONTAINER}/key.pem"
    put_in_head(transport, head, key, files.key.read_bytes())
    put_in_head(transport, head, cert, files.cert.read_bytes())
    return cert, key


def service_cert(inventory: Inventory) -> Path | None:
    """The certificate this machine verifies the service with (None: the service is plain HTTP, or unknown)."""
    path = tls_dir(inventory) / "cert.pem"
    return path if path.exists() else None


def client_context(cert: Path | None) -> ssl.SSLContext:
    """What our clients verify an https service with: the system's CAs and the service's own certificate, the
    certificate itself trusted as the end of its chain (a self-signed one, or an operator's leaf)."""
    context = ssl.create_default_context()
    if cert is not None:
        context.load_verify_locations(cafile=str(cert))
        context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return context


def forget_tls(inventory: Inventory) -> None:
    """A plain-HTTP deployment: this machine's clients must not expect the earlier service's certificate."""
    for name in ("cert.pem", "key.pem"):
        (tls_dir(inventory) / name).unlink(missing_ok=True)
