"""The local broker's CA and certificate: what they hold, where they go, when they are renewed."""

import datetime as dt
import socket
import ssl
import stat
import threading

from cryptography import x509

from ops import kafka_tls

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _handshake(tls: kafka_tls.BrokerTLS, server_name: str) -> str:
    """A TLS handshake between a server holding the keystore and a client trusting only the CA."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tls.keystore)
    client_ctx = ssl.create_default_context(cafile=str(tls.ca))
    a, b = socket.socketpair()
    errors = []

    def serve():
        try:
            with server_ctx.wrap_socket(a, server_side=True) as s:
                s.recv(1)
        except OSError as e:
            errors.append(e)

    t = threading.Thread(target=serve)
    t.start()
    try:
        with client_ctx.wrap_socket(b, server_hostname=server_name) as c:
            c.sendall(b"x")
            return c.version()
    finally:
        t.join(10)


def test_broker_files_verify_against_their_ca_and_are_owner_only(tmp_path):
    tls, made = kafka_tls.ensure_broker_tls(tmp_path / "tls", "127.0.0.1")
    assert made
    for f in (tls.ca, tls.keystore):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "tls").stat().st_mode) == 0o700
    keystore = tls.keystore.read_bytes()
    assert b"PRIVATE KEY" in keystore and b"ENCRYPTED" not in keystore  # the JDK reads only this form
    assert b"PRIVATE KEY" not in tls.ca.read_bytes()  # the CA's key is never written
    ca = x509.load_pem_x509_certificate(tls.ca.read_bytes())
    leaf = x509.load_pem_x509_certificate(keystore)
    leaf.verify_directly_issued_by(ca)
    for name in ("127.0.0.1", "localhost"):
        assert _handshake(tls, name).startswith("TLSv1.")


def test_a_certificate_for_another_host_fails_the_hostname_check(tmp_path):
    tls, _ = kafka_tls.ensure_broker_tls(tmp_path, "127.0.0.1")
    try:
        _handshake(tls, "kafka.example.com")
    except ssl.SSLCertVerificationError as e:
        assert "mismatch" in str(e) or "match" in str(e)
    else:
        raise AssertionError("a certificate without the name was accepted")


def test_files_are_kept_while_current_and_renewed_for_a_new_host_or_near_expiry(tmp_path):
    tls, made = kafka_tls.ensure_broker_tls(tmp_path, "127.0.0.1", now=NOW)
    first = tls.keystore.read_bytes()
    assert made
    assert kafka_tls.ensure_broker_tls(tmp_path, "127.0.0.1", now=NOW + dt.timedelta(days=30)) == (tls, False)
    assert tls.keystore.read_bytes() == first
    _, made = kafka_tls.ensure_broker_tls(tmp_path, "10.0.0.7", now=NOW)
    assert made
    names = x509.load_pem_x509_certificate(tls.keystore.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert {str(ip) for ip in names.value.get_values_for_type(x509.IPAddress)} == {"10.0.0.7", "127.0.0.1"}
    late = NOW + dt.timedelta(days=kafka_tls.BROKER_DAYS) - kafka_tls.RENEW_BEFORE + dt.timedelta(days=1)
    assert kafka_tls.ensure_broker_tls(tmp_path, "10.0.0.7", now=late)[1]


def test_a_damaged_keystore_is_replaced(tmp_path):
    tls, _ = kafka_tls.ensure_broker_tls(tmp_path, "127.0.0.1")
    tls.keystore.write_bytes(b"garbage")
    assert kafka_tls.ensure_broker_tls(tmp_path, "127.0.0.1")[1]
    assert _handshake(tls, "127.0.0.1")
