"""The OpenAI-compatible provider's two ways of asking: a stream of chunks when someone reads
the deltas, one `chat.completion` when only the outcome is read; and its SSE line splitting."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import stub_upstream

from actors.models.openai_compat import OpenAICompatProvider, _sse_data
from actors.models.port import ChatMessage, Finished, ModelEvent, ModelRequest, TextDelta
from schemas.errors import UpstreamError


@pytest.fixture
async def stub() -> AsyncIterator[Any]:
    server = await stub_upstream.StubUpstream(tokens=5).start()
    yield server
    await server.stop()


async def collect(base_url: str, *, stream: bool) -> list[ModelEvent]:
    provider = OpenAICompatProvider(base_url=base_url, model="stub-model", retries=0)
    request = ModelRequest(
        model="stub-model", messages=(ChatMessage("user", "hello there"),), stream=stream
    )
    try:
        return [event async for event in provider.stream(request)]
    finally:
        await provider.aclose()


async def test_an_outcome_only_request_asks_for_one_completion(stub: Any) -> None:
    events = await collect(stub.base_url, stream=False)

    assert stub.bodies[0]["stream"] is False
    assert "stream_options" not in stub.bodies[0]
    assert events[:-1] == [TextDelta("tok0 tok1 tok2 tok3 tok4 ")]
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.finish_reason == "stop"
    assert (finished.usage.prompt_tokens, finished.usage.completion_tokens) == (2, 5)


async def test_a_streamed_request_gets_every_chunk_with_the_same_outcome(stub: Any) -> None:
    events = await collect(stub.base_url, stream=True)

    assert stub.bodies[0]["stream"] is True
    assert stub.bodies[0]["stream_options"] == {"include_usage": True}
    assert [e.text for e in events if isinstance(e, TextDelta)] == [f"tok{i} " for i in range(5)]
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.finish_reason == "stop"
    assert (finished.usage.prompt_tokens, finished.usage.completion_tokens) == (2, 5)


async def test_a_model_server_nobody_answers_for_is_named_by_its_setting() -> None:
    """QA finding: "model server unavailable after 4 attempts: ClientConnectorError" told an
    operator neither what failed nor where to look."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/v1"
    with pytest.raises(UpstreamError) as caught:
        await collect(url, stream=True)
    assert caught.value.code == "upstream_unavailable"
    assert "could not connect (ClientConnectorError)" in caught.value.message
    assert "SVC_LLM_GATEWAY_URL" in caught.value.message and "127.0.0.1" not in str(caught.value)


class _Chunks:
    """An `aiohttp.StreamReader` stand-in that hands out fixed pieces of bytes.

    `iter_any` returns a plain async iterator, as aiohttp's does, not an async generator: a
    generator abandoned by a reader that raised would be closed later by a task of its own,
    which outlives the test."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self._pieces = iter(pieces)

    def iter_any(self) -> _Chunks:
        return self

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        try:
            return next(self._pieces)
        except StopIteration:
            raise StopAsyncIteration from None


async def events_of(pieces: Sequence[bytes]) -> list[str]:
    return [data async for data in _sse_data(_Chunks(pieces))]  # type: ignore[arg-type]


STREAM = (
    b": a comment\r\n"
    b'data: {"a": 1}\r\n\r\n'
    b"event: ignored\n"
    b"data: first line\n"
    b"data:second line\n\n"
    b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(STREAM)])
async def test_sse_events_are_the_same_however_the_bytes_arrive(size: int) -> None:
    pieces = [STREAM[i : i + size] for i in range(0, len(STREAM), size)]
    assert await events_of(pieces) == ['{"a": 1}', "first line\nsecond line", "[DONE]"]


async def test_sse_data_without_a_final_blank_line_still_counts() -> None:
    assert await events_of([b"data: x\n", b"data: y\n"]) == ["x\ny"]


async def test_a_line_cut_by_the_end_of_the_stream_is_dropped_with_its_event() -> None:
    cut = [b"data: a\n\n", b"data: x\n", b'data: {"choices": [{"del']
    assert await events_of(cut) == ["a"]


async def test_an_event_that_never_ends_is_refused_past_the_bound() -> None:
    with pytest.raises(ValueError):
        await events_of([b"data: " + b"x" * 1024 * 1024 + b"\n"] * 5)


async def test_sse_line_without_end_is_refused_past_the_bound() -> None:
    with pytest.raises(ValueError):
        await events_of([b"data: " + b"x" * 1024 * 1024] * 5)
