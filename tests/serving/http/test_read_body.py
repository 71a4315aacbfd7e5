"""``read_body`` holds a body once (issue 27, item 4): its messages go into one buffer, not a
list of chunks and then their join, which took twice the body; asserted as allocations
(tracemalloc's peak), never as time."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import Callable

import pytest
from starlette.types import Message

from serving.errors import PayloadTooLargeError
from serving.http.replies import ClientGone, read_body

MiB = 2**20
CHUNK = 64 * 1024  # uvicorn hands on what it buffered up to its high-water mark (64 KiB)


def sender(size: int, *, chunk: int = CHUNK, hang_up_after: int | None = None) -> Callable:
    """An ASGI ``receive`` that gives a ``size``-byte body in messages of ``chunk`` bytes, each
    made as it is received (as uvicorn makes them), byte ``i`` of the body being ``i // chunk``
    modulo 256; a hang-up after ``hang_up_after`` messages."""
    sent = 0
    messages = 0

    async def receive() -> Message:
        nonlocal sent, messages
        if hang_up_after is not None and messages == hang_up_after:
            return {"type": "http.disconnect"}
        n = min(chunk, size - sent)
        body = bytes([(sent // chunk) % 256]) * n
        sent += n
        messages += 1
        return {"type": "http.request", "body": body, "more_body": sent < size}

    return receive


def expected(size: int, chunk: int = CHUNK) -> bytes:
    return b"".join(
        bytes([i % 256]) * min(chunk, size - at) for i, at in enumerate(range(0, size, chunk))
    )


def read(receive: Callable, limit: int, length: int | None) -> tuple[bytes | bytearray, int]:
    """The body ``read_body`` gives, and the peak of what it allocated meanwhile (taken in the
    loop: ``asyncio.run``'s own teardown allocates several times a 4 MiB result)."""

    async def go() -> tuple[bytes | bytearray, int]:
        tracemalloc.start()
        try:
            body = await read_body(receive, limit, 30.0, length)
            return body, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    return asyncio.run(go())


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_4_mib_body_is_held_once(declared: bool) -> None:
    """Before, the chunks and their join: 2.0x the body at the peak."""
    size = 4 * MiB
    body, peak = read(sender(size), 16 * MiB, size if declared else None)
    assert bytes(body) == expected(size)
    assert peak < 1.3 * size, f"peak {peak / size:.2f}x the body"


def test_a_body_in_one_message_is_handed_on_as_it_came() -> None:
    body, _ = read(sender(1000, chunk=1000), 16 * MiB, 1000)
    assert type(body) is bytes
    assert body == expected(1000, 1000)


def test_a_trickler_holds_no_buffer_of_what_it_declared() -> None:
    """A client that declares 16 MiB and sends 1 MiB before it hangs up: the buffer of its
    declared length is allocated only once an eighth of it (2 MiB) has come."""
    peak: list[int] = []

    async def go() -> None:
        tracemalloc.start()
        try:
            await read_body(sender(16 * MiB, hang_up_after=16), 16 * MiB, 30.0, 16 * MiB)
        finally:
            peak.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()

    with pytest.raises(ClientGone):
        asyncio.run(go())
    assert peak[0] < 2 * MiB


@pytest.mark.parametrize("length", [None, 1000], ids=["chunked", "declared-too-short"])
def test_a_body_over_the_limit_is_413(length: int | None) -> None:
    """However it is framed: past ``limit`` bytes it is refused, whatever it declared."""
    with pytest.raises(PayloadTooLargeError, match="over the limit of 1000 bytes"):
        read(sender(3000, chunk=500), 1000, length)


def test_a_body_shorter_or_longer_than_declared_is_read_whole() -> None:
    """The server's parser frames a body by its Content-Length; were it not, the bytes that
    came are the body."""
    for size, declared in ((3000, 4000), (3000, 2000)):
        body, _ = read(sender(size, chunk=500), 16 * MiB, declared)
        assert bytes(body) == expected(size, 500)
