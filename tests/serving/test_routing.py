"""Who a caller is to the router and the rollout evidence: a keyed hash of token and user id."""

import hashlib
import hmac
import os
import stat

from serving.routing import user_hash
from serving.settings import USER_HASH_KEY_FILE, ServingSettings
from tests.serving.conftest import TOKEN, make_client


def test_user_hash_is_an_hmac_under_the_server_key_bound_to_the_token():
    key = b"k" * 32
    h = user_hash(key, token="tok", user="ana")
    assert h == hmac.new(key, b"tok\x00ana", hashlib.sha256).hexdigest()[:32] == user_hash(key, token="tok", user="ana")
    assert user_hash(b"another key", token="tok", user="ana") != h
    # a client that claims another's user id under its own token gets a hash of its own
    assert user_hash(key, token="other", user="ana") != h
    assert user_hash(key, token="tok", user=None) == user_hash(key, token="tok", user="")


def test_a_record_never_carries_a_plain_hash_of_the_editor_token(tok):
    client, sink, _ = make_client(tok)
    assert client.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 2}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 2, "user": "ana"}).status_code == 200
    (_, anonymous), (_, ana) = sink.sent
    plain = hashlib.sha256(TOKEN.encode()).hexdigest()
    assert anonymous.user_hash not in (plain, plain[:32])  # main's unsalted sha256 of the token
    assert ana.user_hash not in (hashlib.sha256(b"ana").hexdigest()[:32], anonymous.user_hash)


def test_the_key_is_kept_owner_only_in_the_data_dir_and_reused(tmp_path):
    old = os.umask(0o022)
    try:
        s = ServingSettings(data_dir=tmp_path / "data").with_user_hash_secret()
    finally:
        os.umask(old)
    path = tmp_path / "data" / USER_HASH_KEY_FILE
    key = s.serve.user_hash_secret.get_secret_value()
    assert len(key) == 64 and path.read_text() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    again = ServingSettings(data_dir=tmp_path / "data").with_user_hash_secret()
    assert again.serve.user_hash_key() == s.serve.user_hash_key() == key.encode()  # restarts hash users alike
    assert sorted(p.name for p in path.parent.iterdir()) == [USER_HASH_KEY_FILE]  # no temporary file left
    mine = ServingSettings(data_dir=tmp_path / "other", serve={"user_hash_secret": "set-by-ops"})
    assert mine.with_user_hash_secret().serve.user_hash_key() == b"set-by-ops"
    assert not (tmp_path / "other").exists()
