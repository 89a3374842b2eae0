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


def test_per_request_headers_are_kept_apart_in_order_and_the_rest_is_shared() -> None:
    common = b"accept: application/json\r\nuser-agent: OpenAI/Python 1.54.4\r\n"
    assert app._split_per_request(common) == (common, b"")
    assert app._split_per_request(common)[0] is common  # nothing to split: the same object, no copy
    first = (
        b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n" + common
        + b"tracestate: congo=t61rcWkgMzE\r\nx-b3-traceid: 80f198ee56343ba8\r\nx-traceparent-ish: kept\r\n"
    )  # fmt: skip
    shared, own = app._split_per_request(first)
    assert shared == common + b"x-traceparent-ish: kept\r\n"  # only whole names: a look-alike stays shared
    assert own == (
        b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n"
        b"tracestate: congo=t61rcWkgMzE\r\nx-b3-traceid: 80f198ee56343ba8\r\n"
    )
    second = first.replace(b"b7ad6b7169203331", b"00f067aa0ba902b7")
    app._HEADER_BLOCKS.clear()
    shared_second = app._split_per_request(second)[0]
    assert shared_second is not shared  # two requests' blocks, two objects...
    assert app._shared_header_block(shared) is app._shared_header_block(shared_second)  # ...then one
    app._HEADER_BLOCKS.clear()
