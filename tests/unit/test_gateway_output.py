"""The guard's view of the caller's connection (edges/gateway/guard.py): the transport uvicorn
writes to (a held response head leaves with what follows it), and the connection a request's
task finds in its context."""

from __future__ import annotations

import asyncio

from prefixroute.edges.gateway.guard import HeadGuard, Output, connection


class Transport:
    def __init__(self):
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed


def test_writes_pass_through_when_nothing_is_held():
    transport = Transport()
    output = Output(transport)
    output.write(b"a")
    output.write(b"b")
    assert transport.writes == [b"a", b"b"]


def test_a_held_head_leaves_in_one_write_with_the_body():
    transport = Transport()
    output = Output(transport)
    output.hold()
    output.write(b"HEAD")
    assert transport.writes == []
    output.write(b"BODY")
    assert transport.writes == [b"HEADBODY"]


def test_a_taken_head_is_the_takers_and_release_writes_nothing_more():
    transport = Transport()
    output = Output(transport)
    output.hold()
    output.write(b"HEAD")
    assert output.take() == b"HEAD"
    output.release()
    assert transport.writes == []


def test_release_writes_a_head_nothing_followed():
    transport = Transport()
    output = Output(transport)
    output.hold()
    output.write(b"HEAD")
    output.release()
    assert transport.writes == [b"HEAD"]


def test_asking_the_transport_anything_else_sends_the_held_head_first():
    transport = Transport()
    output = Output(transport)
    output.hold()
    output.write(b"HEAD")
    assert output.is_closing() is False
    assert transport.writes == [b"HEAD"]


class TaskStarting:
    """Stands where uvicorn's protocol stands: starts a task for each read, as uvicorn starts
    a request's task inside ``data_received``."""

    def __init__(self, *args, **kwargs):
        self.seen: list = []

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        async def request() -> None:
            self.seen.append(connection.get())
        asyncio.get_running_loop().create_task(request())

    def connection_lost(self, exc) -> None:
        pass

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        pass


def test_a_task_started_inside_the_read_knows_its_connection(monkeypatch):
    monkeypatch.setattr("prefixroute.edges.gateway.guard.HTTPTOOLS_PROTOCOL", TaskStarting)

    async def main():
        guard = HeadGuard()
        guard.connection_made(Transport())  # type: ignore[arg-type]
        guard.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert connection.get() is None  # set only while the bytes are handed on
        await asyncio.sleep(0)
        guard.connection_lost(None)
        return guard

    guard = asyncio.run(main())
    assert guard.inner.seen == [guard]
    assert isinstance(guard.inner.transport, Output)


def test_drain_waits_for_resume_writing(monkeypatch):
    monkeypatch.setattr("prefixroute.edges.gateway.guard.HTTPTOOLS_PROTOCOL", TaskStarting)

    async def main():
        guard = HeadGuard()
        guard.connection_made(Transport())  # type: ignore[arg-type]
        guard.pause_writing()
        waiter = asyncio.ensure_future(guard.drain())
        await asyncio.sleep(0)
        assert not waiter.done()
        guard.resume_writing()
        await asyncio.wait_for(waiter, 5)
        guard.connection_lost(None)

    asyncio.run(main())
