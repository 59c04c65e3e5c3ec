"""The stream's heartbeats against a client slow to take the closing frames, read with the
OpenAI SDK's own SSE decoder (no server: the chunk sender alone, over a recording response)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from openai._streaming import SSEDecoder

import gateway.chat
from actors.conversation import TurnResult
from actors.models.port import Usage
from eventstore.tasks import cancel_and_wait
from gateway.chat import _ChunkSender
from gateway.state import CURSORS


class _SlowClient:
    """A response whose client takes a frame with an `id:` (the finishing chunk) slowly,
    as one that stopped reading for a while would: its write waits for the buffer to drain."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.written: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.written.append(data)
        if b"\nid: " in b"\n" + data:
            await asyncio.sleep(self.stall_s)


def _sender(client: _SlowClient) -> _ChunkSender:
    app = web.Application()
    app[CURSORS] = cast(Any, SimpleNamespace(seal=lambda cursor: f"sealed-{cursor}"))
    request = make_mocked_request("POST", "/v1/chat/completions", app=app)
    turn = SimpleNamespace(
        completion_id="chatcmpl-1",
        created=1_700_000_000,
        model="m",
        command=SimpleNamespace(model="m"),
    )
    return _ChunkSender(request, cast(Any, client), cast(Any, turn), include_usage=True)


async def test_no_heartbeat_follows_the_finishing_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding: a write's time was noted before it was awaited, so a finishing chunk
    that waited on a slow client for a heartbeat's period let a heartbeat out after it. The
    SDKs keep an event's `id:` and then read every blank line as an event: that heartbeat
    reached them as an empty event and failed to parse, after a turn that had succeeded."""
    monkeypatch.setattr(gateway.chat, "STREAM_HEARTBEAT_S", 0.02)
    client = _SlowClient(stall_s=0.2)
    sender = _sender(client)
    keep_alive = asyncio.create_task(sender.keep_alive())
    await sender.delta("hello")
    usage = Usage(prompt_tokens=1, completion_tokens=1)
    result = TurnResult("c1", "t1", "m1", "m", "hello", "stop", usage, 5, cursor="7")
    await sender.finish(result)
    await cancel_and_wait(keep_alive)

    events = list(SSEDecoder().iter_bytes(iter([b"".join(client.written)])))
    assert events[-1].data == "[DONE]"
    parsed = [orjson.loads(e.data) for e in events[:-1]]  # every other event is a chunk
    assert parsed[-1]["usage"]["total_tokens"] == 2
    assert events[-2].id == "sealed-7"


async def test_a_write_waiting_on_the_client_counts_as_activity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While a delta waits for a slow client its bytes are on their way: no heartbeat is
    stacked behind it; one follows only a heartbeat's period after the write ends."""
    monkeypatch.setattr(gateway.chat, "STREAM_HEARTBEAT_S", 0.05)
    client = _SlowClient(stall_s=0.0)
    sender = _sender(client)
    stalled = asyncio.Event()

    async def slow_write(data: bytes) -> None:
        client.written.append(data)
        await stalled.wait()

    client.write = slow_write  # type: ignore[method-assign]
    # The delta first: a heartbeat's period may pass before the tasks' first steps on a busy
    # host, and a keep-alive that ran first would rightly send one before the delta.
    writing = asyncio.create_task(sender.delta("hello"))
    keep_alive = asyncio.create_task(sender.keep_alive())
    await asyncio.sleep(0.3)
    assert client.written == [client.written[0]] and b"hello" in client.written[0]
    stalled.set()
    await writing
    await asyncio.sleep(0.2)
    assert b": \n\n" in client.written[1:]
    await cancel_and_wait(keep_alive)
