"""The delta channel between workers and gateways (cluster/serving/delta_channel.py), over real
TCP connections on this host: what one engine step hands to a worker's event loop goes
to each gateway as one frame, and a broken connection fails the requests on it."""

import asyncio

import pytest

from cluster.engine.outputs import RequestOutput
from cluster.serving.delta_channel import DeltaChannelError, DeltaReceiver, DeltaSender, _frame


def delta(request_id: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, [token], f"<{token}>", finished, "length" if finished else None, 4, token, 0)


async def until(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


async def listening() -> tuple[DeltaReceiver, tuple]:
    """A gateway's receiver listening on this host, and the address workers send to."""
    receiver = DeltaReceiver("127.0.0.1")
    return receiver, await receiver.start()


def test_a_loop_turn_of_deltas_is_one_frame_and_each_request_gets_its_own_in_order():
    async def main():
        receiver, address = await listening()
        queues = {rid: receiver.subscribe(rid) for rid in ("a", "b", "c")}
        sender = DeltaSender()
        conn = sender.connection(address)
        await until(lambda: sender.counts["connections"] == 1)
        for step in range(3):  # three engine steps, each handing the loop every request's delta at once
            for rid in queues:
                conn.send(delta(rid, 10 * step + ord(rid)))
            await until(lambda s=step: receiver.counts["frames"] == s + 1)
        assert receiver.counts["deltas"] == sender.counts["deltas"] == 9
        assert sender.counts["frames"] == 3
        for rid, queue in queues.items():
            got = [queue.get_nowait().new_token_ids[0] for _ in range(3)]
            assert got == [ord(rid), 10 + ord(rid), 20 + ord(rid)]
            assert queue.empty()
        sender.close()
        await receiver.close()

    asyncio.run(main())


def test_deltas_nobody_waits_for_are_dropped():
    async def main():
        receiver, address = await listening()
        kept = receiver.subscribe("kept")
        receiver.subscribe("gone")
        receiver.unsubscribe("gone")  # cancelled: its late deltas must go nowhere
        sender = DeltaSender()
        conn = sender.connection(address)
        conn.send(delta("gone", 1))
        conn.send(delta("kept", 2, finished=True))
        await until(lambda: receiver.counts["deltas"] == 2)
        assert receiver.counts["dropped"] == 1
        assert kept.get_nowait().finished
        with pytest.raises(ValueError, match="already subscribed"):
            receiver.subscribe("kept")
        sender.close()
        await receiver.close()

    asyncio.run(main())


def test_a_peer_without_the_token_is_refused_before_anything_is_unpickled():
    async def main():
        receiver, (host, port, _) = await listening()
        queue = receiver.subscribe("r")
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(_frame(b"not the token"))
        writer.write(_frame(b"\x80\x05 this would be a pickle"))
        await writer.drain()
        assert await reader.read() == b""  # closed on us
        writer.close()
        assert receiver.counts["refused"] == 1
        assert receiver.counts["frames"] == 0 and queue.empty()
        await receiver.close()

    asyncio.run(main())


def test_a_broken_connection_fails_the_requests_on_it_and_the_next_request_reconnects():
    async def main():
        receiver, address = await listening()
        queue = receiver.subscribe("r1")
        sender = DeltaSender()
        first = sender.connection(address)
        first.send(delta("r1", 1))
        await until(lambda: receiver.counts["deltas"] == 1)
        await receiver.close()  # the gateway goes away mid-request
        await until(lambda: first.error is not None)
        with pytest.raises(DeltaChannelError, match="failed"):
            first.send(delta("r1", 2))  # never a gap in r1's stream: it fails
        assert queue.qsize() == 1

        receiver2, address2 = await listening()  # a gateway listening again
        queue2 = receiver2.subscribe("r2")
        second = sender.connection(address2)
        assert second is not first
        second.send(delta("r2", 7, finished=True))
        await until(lambda: not queue2.empty())
        assert queue2.get_nowait().new_token_ids == [7]
        sender.close()
        await receiver2.close()

    asyncio.run(main())


def test_an_unreachable_gateway_fails_the_send():
    async def main():
        receiver, address = await listening()
        await receiver.close()  # nobody listens on that port any more
        sender = DeltaSender()
        conn = sender.connection(address)
        conn.send(delta("r", 1))  # queued while connecting
        await until(lambda: conn.error is not None)
        with pytest.raises(DeltaChannelError):
            conn.send(delta("r", 2))
        assert sender.counts["failures"] == 1
        assert sender.connection(address) is not conn  # a later request tries again

    asyncio.run(main())
