"""Which model version serves a user: sticky by a keyed hash of who they are.

`user_hash` is an HMAC under a server key (`serve.user_hash_secret`) of the editor token and,
when the client sends one, its `user` id. Keyed, because analysts read it: a plain sha256 of
a token or a user name can be checked against guesses offline. Bound to the token, because a
`user` id is only what the client says: a client that claims someone else's id gets a hash of
its own, so it cannot spend another user's share of a rollout's evidence (ops/rollout/arms.py)
or of the learner's samples.

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


def bucket(uhash: str) -> float:
    """[0, 100) with 0.01 resolution, uniform over users."""
    return int(hashlib.sha256(f"bucket:{uhash}".encode()).hexdigest()[:8], 16) % 10_000 / 100
