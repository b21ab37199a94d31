"""feedback/routing.py: a routing trace's compact text form round-trips, and bad text is refused."""

from __future__ import annotations

import numpy as np
import pytest

from feedback.routing import MAX_CHARS, check_routing, decode_routing, encode_routing


def test_a_trace_round_trips_with_unknown_positions():
    rng = np.random.default_rng(0)
    trace = rng.integers(0, 128, size=(4, 300, 2)).astype(np.int16)
    trace[:, :16] = -1  # a prefix the engine served from a cache it could not follow
    text = encode_routing(trace)
    assert text.startswith("4,300,2:")
    back = decode_routing(text)
    assert back.dtype == np.int16 and np.array_equal(back, trace)


def test_neighbouring_tokens_sharing_experts_compress_well_below_json():
    trace = np.repeat(np.array([[[3, 7]]], dtype=np.int16), 2048, axis=1).repeat(48, axis=0)  # [48, 2048, 2]
    assert len(encode_routing(trace)) < len(str(trace.tolist())) / 50


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[[[0, 1]]]", "'L,P,K:' followed by base64"),
        ("1,1,2:@@@", "'L,P,K:' followed by base64"),
        ("1,1,2:AAAA", "does not decompress"),
        ("1,1,3:" + encode_routing([[[0, 1]]]).split(":")[1], "holds 4 bytes, not the 6"),
        (encode_routing([[[-2, 1]]]), "below -1"),
        ("100000,100000,8:AAAA", "at most 16777216 expert ids"),
    ],
)
def test_a_malformed_trace_is_refused_saying_why(text, says):
    with pytest.raises(ValueError, match=says):
        decode_routing(text)


def test_a_trace_longer_than_the_limit_is_refused_before_decoding():
    with pytest.raises(ValueError, match="at most"):
        check_routing("1,1,1:" + "A" * MAX_CHARS)


def test_a_trace_must_be_three_dimensional():
    with pytest.raises(ValueError, match="layers, positions, experts per token"):
        encode_routing([[0, 1]])
