"""net/libp2p_patches.py's receive buffer under py-libp2p's TCP stream: any pattern of
reads returns the bytes sent, in order, never more than asked for."""

from __future__ import annotations

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.io.trio import TrioTCPStream

import compushare.net.libp2p_patches as patches

patches.apply()  # what open_host does before its first host


async def _pair() -> tuple[TrioTCPStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return TrioTCPStream(trio.SocketStream(a)), trio.SocketStream(b)


@settings(max_examples=60, deadline=None)
@given(chunks=st.lists(st.binary(min_size=1, max_size=3000), min_size=1, max_size=12),
       sizes=st.lists(st.one_of(st.none(), st.integers(min_value=1, max_value=5000)), min_size=1, max_size=20))
def test_reads_of_any_size_return_the_stream_in_order(chunks, sizes):
    sent = b"".join(chunks)

    async def main() -> bytes:
        reader, writer = await _pair()
        async with writer:
            for chunk in chunks:
                await writer.send_all(chunk)
        got, i = bytearray(), 0
        with trio.fail_after(5):
            while True:
                n = sizes[i % len(sizes)]
                i += 1
                data = await reader.read(n)
                assert isinstance(data, bytes)
                if not data:
                    break
                assert n is None or len(data) <= n
                got += data
        await reader.close()
        return bytes(got)

    assert trio.run(main) == sent


def test_one_recv_serves_many_small_reads():
    """Noise reads a 2-byte length, then the frame: both come from one recv()."""
    calls = []

    async def main() -> None:
        reader, writer = await _pair()
        original = patches._unbuffered_read

        async def counting(self, n=None):
            calls.append(n)
            return await original(self, n)

        patches._unbuffered_read = counting
        try:
            frames = [len(body).to_bytes(2, "big") + body for body in (b"a" * 100, b"b" * 2000, b"c" * 7)]
            await writer.send_all(b"".join(frames))
            with trio.fail_after(5):
                for frame in frames:
                    length = int.from_bytes(await reader.read(2), "big")
                    assert await reader.read(length) == frame[2:]
        finally:
            patches._unbuffered_read = original
            await writer.aclose()
            await reader.close()

    trio.run(main)
    assert len(calls) == 1


def test_concurrent_readers_never_reorder_bytes():
    async def main() -> bytes:
        reader, writer = await _pair()
        got: list[tuple[int, bytes]] = []

        async def read_some(tag: int) -> None:
            got.append((tag, await reader.read(3)))

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                for tag in range(4):
                    nursery.start_soon(read_some, tag)
                await trio.testing.wait_all_tasks_blocked()  # all four wait: one in recv(), three for its result
                await writer.send_all(b"abcdefghijkl")
        await writer.aclose()
        await reader.close()
        return b"".join(data for _, data in got)

    assert trio.run(main) == b"abcdefghijkl"
