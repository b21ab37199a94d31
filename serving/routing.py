"""Which model version serves a user: sticky by a keyed hash of who they are.

`user_hash` is an HMAC under a server key (`serve.user_hash_secret`) of the editor token and,
when the client sends one, its `user` id. Keyed, because analysts read it: a plain sha256 of
a token or a user name can be checked against guesses offline. Bound to the token, because a
`user` id is only what the client says: a client that claims someone else's id gets a hash of
its own, so it cannot spend another user's share of a rollout's evidence (ops/rollout/arms.py)
or of the learner's samples.

A token named in `serve.auth_tokens_file` (`token, user`) belongs to that user: then the hash is
the HMAC of the user's name (`named_user_hash`), the same for each of their tokens, and the
request's `user` field is not read. Canary buckets and per-user limits then follow the person,
without any client sending a user field.

A user's bucket (0 <= b < 100) comes from their hash, so it never changes while the key and
token stay; the canary pool with traffic share w serves the buckets below w
(serving/http/routing.py, RoutingState.pick). Raising a canary's share from 5 to 25 keeps the
first 5% of users on it and adds the next 20%: nobody flips back and forth while a rollout
advances.
"""

from __future__ import annotations

import hashlib
import hmac


def user_hash(key: bytes, *, token: str, user: str | None) -> str:
    """A pseudonymous, stable id for the caller (raw ids and tokens never leave the ingress)."""
    # NUL cannot occur in a bearer token, so (token, user) pairs never collide.
    msg = token.encode("utf-8", "surrogatepass") + b"\x00" + (user or "").encode("utf-8", "surrogatepass")
    return hmac.new(key, msg, hashlib.sha256).hexdigest()[:32]


def named_user_hash(key: bytes, user: str) -> str:
    """The hash of a user the tokens file names, whichever of their tokens they send."""
    # Under a key of its own, derived from the server key: no (token, user) message can give it.
    named_key = hmac.new(key, b"flywheel named users", hashlib.sha256).digest()
    return hmac.new(named_key, user.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:32]


def caller_hash(key: bytes, *, token: str, user: str | None, token_users: dict[str, str]) -> str:
    """`named_user_hash` for a named token, else `user_hash` of the token and `user`."""
    name = token_users.get(token)
    return named_user_hash(key, name) if name is not None else user_hash(key, token=token, user=user)


def bucket(uhash: str) -> float:
    """[0, 100) with 0.01 resolution, uniform over users."""
    return int(hashlib.sha256(f"bucket:{uhash}".encode()).hexdigest()[:8], 16) % 10_000 / 100
