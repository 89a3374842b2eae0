"""The forwarded header blocks of waiting requests are shared when equal, and the table is bounded."""

from __future__ import annotations

from clairvoyant.proxy import app


def test_equal_header_blocks_are_one_object_and_the_table_stays_bounded() -> None:
    app._HEADER_BLOCKS.clear()
    first = b"".join([b"content-type: application/json\r\n", b"user-agent: OpenAI/Python 1.54.0\r\n"])
    second = b"".join([b"content-type: application/json\r\n", b"user-agent: OpenAI/Python 1.54.0\r\n"])
    assert first is not second  # the premise: two requests' blocks are two objects
    assert app._shared_header_block(first) is first
    assert app._shared_header_block(second) is first  # the second request holds the first one's block
    for i in range(app._HEADER_BLOCKS_MAX + 10):  # a client varying its headers
        app._shared_header_block(b"x-trace: %d\r\n" % i)
    assert len(app._HEADER_BLOCKS) <= app._HEADER_BLOCKS_MAX
    app._HEADER_BLOCKS.clear()
