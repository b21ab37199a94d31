"""Who a caller is to the router and the rollout evidence: a keyed hash of token and user id."""

import hashlib
import hmac
import os
import stat

import pytest

from feedback.core.errors import UserError
from serving.routing import caller_hash, named_user_hash, user_hash
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


# --- named tokens: `token, user` lines in serve.auth_tokens_file ---


def tokens_file(tmp_path, text: str):
    path = tmp_path / "tokens"
    path.write_text(text)
    return path


def test_a_named_users_tokens_share_one_hash_and_one_rate_limit(tok, tmp_path):
    path = tokens_file(tmp_path, "# editors\nalice-laptop, alice\n alice-desktop ,alice\nbob-1, bob\n\nplain-token\n")
    client, sink, _ = make_client(
        tok, auth_tokens=[], auth_tokens_file=path, user_hash_secret="s" * 32, limits={"completions": "3 per minute"}
    )
    body = {"prompt": "x = ", "max_tokens": 2}

    def ask(token, **extra):
        return client.post("/v1/completions", json=body | extra, headers={"Authorization": f"Bearer {token}"})

    assert ask("alice-laptop").status_code == 200
    assert ask("alice-desktop", user="somebody-else").status_code == 200  # the user field is not read
    assert ask("bob-1").status_code == 200
    assert ask("plain-token", user="alice").status_code == 200
    alice, alice_too, bob, plain = (rec.user_hash for _, rec in sink.sent)
    assert alice == alice_too == named_user_hash(b"s" * 32, "alice")
    assert len({alice, bob, plain}) == 3
    assert plain == user_hash(b"s" * 32, token="plain-token", user="alice")
    # alice's third request is over her limit, whichever token she uses; bob's limit is his own.
    assert ask("alice-desktop").status_code == 200
    r = ask("alice-laptop")
    assert r.status_code == 429 and "Retry-After" in r.headers
    assert ask("bob-1").status_code == 200


def test_the_other_completion_routes_hash_a_named_user_alike(tok, tmp_path):
    path = tokens_file(tmp_path, "t1, carol\nt2, carol\n")
    client, sink, _ = make_client(tok, auth_tokens=[], auth_tokens_file=path, user_hash_secret="s" * 32)
    h = {"Authorization": "Bearer t1"}
    assert client.post("/infill", json={"input_prefix": "x = ", "n_predict": 2}, headers=h).status_code == 200
    h = {"Authorization": "Bearer t2"}
    r = client.post("/api/generate", json={"model": "flywheel", "prompt": "x = ", "stream": False}, headers=h)
    assert r.status_code == 200
    assert {rec.user_hash for _, rec in sink.sent} == {named_user_hash(b"s" * 32, "carol")}


@pytest.mark.parametrize(
    "text, line",
    [
        ("good, alice\nsecret-tok, alice, extra\n", 2),
        ("secret-tok,\n", 1),
        (", alice\n", 1),
        ("ok\n# note\nsecret tok, alice\n", 3),
        ("secret-tok, alice\nsecret-tok, bob\n", 2),
        ("secret-tok\nsecret-tok, bob\n", 2),
    ],
)
def test_a_malformed_tokens_file_is_refused_naming_the_line_not_the_token(tmp_path, text, line):
    from ops.cli.serve import check_ready

    s = ServingSettings(data_dir=tmp_path, serve={"auth_tokens_file": tokens_file(tmp_path, text)})
    with pytest.raises(UserError) as e:
        check_ready(s)
    msg = str(e.value)
    assert f"line {line}" in msg and "secret" not in msg and "\n" not in msg


def test_ops_tokens_cannot_be_named(tmp_path):
    s = ServingSettings(data_dir=tmp_path, serve={"ops_tokens_file": tokens_file(tmp_path, "op-secret, alice\n")})
    with pytest.raises(ValueError, match="line 1") as e:
        s.serve.ops_token_set()
    assert "op-secret" not in str(e.value)


def test_named_and_token_hashes_never_collide():
    key = b"k" * 32
    assert named_user_hash(key, "ana") != user_hash(key, token="", user="user\x00ana")
    assert caller_hash(key, token="t", user="x", token_users={"t": "ana"}) == named_user_hash(key, "ana")
    assert caller_hash(key, token="u", user="x", token_users={"t": "ana"}) == user_hash(key, token="u", user="x")
