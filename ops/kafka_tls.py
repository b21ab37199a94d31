"""Certificates for the local broker's SASL_SSL listener: a CA of its own and a broker certificate.

`flywheel up` with `kafka.local_listener = "sasl_ssl"` calls `ensure_broker_tls`. It writes, in
the broker's data folder (owner-only, never in the repository):

- `ca.pem`: the CA certificate, which clients trust (`kafka.ssl_cafile` points at it);
- `broker.pem`: the broker's private key, its certificate and the CA, a PEM keystore that
  Kafka reads with `ssl.keystore.type=PEM`.

The CA's private key is never written: it signs the broker certificate once and is dropped, so
nothing on disk can sign another certificate that clients would trust. When the certificate no
longer covers the broker's host, or is about to expire, a new CA and certificate replace both.

The broker certificate serves the client listener and, presented as a client certificate, the
broker's own connections to its mutual-TLS controller listener.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from feedback.core.files import open_private, private_dir

CA_DAYS = 3650
BROKER_DAYS = 825  # the longest leaf lifetime clients commonly accept
RENEW_BEFORE = dt.timedelta(days=30)


@dataclass(frozen=True)
class Credential:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_ca(common_name: str, *, now: dt.datetime, days: int = CA_DAYS) -> Credential:
    """A self-signed CA that may sign leaf certificates only (path length 0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))  # tolerate a little clock skew
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Credential(cert, key)


def make_leaf(ca: Credential, hosts: list[str], *, now: dt.datetime, days: int = BROKER_DAYS) -> Credential:
    """A certificate for `hosts` (names or IP addresses), signed by `ca`, for TLS servers and clients."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in dict.fromkeys(hosts)]), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    return Credential(cert, key)


def pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    # Unencrypted PKCS#8: the JDK cannot read the PBES2-encrypted form `cryptography` writes, and
    # the file is owner-only in an owner-only folder.
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@dataclass(frozen=True)
class BrokerTLS:
    ca: Path  # the CA certificate clients trust
    keystore: Path  # the broker's key, certificate and CA (Kafka's PEM keystore)

    @classmethod
    def under(cls, folder: Path) -> BrokerTLS:
        return cls(ca=folder / "ca.pem", keystore=folder / "broker.pem")


def broker_hosts(host: str) -> list[str]:
    """The names the broker certificate holds: the configured host, and localhost both ways."""
    return list(dict.fromkeys([host, "localhost", "127.0.0.1"]))


def current(tls: BrokerTLS, hosts: list[str], *, now: dt.datetime) -> bool:
    """Do the files exist, cover every host, and stay valid for a while yet?"""
    if not (tls.ca.is_file() and tls.keystore.is_file()):
        return False
    try:
        cert = x509.load_pem_x509_certificate(tls.keystore.read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    held = {str(n) for n in names.get_values_for_type(x509.IPAddress)} | set(names.get_values_for_type(x509.DNSName))
    return set(hosts) <= held and cert.not_valid_after_utc - now > RENEW_BEFORE


def ensure_broker_tls(folder: Path, host: str, *, now: dt.datetime | None = None) -> tuple[BrokerTLS, bool]:
    """The broker's TLS files in `folder`, made anew unless `current`; returns them and whether they are new."""
    now = now or dt.datetime.now(dt.UTC)
    tls = BrokerTLS.under(private_dir(folder))
    hosts = broker_hosts(host)
    if current(tls, hosts, now=now):
        return tls, False
    ca = make_ca("Flywheel local Kafka CA", now=now)
    broker = make_leaf(ca, hosts, now=now)
    with open_private(tls.keystore) as f:
        f.write(pem_key(broker.key) + pem_cert(broker.cert) + pem_cert(ca.cert))
    with open_private(tls.ca) as f:
        f.write(pem_cert(ca.cert))
    return tls, True
