"""The compact form of a routing trace in a completion record (`CompletionRecord.routing`).

A trace is the experts the serving engine chose for every token it ran, per MoE layer:
int16 [L, P, K] (layers, positions, experts per token), -1 where a position's route is
unknown (serving/routes.py). On the wire and in SQL it is text, `"L,P,K:" + base64(zstd(bytes))`:
a 2,048-token prompt of a 48-layer, top-8 model is 786,432 ids, 1.5 MB as int16, a few hundred
KB once compressed (neighbouring tokens share experts, and ids are small), where a JSON list of
lists would be over 3 MB.
"""

from __future__ import annotations

import base64
import re

import numpy as np
import zstandard

_FORM = re.compile(r"^(\d+),(\d+),(\d+):([A-Za-z0-9+/=]*)$")
MAX_CHARS = 4_000_000
"""The longest trace a record may carry (about a 5,000-token request of a 48-layer, top-8 MoE)."""
MAX_IDS = 16 * 1024 * 1024
"""The most ids a trace may declare: its size is checked before anything is decompressed."""


def encode_routing(ids_LPK) -> str:
    a = np.asarray(ids_LPK, dtype=np.int16)
    if a.ndim != 3:
        raise ValueError(f"a routing trace is [layers, positions, experts per token], got shape {a.shape}")
    data = zstandard.ZstdCompressor(level=3).compress(np.ascontiguousarray(a).astype("<i2").tobytes())
    return f"{a.shape[0]},{a.shape[1]},{a.shape[2]}:" + base64.b64encode(data).decode("ascii")


def decode_routing(text: str) -> np.ndarray:
    """int16 [L, P, K]; ValueError for anything that is not a well-formed trace."""
    m = _FORM.match(text)
    if not m:
        raise ValueError("a routing trace is 'L,P,K:' followed by base64")
    L, P, K = (int(x) for x in m.groups()[:3])
    if L * P * K > MAX_IDS:
        raise ValueError(f"a routing trace holds at most {MAX_IDS} expert ids, not [{L}, {P}, {K}]")
    try:
        raw = zstandard.ZstdDecompressor().decompress(base64.b64decode(m.group(4)), max_output_size=2 * L * P * K or 1)
    except (ValueError, zstandard.ZstdError) as e:
        raise ValueError(f"the routing trace does not decompress: {e}") from None
    if len(raw) != 2 * L * P * K:
        raise ValueError(f"the routing trace holds {len(raw)} bytes, not the {2 * L * P * K} of [{L}, {P}, {K}] int16")
    a = np.frombuffer(raw, dtype="<i2").reshape(L, P, K).astype(np.int16)
    if a.size and int(a.min()) < -1:
        raise ValueError("the routing trace holds expert ids below -1")
    return a


def check_routing(text: str) -> str:
    """The schema's check: well-formed, and within MAX_CHARS (decoded, so a bad trace is refused
    where it enters, not where the learner reads it)."""
    if len(text) > MAX_CHARS:
        raise ValueError(f"a routing trace is at most {MAX_CHARS} characters")
    decode_routing(text)
    return text
