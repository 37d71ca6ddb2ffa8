"""A throwaway local certificate authority for mTLS between Tandem's services.

Every service certificate names its **role** and **id** in a SPIFFE-style URI SAN, which the
servers read back from the peer certificate (``services.common.peers``)::

    spiffe://tandem/<role>/<id>      role: kvstore | worker | router | client
    e.g. spiffe://tandem/worker/gpu0 (+ CN=gpu0, OU=worker for people reading the cert)

The certificates also carry DNS/IP SANs for the host names the services are dialled by
(``localhost``, ``127.0.0.1``, compose service names), so hostname verification stays on.
``tandem up`` calls :func:`make_local_pki` for a fresh CA per run; ``tandem certs`` writes one
for compose. Keys are ECDSA P-256 (fast handshakes), certificates valid ``days`` days.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InvalidArgument

ROLES = ("kvstore", "worker", "router", "client")
SPIFFE_PREFIX = "spiffe://tandem/"
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")


def identity_uri(role: str, ident: str) -> str:
    """The URI SAN naming ``role`` and ``ident`` (pure)."""
    if role not in ROLES:
        raise InvalidArgument(f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
    if not ident or "/" in ident or len(ident.encode()) > 128:
        raise InvalidArgument(f"certificate id must be 1-128 bytes without '/', got {ident!r}")
    return f"{SPIFFE_PREFIX}{role}/{ident}"


def parse_identity_uri(uri: str) -> tuple[str, str] | None:
    """(role, id) of a Tandem identity URI, or None if ``uri`` is not one (pure)."""
    if not uri.startswith(SPIFFE_PREFIX):
        return None
    role, _, ident = uri[len(SPIFFE_PREFIX):].partition("/")
    if role not in ROLES or not ident or "/" in ident:
        return None
    return role, ident


@dataclass(frozen=True)
class CertFiles:
    """PEM paths of one identity: its certificate, its key and the CA that signed it."""

    cert: str
    key: str
    ca: str


def _crypto():
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise InvalidArgument(f"making certificates needs the 'cryptography' package: {exc}") from None
    return x509, hashes, serialization, ec, NameOID


class LocalCA:
    """An in-memory CA that issues role certificates (see the module docstring)."""

    def __init__(self, *, days: int = 30, name: str = "tandem local CA"):
        x509, hashes, _serialization, ec, NameOID = _crypto()
        self.days = days
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(self._key, hashes.SHA256())
        )

    @property
    def cert_pem(self) -> bytes:
        _x509, _h, serialization, _ec, _n = _crypto()
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, role: str, ident: str, hosts: tuple[str, ...] = DEFAULT_HOSTS) -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) for ``role``/``ident``, valid for ``hosts``."""
        x509, hashes, serialization, ec, NameOID = _crypto()
        uri = identity_uri(role, ident)
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list = [x509.UniformResourceIdentifier(uri)]
        for host in dict.fromkeys(hosts):
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([
                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                x509.NameAttribute(NameOID.COMMON_NAME, ident),
            ]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=self.days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return cert.public_bytes(serialization.Encoding.PEM), key_pem

    def write(self, directory: str | Path, role: str, ident: str, hosts: tuple[str, ...] = DEFAULT_HOSTS) -> CertFiles:
        """Issue ``role``/``ident`` and write ``<role>-<id>.crt/.key`` plus ``ca.crt`` (key 0600)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        cert, key = self.issue(role, ident, hosts)
        ca_path = directory / "ca.crt"
        if not ca_path.exists():
            ca_path.write_bytes(self.cert_pem)
        stem = directory / f"{role}-{ident}"
        cert_path, key_path = stem.with_suffix(".crt"), stem.with_suffix(".key")
        cert_path.write_bytes(cert)
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        return CertFiles(str(cert_path), str(key_path), str(ca_path))


def make_local_pki(directory: str | Path, identities: list[tuple[str, str]],
                   hosts: tuple[str, ...] = DEFAULT_HOSTS) -> dict[tuple[str, str], CertFiles]:
    """A fresh CA and one certificate per (role, id) in ``directory`` (mutates the folder)."""
    ca = LocalCA()
    return {(role, ident): ca.write(directory, role, ident, hosts) for role, ident in identities}
