"""Header blocks kept decoded (edges/epp/http2.py): whatever an HPACK encoder sends, the
connection's decoding agrees with a plain decoder fed the same blocks, block by block."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

hpack = pytest.importorskip("hpack")

from prefixroute.edges.epp.http2 import HeaderBlocks, leaves_table_alone, literal  # noqa: E402

NAMES = [":path", ":authority", "content-type", "x-forwarded-for", "x-request-id", "te"]
VALUES = ["/a", "/envoy.service.ext_proc.v3.ExternalProcessor/Process", "epp", "trailers",
          "application/grpc", "192.0.2.2", "x" * 130]

field = st.tuples(st.sampled_from(NAMES), st.sampled_from(VALUES),
                  st.sampled_from(["index", "never", "plain"]))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.lists(field, min_size=1, max_size=6), st.booleans(),
                          st.integers(0, 3)), min_size=1, max_size=25))
def test_kept_blocks_decode_as_a_plain_decoder_decodes_them(blocks):
    encoder = hpack.Encoder()
    kept, plain = HeaderBlocks(), hpack.Decoder()
    for fields, huffman, repeat in blocks:
        if all(kind == "plain" for _, _, kind in fields):
            # literals without indexing (what Envoy sends for :path), written by hand
            block = b"".join(literal(n.encode(), v.encode()) for n, v, _ in fields)
        else:
            headers = [hpack.NeverIndexedHeaderTuple(n, v) if kind == "never"
                       else hpack.HeaderTuple(n, v) for n, v, kind in fields]
            block = encoder.encode(headers, huffman=huffman)
        for _ in range(1 + repeat):  # the same bytes again: decoded from the kept ones
            assert kept.decode(block) == plain.decode(block, raw=True)


def test_what_leaves_the_table_alone_by_hand():
    path = literal(b":path", b"/x")  # literal without indexing, new name
    assert leaves_table_alone(b"\x83\x86" + path)  # indexed fields and the literal
    assert leaves_table_alone(b"\x10\x01a\x01b")  # never indexed, new name
    assert not leaves_table_alone(b"\x40\x01a\x01b")  # incremental indexing
    assert not leaves_table_alone(b"\x20")  # a table size update
    assert not leaves_table_alone(b"\x00\x05ab")  # cut short
    assert leaves_table_alone(b"\xff\x80\x01")  # an index past 127 (two more bytes)
