"""POST /v1/chat/completions through the real `openai` SDK against the whole service
(create_app on the embedded PostgreSQL), with a stub OpenAI-compatible model server on
127.0.0.1 as the upstream."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
import re
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import openai
import orjson
import pytest
import stub_upstream
from multidict import CIMultiDict
from platform_support import clear_of_minute_boundary
from test_admin_support import GatewayTestServer, Service, SseReader, now, uid
from yarl import URL

import gateway.chat
import gateway.http_server
from actors.behaviour import CommandOutcome
from actors.conversation import TurnResult
from actors.errors import AnswerAbandoned, RuntimeStopping, TurnInProgress
from actors.models.openai_compat import OpenAICompatProvider
from actors.models.port import TextDelta
from actors.workspace import workspace_key
from eventstore.records import RecordedEvent
from gateway.app import create_app
from gateway.auth import generate_key, hash_key
from gateway.bootstrap import ensure_workspace
from gateway.chat import TURN_ERROR_CODES, _keyed_command_id
from gateway.metrics import ANSWERED_STATUSES
from gateway.settings import Settings
from gateway.state import PROJECTIONS, RUNTIME, STORE, Principal
from schemas.workspace import IssueApiKey

UPSTREAM_MODEL = "stub-model"
OFFLINE = "svc-offline"
COMPLETED = "conversation.assistant_message_completed"
FAILED = "conversation.turn_failed"
HELLO = [{"role": "user", "content": "hello there, model"}]


@dataclass
class Chat:
    service: Service
    stub: Any
    workspace: str
    key: str
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return self.service.url("/v1")

    def client(self, key: str | None = None) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(
            base_url=self.base_url, api_key=key or self.key, max_retries=0, timeout=30
        )
        self.clients.append(client)
        return client

    async def issue_key(
        self, workspace: str, scopes: tuple[str, ...] = ("chat",), rpm: int | None = None
    ) -> str:
        runtime = self.service.app[RUNTIME]
        await ensure_workspace(runtime, workspace)
        key = generate_key()
        outcome = await runtime.ask(
            workspace_key(workspace),
            IssueApiKey(
                command_id=uid("cmd-"),
                workspace_id=workspace,
                key_id=uid("key-"),
                name="chat test key",
                key_hash=hash_key(key),
                prefix=key[:8],
                scopes=scopes,
                rate_limit_rpm=rpm,
                at=now(),
            ),
        )
        assert isinstance(outcome, CommandOutcome)
        await self.service.settle(outcome.cursor)
        return key

    async def events(self, conversation_id: str) -> list[RecordedEvent]:
        return await self.service.app[STORE].read_stream(f"conversation:{conversation_id}")

    async def wait_for_event(self, conversation_id: str, type_name: str) -> RecordedEvent:
        async with asyncio.timeout(20):
            while True:
                for event in await self.events(conversation_id):
                    if event.type == type_name:
                        return event
                await asyncio.sleep(0.05)

    async def raw_post(self, body: dict[str, Any], **headers: str) -> aiohttp.ClientResponse:
        return await self.service.http.post(
            self.service.url("/v1/chat/completions"),
            headers=self.service.auth(self.key, **headers),
            json=body,
        )


@pytest.fixture
async def chat(database_url: str, tmp_path: Path) -> AsyncIterator[Chat]:
    async with chat_service(database_url, tmp_path) as served:
        yield served


@asynccontextmanager
async def chat_service(database_url: str, tmp_path: Path, **env: str) -> AsyncIterator[Chat]:
    """The gateway over a stub upstream serving UPSTREAM_MODEL (`env` overrides settings)."""
    stub = await stub_upstream.StubUpstream(tokens=5).start()
    settings = Settings(
        {
            "SVC_DATABASE_URL": database_url,
            "SVC_DATA_DIR": str(tmp_path),
            "SVC_LLM_GATEWAY_URL": stub.base_url,
            "SVC_LLM_MODEL": UPSTREAM_MODEL,
            "SVC_LLM_RETRIES": "1",
            "SVC_LLM_CALL_TIMEOUT_S": "30",
            **env,
        }
    )
    server = GatewayTestServer(create_app(settings), host="127.0.0.1")
    await server.start_server()
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
    service = Service(server.app, server, http)
    try:
        workspace = uid("ws-")
        chat = Chat(service, stub, workspace, "")
        chat.key = await chat.issue_key(workspace)
        yield chat
        for client in chat.clients:
            await client.close()
    finally:
        await http.close()
        await server.close()
        await stub.stop()


# --- JSON mode ---------------------------------------------------------------------------------


async def test_offline_model_answers_a_chat_completion(chat: Chat) -> None:
    raw = await chat.client().chat.completions.with_raw_response.create(
        model=OFFLINE, messages=HELLO
    )
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert completion.model == OFFLINE
    (choice,) = completion.choices
    assert choice.message.role == "assistant"
    assert OFFLINE in (choice.message.content or "")
    assert "hello there, model" in (choice.message.content or "")
    assert choice.finish_reason == "stop"
    usage = completion.usage
    assert usage is not None and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    conversation_id = raw.headers["X-SVC-Conversation-Id"]
    assert raw.headers["X-SVC-Cursor"]
    types = [e.type for e in await chat.events(conversation_id)]
    assert types[-3:] == [
        "conversation.user_message_received",
        "conversation.turn_started",
        COMPLETED,
    ]
    assert chat.stub.calls == 0


async def test_upstream_answer_and_usage(chat: Chat) -> None:
    completion = await chat.client().chat.completions.create(
        model=UPSTREAM_MODEL, messages=HELLO, max_tokens=3
    )
    assert completion.choices[0].message.content == "tok0 tok1 tok2 "
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 3
    body = chat.stub.bodies[0]
    assert body["model"] == UPSTREAM_MODEL and body["max_tokens"] == 3
    assert "temperature" not in body and "top_p" not in body


async def test_max_completion_tokens_is_sent_upstream_by_that_name(chat: Chat) -> None:
    """OpenAI's reasoning models refuse `max_tokens`: the upstream gets the client's name."""
    completion = await chat.client().chat.completions.create(
        model=UPSTREAM_MODEL, messages=HELLO, max_completion_tokens=2
    )
    assert completion.choices[0].finish_reason == "length"
    body = chat.stub.bodies[0]
    assert body["max_completion_tokens"] == 2 and "max_tokens" not in body


async def test_request_temperature_is_sent_upstream(chat: Chat) -> None:
    await chat.client().chat.completions.create(
        model=UPSTREAM_MODEL, messages=HELLO, temperature=0.3, top_p=0.5
    )
    assert (chat.stub.bodies[0]["temperature"], chat.stub.bodies[0]["top_p"]) == (0.3, 0.5)


async def test_stop_seed_and_penalties_are_sent_upstream_and_recorded(chat: Chat) -> None:
    raw = await chat.client().chat.completions.with_raw_response.create(
        model=UPSTREAM_MODEL,
        messages=HELLO,
        stop=["\n\n", "END"],
        seed=42,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
    )
    sent = chat.stub.bodies[0]
    assert sent["stop"] == ["\n\n", "END"] and sent["seed"] == 42
    assert (sent["presence_penalty"], sent["frequency_penalty"]) == (0.5, -0.25)
    started = await chat.wait_for_event(
        raw.headers["X-SVC-Conversation-Id"], "conversation.turn_started"
    )
    assert started.data["params"]["stop"] == ["\n\n", "END"]
    assert started.data["params"]["seed"] == 42
    # A single stop string is the same as a list of one.
    await chat.client().chat.completions.create(model=UPSTREAM_MODEL, messages=HELLO, stop="END")
    assert chat.stub.bodies[1]["stop"] == ["END"]
    assert "reasoning_effort" not in chat.stub.bodies[1]


async def test_reasoning_effort_and_verbosity_are_sent_upstream_and_recorded(chat: Chat) -> None:
    raw = await chat.client().chat.completions.with_raw_response.create(
        model=UPSTREAM_MODEL, messages=HELLO, reasoning_effort="low", verbosity="high"
    )
    sent = chat.stub.bodies[0]
    assert (sent["reasoning_effort"], sent["verbosity"]) == ("low", "high")
    started = await chat.wait_for_event(
        raw.headers["X-SVC-Conversation-Id"], "conversation.turn_started"
    )
    params = started.data["params"]
    assert (params["reasoning_effort"], params["verbosity"]) == ("low", "high")


async def test_the_offline_model_stops_at_a_stop_sequence(chat: Chat) -> None:
    full = await chat.client().chat.completions.create(model=OFFLINE, messages=HELLO)
    text = full.choices[0].message.content or ""
    assert "offline model" in text
    cut = await chat.client().chat.completions.create(
        model=OFFLINE, messages=HELLO, stop=["offline model"]
    )
    assert cut.choices[0].message.content == text[: text.index("offline model")]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("field_name", "value"),
    [
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", {"name": "f"}),
        ("tool_choice", "required"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}),
        ("top_logprobs", 3),
        ("logit_bias", {"50256": -100}),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("stop", [""]),
        ("seed", "42"),
        ("presence_penalty", 3),
        ("web_search_options", {}),
        ("stream_options", {"include_usage": True}),  # without stream: true, as OpenAI says
        ("reasoning_effort", "very high!"),
        ("verbosity", 1),
        ("moderation", {"model": "omni-moderation-latest", "policy": {"mode": "block"}}),
    ],
)
async def test_fields_whose_omission_would_change_the_answer_are_refused(
    chat: Chat, field_name: str, value: object
) -> None:
    resp = await chat.raw_post({"model": OFFLINE, "messages": HELLO, field_name: value})
    assert resp.status == 400, (field_name, value)
    error = (await resp.json())["error"]
    assert error["code"] == "invalid_request" and field_name in error["message"]


async def test_a_body_of_many_faults_gets_a_short_answer(chat: Chat) -> None:
    """Each problem is named up to a bound: a million bad items made a 70 MB answer."""
    resp = await chat.raw_post({"model": OFFLINE, "messages": [0] * 5000})
    assert resp.status == 400
    message = (await resp.json())["error"]["message"]
    assert len(message) < 5000 and "more problems" in message, message[:200]


@pytest.mark.parametrize("choice", ["none", "auto"])
async def test_no_op_values_of_those_fields_are_accepted(chat: Chat, choice: str) -> None:
    """`auto` chooses no tool when none is given, in `function_call` (its legacy spelling,
    once refused) as in `tool_choice`."""
    no_ops = {
        "response_format": {"type": "text"},
        "tool_choice": choice,
        "modalities": ["text"],
        "logit_bias": {},
        "functions": [],
        "function_call": choice,
        "moderation": None,
        "user": "someone",
        "metadata": {"k": "v"},
        "service_tier": "auto",
        "stream": None,
    }
    resp = await chat.raw_post({"model": OFFLINE, "messages": HELLO, **no_ops})
    assert resp.status == 200, await resp.text()


async def test_models_list(chat: Chat) -> None:
    models = await chat.client().models.list()
    assert {m.id for m in models.data} == {OFFLINE, UPSTREAM_MODEL}
    one = await chat.client().models.retrieve(OFFLINE)
    assert (one.id, one.object) == (OFFLINE, "model")
    # QA finding: `created` was 0, shown as 1970: it is when this gateway began serving it.
    assert {m.created for m in models.data} == {one.created}
    assert abs(one.created - time.time()) < 3600
    with pytest.raises(openai.NotFoundError) as caught:
        await chat.client().models.retrieve("no-such-model")
    assert caught.value.code == "model_not_found"


async def test_a_model_name_with_slashes_is_retrieved(database_url: str, tmp_path: Path) -> None:
    """Hugging Face style names (`meta-llama/Llama-3-8B`): the SDK percent-encodes the '/',
    other clients send it as is; both reach the model, not a 404 for the path."""
    name = "meta-llama/Llama-3-8B"
    async with chat_service(database_url, tmp_path, SVC_LLM_MODEL=name) as served:
        one = await served.client().models.retrieve(name)
        assert one.id == name
        for path in (name, "meta-llama%2FLlama-3-8B"):
            url = URL(served.service.url(f"/v1/models/{path}"), encoded=True)
            resp = await served.service.http.get(url, headers=served.service.auth(served.key))
            assert resp.status == 200, (path, await resp.text())
            assert (await resp.json())["id"] == name
        resp = await served.service.http.get(
            served.service.url("/v1/models/meta-llama/Other"),
            headers=served.service.auth(served.key),
        )
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"


# --- streaming -------------------------------------------------------------------------------


async def test_stream_sends_each_delta_as_its_own_chunk(chat: Chat) -> None:
    stream = await chat.client().chat.completions.create(
        model=UPSTREAM_MODEL, messages=HELLO, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert texts == ["tok0 ", "tok1 ", "tok2 ", "tok3 ", "tok4 "]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks] == [None] * 5 + ["stop"]
    assert all(c.usage is None for c in chunks)


async def test_stream_include_usage_adds_a_usage_chunk(chat: Chat) -> None:
    stream = await chat.client().chat.completions.create(
        model=UPSTREAM_MODEL,
        messages=HELLO,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 5
    assert last.usage.total_tokens == last.usage.prompt_tokens + 5


async def test_stream_wire_format_ends_with_done_and_carries_the_cursor(chat: Chat) -> None:
    resp = await chat.raw_post({"model": OFFLINE, "messages": HELLO, "stream": True})
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.headers["X-SVC-Conversation-Id"]
    reader = SseReader(resp)
    frames = []
    while (frame := await reader.frame()) is not None:
        frames.append(frame)
    assert frames[-1].data == "[DONE]"
    chunks = [orjson.loads(f.data) for f in frames[:-1]]
    words = [c["choices"][0]["delta"].get("content") for c in chunks[:-1]]
    assert len(words) > 5 and all(w and len(w.split()) == 1 for w in words)
    finishing = frames[-2]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert finishing.id


# --- errors ----------------------------------------------------------------------------------


async def test_out_of_range_temperature_is_a_bad_request(chat: Chat) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await chat.client().chat.completions.create(model=OFFLINE, messages=HELLO, temperature=3)
    assert caught.value.status_code == 400
    assert "temperature" in caught.value.message
    assert chat.stub.calls == 0


async def test_values_of_the_wrong_type_are_refused_not_converted(chat: Chat) -> None:
    """As OpenAI's API does: "1" is not a temperature, `true` not a token count."""
    wrong = [
        ("temperature", "1"),
        ("temperature", True),
        ("top_p", "0.5"),
        ("max_tokens", "5"),
        ("max_tokens", True),
        ("max_tokens", 5.5),
        ("stream", "yes"),
        ("stream_options", {"include_usage": "yes"}),
    ]
    for field_name, value in wrong:
        body = {"model": OFFLINE, "messages": HELLO, field_name: value}
        if field_name == "stream_options":
            body["stream"] = True  # without it, stream_options is refused for that alone
        resp = await chat.raw_post(body)
        assert resp.status == 400, (field_name, value)
        error = (await resp.json())["error"]
        assert error["code"] == "invalid_request" and field_name in error["message"]
    resp = await chat.raw_post({"model": OFFLINE, "messages": HELLO, "temperature": 1})
    assert resp.status == 200  # an integer is a number
    assert chat.stub.calls == 0


async def test_content_over_its_bound_is_refused_in_characters(chat: Chat) -> None:
    """QA finding: a string too long was refused with "at most 1000000 items"."""
    for content in (
        "x" * 1_000_001,
        [{"type": "text", "text": "x" * 600_000}] * 2,
        [{"type": "text", "text": "x" * 1_000_001}],
    ):
        body = {"model": OFFLINE, "messages": [{"role": "user", "content": content}]}
        resp = await chat.service.http.post(
            chat.service.url("/v1/chat/completions"),
            headers=chat.service.auth(chat.key, **{"Content-Type": "application/json"}),
            data=io.BytesIO(orjson.dumps(body)),  # aiohttp warns of a large body as bytes
        )
        error = (await resp.json())["error"]
        assert resp.status == 400, error
        assert error["message"].endswith("content is at most 1,000,000 characters"), error
        assert error["message"].startswith("invalid request: messages.0"), error


async def test_n_above_one_is_refused_clearly(chat: Chat) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await chat.client().chat.completions.create(model=OFFLINE, messages=HELLO, n=2)
    assert "n=1" in caught.value.message


async def test_invalid_key_is_401(chat: Chat) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        await chat.client("svc_not-a-real-key").chat.completions.create(
            model=OFFLINE, messages=HELLO
        )
    assert caught.value.status_code == 401


async def test_key_without_chat_scope_is_403(chat: Chat) -> None:
    key = await chat.issue_key(chat.workspace, scopes=("admin:read",))
    with pytest.raises(openai.PermissionDeniedError) as caught:
        await chat.client(key).chat.completions.create(model=OFFLINE, messages=HELLO)
    assert caught.value.status_code == 403


async def test_unknown_model_is_404_listing_valid_models(chat: Chat) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await chat.client().chat.completions.create(model="gpt-nope", messages=HELLO)
    body = caught.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_found"
    assert OFFLINE in caught.value.message and UPSTREAM_MODEL in caught.value.message


async def test_rate_limited_key_gets_429(chat: Chat) -> None:
    key = await chat.issue_key(chat.workspace, rpm=1)
    client = chat.client(key)
    await clear_of_minute_boundary()  # both requests in one window of the limit
    await client.chat.completions.create(model=OFFLINE, messages=HELLO)
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(model=OFFLINE, messages=HELLO)
    assert caught.value.status_code == 429
    assert caught.value.response.headers.get("Retry-After")


async def test_upstream_failure_is_502_and_recorded(chat: Chat) -> None:
    chat.stub.faults.append(stub_upstream.Fault(400, "context window exceeded"))
    with pytest.raises(openai.InternalServerError) as caught:
        await chat.client().chat.completions.with_raw_response.create(
            model=UPSTREAM_MODEL, messages=HELLO
        )
    error = caught.value
    assert error.status_code == 502
    assert "context window exceeded" in error.message
    conversation_id = error.response.headers["X-SVC-Conversation-Id"]
    failed = await chat.wait_for_event(conversation_id, FAILED)
    assert failed.data["error_code"] == "upstream_rejected"
    assert chat.stub.calls == 1
    # The failure's cursor, as a success gives its own: an admin read can wait for it.
    assert error.response.headers["X-SVC-Cursor"] == chat.service.sealed(failed.cursor)


TOO_LONG = json.dumps(
    {
        "error": {
            "message": "This model's maximum context length is 8192 tokens.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
)


@pytest.mark.parametrize("stream", [False, True])
async def test_an_upstream_400_for_the_clients_input_is_the_clients_400(
    chat: Chat, stream: bool
) -> None:
    """The SDK raises BadRequestError with the upstream's code, not an InternalServerError;
    the turn is recorded as failed, and a retry with its key gets the same answer."""
    key = {"Idempotency-Key": uid("too-long-")}
    chat.stub.faults.append(stub_upstream.Fault(400, TOO_LONG, content_type="application/json"))
    answers = []
    for _ in range(2):
        with pytest.raises(openai.BadRequestError) as caught:
            await chat.client().chat.completions.create(
                model=UPSTREAM_MODEL, messages=HELLO, stream=stream, extra_headers=key
            )
        answers.append(caught.value)
    first, again = answers
    assert first.code == again.code == "context_length_exceeded"
    assert first.type == "invalid_request_error"
    assert "maximum context length is 8192 tokens" in first.message
    assert "recorded result of the first attempt" in again.message
    assert chat.stub.calls == 1
    conversation_id = first.response.headers["X-SVC-Conversation-Id"]
    assert again.response.headers["X-SVC-Conversation-Id"] == conversation_id
    failed = await chat.wait_for_event(conversation_id, FAILED)
    assert failed.data["error_code"] == "context_length_exceeded"
    assert first.response.headers["X-SVC-Cursor"] == chat.service.sealed(failed.cursor)


async def test_a_model_the_upstream_lacks_names_the_conversation_it_recorded(
    database_url: str, tmp_path: Path
) -> None:
    """Without SVC_LLM_MODEL the client's model name goes upstream, whose "no such model" is
    the client's 404: but the turn had started, so its conversation exists and is named."""
    async with chat_service(database_url, tmp_path, SVC_LLM_MODEL="") as served:
        missing = {
            "error": {"message": "The model `gpt-9` does not exist", "code": "model_not_found"}
        }
        served.stub.faults.append(
            stub_upstream.Fault(404, json.dumps(missing), content_type="application/json")
        )
        resp = await served.raw_post({"model": "gpt-9", "messages": HELLO})
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
        conversation_id = resp.headers["X-SVC-Conversation-Id"]
        failed = await served.wait_for_event(conversation_id, FAILED)
        assert resp.headers["X-SVC-Cursor"] == served.service.sealed(failed.cursor)
        # A retry is answered with the recorded failure, and names the same conversation.
        retried = {"Idempotency-Key": uid("missing-model-")}
        served.stub.faults.append(
            stub_upstream.Fault(404, json.dumps(missing), content_type="application/json")
        )
        first = await served.raw_post({"model": "gpt-9", "messages": HELLO}, **retried)
        calls = served.stub.calls
        again = await served.raw_post({"model": "gpt-9", "messages": HELLO}, **retried)
        assert first.status == again.status == 404
        assert "recorded result of the first attempt" in (await again.json())["error"]["message"]
        assert served.stub.calls == calls  # answered from the record
        assert again.headers["X-SVC-Conversation-Id"] == first.headers["X-SVC-Conversation-Id"]


async def test_the_sdk_does_not_retry_what_a_retry_cannot_mend(chat: Chat) -> None:
    """Its default retries would each be a new turn: an upstream that refused the request
    refuses it again; one that was unavailable may answer."""
    client = openai.AsyncOpenAI(base_url=chat.base_url, api_key=chat.key, max_retries=2)
    chat.clients.append(client)
    chat.stub.faults.append(stub_upstream.Fault(400, "context window exceeded"))
    with pytest.raises(openai.InternalServerError) as caught:
        await client.chat.completions.create(model=UPSTREAM_MODEL, messages=HELLO)
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert chat.stub.calls == 1
    # SVC_LLM_RETRIES is 1 here: both attempts of the first call meet a 503, and the 502
    # that reports it leaves the SDK free to retry, which the stub answers.
    chat.stub.faults.extend([stub_upstream.Fault(503)] * 2)
    answer = await client.chat.completions.create(model=UPSTREAM_MODEL, messages=HELLO)
    assert answer.choices[0].message.content
    assert chat.stub.calls == 1 + 2 + 1
    # With a key, a failed turn is recorded under it, and the SDK's retry (the same key)
    # could only get that failure back: the first answer already says not to retry, and
    # the SDK does not (before, it waited and retried once for the same failure).
    key = {"Idempotency-Key": uid("failed-")}
    chat.stub.faults.extend([stub_upstream.Fault(503)] * 2)
    with pytest.raises(openai.InternalServerError) as caught:
        await client.chat.completions.create(
            model=UPSTREAM_MODEL, messages=HELLO, extra_headers=key
        )
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert "model server unavailable" in caught.value.message
    assert chat.stub.calls == 1 + 2 + 1 + 2
    # Sent again with the key all the same: the recorded failure, no model call.
    with pytest.raises(openai.InternalServerError) as caught:
        await client.chat.completions.create(
            model=UPSTREAM_MODEL, messages=HELLO, extra_headers=key
        )
    assert "recorded result of the first attempt" in caught.value.message
    assert chat.stub.calls == 1 + 2 + 1 + 2


async def test_an_upstream_account_out_of_quota_is_final_and_named(chat: Chat) -> None:
    """Not retried upstream (SVC_LLM_RETRIES is 1 here) nor by the SDK: paying mends it,
    not waiting."""
    client = openai.AsyncOpenAI(base_url=chat.base_url, api_key=chat.key, max_retries=2)
    chat.clients.append(client)
    quota = stub_upstream.Fault(429, "You exceeded your current quota", code="insufficient_quota")
    chat.stub.faults.extend([quota] * 4)
    with pytest.raises(openai.InternalServerError) as caught:
        await client.chat.completions.create(model=UPSTREAM_MODEL, messages=HELLO)
    assert caught.value.code == "upstream_quota_exceeded"
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert "exceeded your current quota" in caught.value.message
    assert chat.stub.calls == 1
    failed = await chat.wait_for_event(
        caught.value.response.headers["X-SVC-Conversation-Id"], FAILED
    )
    assert failed.data["error_code"] == "upstream_quota_exceeded"


async def test_an_upstreams_retry_after_reaches_the_client(chat: Chat) -> None:
    chat.stub.faults.extend([stub_upstream.Fault(503, "busy", retry_after_s=0.01)] * 2)
    resp = await chat.raw_post({"model": UPSTREAM_MODEL, "messages": HELLO})
    assert resp.status == 502 and (await resp.json())["error"]["code"] == "upstream_unavailable"
    assert resp.headers["Retry-After"] == "1"  # whole seconds, rounded up
    assert chat.stub.calls == 2
    assert "x-should-retry" not in resp.headers  # unkeyed: a retry is a new turn
    # Keyed, the failure is recorded under the key: an SDK's retry (the same headers, so
    # the same key) would only get it back, after the wait (review finding).
    chat.stub.faults.extend([stub_upstream.Fault(503, "busy", retry_after_s=0.01)] * 2)
    keyed = await chat.raw_post(
        {"model": UPSTREAM_MODEL, "messages": HELLO}, **{"Idempotency-Key": uid("idem-")}
    )
    assert keyed.status == 502 and keyed.headers["x-should-retry"] == "false"


async def test_upstream_failure_before_streaming_keeps_its_status(chat: Chat) -> None:
    chat.stub.faults.append(stub_upstream.Fault(401, "bad upstream key"))
    with pytest.raises(openai.APIStatusError) as caught:
        await chat.client().chat.completions.create(
            model=UPSTREAM_MODEL, messages=HELLO, stream=True
        )
    assert caught.value.status_code == 502


async def test_failure_mid_stream_is_an_error_frame(chat: Chat) -> None:
    chat.stub.drop_after = 2
    stream = await chat.client().chat.completions.create(
        model=UPSTREAM_MODEL, messages=HELLO, stream=True
    )
    texts: list[str] = []
    with pytest.raises(openai.APIError) as caught:
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                texts.append(chunk.choices[0].delta.content)
    assert texts == ["tok0 ", "tok1 "]
    assert "mid-answer" in caught.value.message
    assert chat.stub.calls == 1


async def test_a_streams_error_frame_carries_the_recorded_failures_cursor(chat: Chat) -> None:
    chat.stub.drop_after = 2
    resp = await chat.raw_post({"model": UPSTREAM_MODEL, "messages": HELLO, "stream": True})
    reader = SseReader(resp)
    while True:
        frame = await reader.frame()
        assert frame is not None, "the stream ended without its error frame"
        if "error" in frame.data:
            break
    failed = await chat.wait_for_event(resp.headers["X-SVC-Conversation-Id"], FAILED)
    assert frame.id == chat.service.sealed(failed.cursor)
    resp.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_turn_ended_by_a_defect_answers_500_with_its_failures_cursor(
    chat: Chat, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected exception in a turn (a defect, not the upstream's doing) is recorded as the
    turn's failure; the answer is an opaque 500 that still names the record's cursor."""

    async def broken(self: object, request: object) -> AsyncIterator[TextDelta]:
        yield TextDelta("half ")
        raise KeyError("detail-only-for-the-log")

    monkeypatch.setattr(OpenAICompatProvider, "stream", broken)
    body = {"model": UPSTREAM_MODEL, "messages": HELLO, "stream": stream}
    key = {"Idempotency-Key": uid("idem-")}
    resp = await chat.raw_post(body, **key)
    failed = await chat.wait_for_event(resp.headers["X-SVC-Conversation-Id"], FAILED)
    assert failed.data["error_code"] == "internal_error"
    if stream:
        frames = [f async for f in _frames(resp)]
        error = frames[-1]
        assert "error" in error.data and error.id == chat.service.sealed(failed.cursor)
        text = error.data
    else:
        assert resp.status == 500 and resp.headers["X-SVC-Cursor"] == chat.service.sealed(
            failed.cursor
        )
        text = await resp.text()
    # The id it names is the request's, also in X-Request-Id, the streaming answer's too.
    assert f"internal error (id {resp.headers['X-Request-Id']})" in text
    assert "detail-only" not in text
    # The same request again gets the recorded failure, which a retry cannot mend.
    replayed = await chat.raw_post(body, **key)
    answer = await replayed.text()
    assert replayed.status == 500 and replayed.headers["x-should-retry"] == "false"
    assert "internal error while running the turn" in answer and "detail-only" not in answer
    assert "send a new Idempotency-Key" in answer  # what to do (review finding: dropped)


async def _frames(resp: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    reader = SseReader(resp)
    while (frame := await reader.frame()) is not None:
        yield frame


# --- idempotency, conversations, disconnects ------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_idempotent_retry_makes_one_model_call(chat: Chat, stream: bool) -> None:
    headers = {"Idempotency-Key": uid("idem-")}
    answers = []
    for _ in range(2):
        raw = await chat.client().chat.completions.with_raw_response.create(
            model=UPSTREAM_MODEL, messages=HELLO, stream=stream, extra_headers=headers
        )
        conversation = raw.headers["X-SVC-Conversation-Id"]
        parsed = raw.parse()
        if isinstance(parsed, openai.AsyncStream):
            chunks = [c async for c in parsed]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            answers.append((conversation, chunks[0].id, text))
        else:
            answers.append((conversation, parsed.id, parsed.choices[0].message.content))
    assert answers[0] == answers[1]
    assert answers[0][2] == "tok0 tok1 tok2 tok3 tok4 "
    assert chat.stub.calls == 1
    completed = [e for e in await chat.events(answers[0][0]) if e.type == COMPLETED]
    assert len(completed) == 1


async def test_conversation_header_continues_a_conversation(chat: Chat) -> None:
    client = chat.client()
    first = await client.chat.completions.with_raw_response.create(model=OFFLINE, messages=HELLO)
    conversation_id = first.headers["X-SVC-Conversation-Id"]
    history = [
        *HELLO,
        {"role": "assistant", "content": first.parse().choices[0].message.content or ""},
        {"role": "user", "content": "and a second question"},
    ]
    second = await client.chat.completions.with_raw_response.create(
        model=OFFLINE,
        messages=history,
        extra_headers={"X-SVC-Conversation-Id": conversation_id},
    )
    assert second.headers["X-SVC-Conversation-Id"] == conversation_id
    assert "and a second question" in (second.parse().choices[0].message.content or "")
    events = await chat.events(conversation_id)
    users = [e.data["content"] for e in events if e.type == "conversation.user_message_received"]
    assert users == ["hello there, model", "and a second question"]
    assert len([e for e in events if e.type == COMPLETED]) == 2


async def test_a_tool_output_is_recorded_as_said_not_the_question_before_it(chat: Chat) -> None:
    """Review finding: a turn records what was said since the last answer. One whose input
    was a tool's output recorded the user's question of the turn before a second time, and
    the replayed conversation showed the user asking it twice."""
    client = chat.client()
    first = await client.chat.completions.with_raw_response.create(model=OFFLINE, messages=HELLO)
    conversation_id = first.headers["X-SVC-Conversation-Id"]
    history = [
        *HELLO,
        {"role": "assistant", "content": first.parse().choices[0].message.content or ""},
        {"role": "tool", "content": "42 degrees", "name": "thermometer", "tool_call_id": "x"},
    ]
    second = await client.chat.completions.with_raw_response.create(
        model=OFFLINE,
        messages=history,
        extra_headers={"X-SVC-Conversation-Id": conversation_id},
    )
    admin = await chat.issue_key(chat.workspace, scopes=("admin:read",))
    body = await chat.service.get_json(
        "/v1/admin/conversations/messages",
        admin,
        id=conversation_id,
        min_cursor=second.headers["X-SVC-Cursor"],
    )
    said = [(m["role"], m["content"], m["name"]) for m in body["messages"]]
    assert said[0] == ("user", "hello there, model", None)
    assert said[2] == ("tool", "42 degrees", "thermometer")
    assert [role for role, _, _ in said] == ["user", "assistant", "tool", "assistant"]


async def test_another_workspace_cannot_continue_a_conversation(chat: Chat) -> None:
    first = await chat.client().chat.completions.with_raw_response.create(
        model=OFFLINE, messages=HELLO
    )
    conversation_id = first.headers["X-SVC-Conversation-Id"]
    other = await chat.issue_key(uid("ws-"))
    with pytest.raises(openai.NotFoundError):
        await chat.client(other).chat.completions.create(
            model=OFFLINE,
            messages=HELLO,
            extra_headers={"X-SVC-Conversation-Id": conversation_id},
        )
    assert len(await chat.events(conversation_id)) == len(
        [e for e in await chat.events(conversation_id) if e.workspace_id == chat.workspace]
    )


async def test_a_client_cannot_name_a_new_conversation(chat: Chat) -> None:
    """An id the service never issued is 404, like another workspace's: nothing is recorded
    under it, so no workspace can claim an id before another one uses it."""
    chosen = uid("support-ticket-")
    other = await chat.issue_key(uid("ws-"))
    for key in (None, other):
        with pytest.raises(openai.NotFoundError) as caught:
            await chat.client(key).chat.completions.create(
                model=OFFLINE, messages=HELLO, extra_headers={"X-SVC-Conversation-Id": chosen}
            )
        assert caught.value.response.headers["X-SVC-Conversation-Id"] == chosen
        assert f"conversation {chosen} does not exist" in caught.value.message
        assert caught.value.code == "conversation_not_found"  # the admin reads' code too
    assert await chat.events(chosen) == []
    assert chat.stub.calls == 0


async def test_a_request_refused_before_its_turn_names_no_new_conversation(chat: Chat) -> None:
    """A 400, 403 or 404 before the turn started leaves no conversation behind, so the
    answer names none; with a conversation the client named, it names that one."""
    first = await chat.raw_post({"model": OFFLINE, "messages": HELLO})
    existing = first.headers["X-SVC-Conversation-Id"]
    reader = await chat.issue_key(chat.workspace, ("admin:read",))
    refusals = [
        ({"model": OFFLINE, "messages": []}, chat.key, 400),
        ({"model": OFFLINE, "messages": HELLO, "temperature": 7}, chat.key, 400),
        ({"model": "no-such-model", "messages": HELLO}, chat.key, 404),
        ({"model": OFFLINE, "messages": HELLO}, reader, 403),
        # No user message to answer.
        ({"model": OFFLINE, "messages": [{"role": "system", "content": "hi"}]}, chat.key, 400),
    ]
    for body, key, status in refusals:
        # An Idempotency-Key alone names no conversation either (one is derived from it).
        for named in ({}, {"X-SVC-Conversation-Id": existing}, {"Idempotency-Key": uid("k-")}):
            resp = await chat.service.http.post(
                chat.service.url("/v1/chat/completions"),
                headers=chat.service.auth(key, **named),
                json=body,
            )
            assert resp.status == status, await resp.text()
            expected = existing if "X-SVC-Conversation-Id" in named else None
            assert resp.headers.get("X-SVC-Conversation-Id") == expected
    # So is a refused Idempotency-Key (malformed, or in the service's own namespace).
    for bad_key, code in (("a b", "invalid_header"), ("svc:x", "invalid_idempotency_key")):
        for named in ({}, {"X-SVC-Conversation-Id": existing}):
            resp = await chat.service.http.post(
                chat.service.url("/v1/chat/completions"),
                headers=chat.service.auth(chat.key, **named, **{"Idempotency-Key": bad_key}),
                json={"model": OFFLINE, "messages": HELLO},
            )
            assert (resp.status, (await resp.json())["error"]["code"]) == (400, code)
            expected = existing if named else None
            assert resp.headers.get("X-SVC-Conversation-Id") == expected


async def test_malformed_conversation_header_is_a_bad_request(chat: Chat) -> None:
    with pytest.raises(openai.BadRequestError):
        await chat.client().chat.completions.create(
            model=OFFLINE, messages=HELLO, extra_headers={"X-SVC-Conversation-Id": "a b/c"}
        )
    # The documented alphabet, any character first, 1 to 128 of them.
    for key, status in (("_retry.1:a-b", 200), ("k" * 128, 200), ("k" * 129, 400)):
        resp = await chat.raw_post(
            {"model": OFFLINE, "messages": HELLO}, **{"Idempotency-Key": key}
        )
        assert resp.status == status, key


async def test_an_empty_or_doubled_id_header_is_a_bad_request(chat: Chat) -> None:
    """An empty key would make every retry a new turn; two different keys leave unclear
    which one the client meant."""
    for name in ("Idempotency-Key", "X-SVC-Conversation-Id"):
        for values in ([""], ["  "], ["k-1", "k-2"]):
            headers = CIMultiDict([("Authorization", f"Bearer {chat.key}")])
            for value in values:
                headers.add(name, value)
            resp = await chat.service.http.post(
                chat.service.url("/v1/chat/completions"),
                headers=headers,
                json={"model": OFFLINE, "messages": HELLO},
            )
            body = await resp.json()
            assert resp.status == 400, (name, values, body)
            assert body["error"]["code"] == "invalid_header"
            assert name in body["error"]["message"]
    # The same value twice is one value.
    key = uid("idem-")
    resp = await chat.service.http.post(
        chat.service.url("/v1/chat/completions"),
        headers=CIMultiDict(
            [
                ("Authorization", f"Bearer {chat.key}"),
                ("Idempotency-Key", key),
                ("Idempotency-Key", key),
            ]
        ),
        json={"model": OFFLINE, "messages": HELLO},
    )
    assert resp.status == 200
    assert chat.stub.calls == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_key_reused_for_another_request_is_refused_not_answered(
    chat: Chat, stream: bool
) -> None:
    """Review finding: the key alone named the turn, so a request reusing it with another
    model or other messages (a client whose counter-based keys restarted, two apps behind
    one static key) got the first request's answer with a 200. It is now 409
    `idempotency_key_reused`; the same request again, as a stream or not, still gets the
    recorded answer, and the model is called once."""
    key = {"Idempotency-Key": uid("idem-")}
    first = await chat.client().chat.completions.create(
        model=UPSTREAM_MODEL, messages=HELLO, extra_headers=key
    )
    assert first.model == UPSTREAM_MODEL
    other_messages = [{"role": "user", "content": "something else"}]
    for model, messages, extra in (
        (OFFLINE, HELLO, {}),
        (UPSTREAM_MODEL, other_messages, {}),
        (UPSTREAM_MODEL, HELLO, {"temperature": 0.1}),
    ):
        with pytest.raises(openai.ConflictError) as refused:
            await chat.client().chat.completions.create(
                model=model, messages=messages, extra_headers=key, stream=stream, **extra
            )
        assert refused.value.code == "idempotency_key_reused", refused.value
    again = await chat.client().chat.completions.create(
        model=UPSTREAM_MODEL, messages=HELLO, extra_headers=key, stream=stream
    )
    if isinstance(again, openai.AsyncStream):
        chunks = [c async for c in again]
        assert {c.model for c in chunks} == {UPSTREAM_MODEL}
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        assert again.model == UPSTREAM_MODEL
        text = again.choices[0].message.content or ""
    assert text == first.choices[0].message.content
    assert chat.stub.calls == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_two_principals_of_a_workspace_never_share_an_idempotency_key(
    chat: Chat, stream: bool
) -> None:
    """Keys are chosen by clients: another key of the same workspace sending the same one
    runs its own turn in its own conversation, and never gets the first one's answer; each
    principal's retry still gets its own recorded answer."""
    other = await chat.issue_key(chat.workspace)
    key = {"Idempotency-Key": "order-42"}

    async def ask(api_key: str) -> tuple[str, str]:
        raw = await chat.client(api_key).chat.completions.with_raw_response.create(
            model=UPSTREAM_MODEL, messages=HELLO, stream=stream, extra_headers=key
        )
        parsed = raw.parse()
        if isinstance(parsed, openai.AsyncStream):
            chunks = [c async for c in parsed]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = parsed.choices[0].message.content or ""
        return raw.headers["X-SVC-Conversation-Id"], text

    chat.stub.reply = "the first principal's answer"
    first = await ask(chat.key)
    chat.stub.reply = "the second principal's answer"
    second = await ask(other)
    assert first[1] == "the first principal's answer"
    assert second[1] == "the second principal's answer"
    assert first[0] != second[0]
    assert chat.stub.calls == 2
    assert await ask(chat.key) == first and await ask(other) == second  # from the record
    assert chat.stub.calls == 2


def test_an_idempotency_key_belongs_to_the_user_else_the_api_key() -> None:
    """A user's keys and sessions share the user's keys (a retry through another of them
    is a retry); keys of no user each have their own; the id stays in the service's
    namespace and within a command id's 200 characters."""
    ws = "ws-1"
    by_user = [Principal(ws, frozenset(), key_id=k, user_id="u-1") for k in ("k-1", "k-2", None)]
    ids = {_keyed_command_id(p, "k" * 128) for p in by_user}
    assert len(ids) == 1
    (only,) = ids
    assert only.startswith("svc:chat:") and len(only) <= 200
    unowned = [Principal(ws, frozenset(), key_id=k) for k in ("k-1", "k-2")]
    static = Principal(ws, frozenset())
    others = {_keyed_command_id(p, "k" * 128) for p in (*unowned, static)}
    assert len(others | ids) == 4


async def test_a_key_reused_elsewhere_names_no_conversation(chat: Chat) -> None:
    key = {"Idempotency-Key": uid("idem-")}
    first = await chat.client().chat.completions.with_raw_response.create(
        model=OFFLINE, messages=HELLO
    )
    conversation = {"X-SVC-Conversation-Id": first.headers["X-SVC-Conversation-Id"]}
    await chat.client().chat.completions.create(
        model=OFFLINE, messages=HELLO, extra_headers={**key, **conversation}
    )
    with pytest.raises(openai.ConflictError) as reused:  # no conversation header this time
        await chat.client().chat.completions.create(
            model=OFFLINE, messages=HELLO, extra_headers=key
        )
    assert reused.value.code == "idempotency_key_reused"
    assert "X-SVC-Conversation-Id" not in reused.value.response.headers
    # It says where the key went, in the client's words: no internal command id (which
    # carries a digest of the key's owner) and no stream name (QA finding).
    used_for = f"used for a request to conversation {conversation['X-SVC-Conversation-Id']};"
    assert used_for in reused.value.message, reused.value.message
    assert "svc:chat:" not in reused.value.message


async def test_keys_that_look_like_a_turns_own_ids_are_turns_of_their_own(chat: Chat) -> None:
    """The ids the service derives for a turn's completion live in a namespace no client key
    can enter: a key spelled like one of them is just another key."""
    base = uid("idem-")
    answers = []
    for key in (f"{base}:complete", base, f"{base}:fail"):
        raw = await chat.client().chat.completions.with_raw_response.create(
            model=UPSTREAM_MODEL, messages=HELLO, extra_headers={"Idempotency-Key": key}
        )
        answers.append(raw.headers["X-SVC-Conversation-Id"])
    assert len(set(answers)) == 3 and chat.stub.calls == 3
    for conversation in answers:
        assert [e.type for e in await chat.events(conversation)].count(COMPLETED) == 1


async def test_a_key_in_the_services_own_namespace_is_refused(chat: Chat) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await chat.client().chat.completions.create(
            model=OFFLINE, messages=HELLO, extra_headers={"Idempotency-Key": "svc:complete:x"}
        )
    assert caught.value.code == "invalid_idempotency_key" and "svc:" in caught.value.message
    assert chat.stub.calls == 0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("fault", "named"),
    [
        ("finish_reason", "finish_reason"),  # over the 64 characters a recorded reason holds
        ("reply", "NUL"),  # PostgreSQL's jsonb cannot hold U+0000
        ("usage", "prompt_tokens"),  # beyond the read models' 32-bit counts
        ("total", "together exceed"),  # each count fits, their sum does not
    ],
)
async def test_an_answer_the_log_cannot_record_fails_the_turn(
    chat: Chat, stream: bool, fault: str, named: str
) -> None:
    """A model server's broken answer is its fault (502), never the client's (400), and the
    turn ends recorded as failed rather than left running."""
    if fault == "finish_reason":
        chat.stub.finish_reason = "x" * 100
    elif fault == "usage":
        chat.stub.usage = {"prompt_tokens": 2**63 - 1, "completion_tokens": 2**63 - 1}
    elif fault == "total":
        chat.stub.usage = {"prompt_tokens": 2**31 - 1, "completion_tokens": 1}
    else:
        chat.stub.reply = "half\x00way"
    raw = await chat.raw_post({"model": UPSTREAM_MODEL, "messages": HELLO, "stream": stream})
    conversation_id = raw.headers["X-SVC-Conversation-Id"]
    if stream:
        frames = await raw.text()
        assert "upstream_bad_response" in frames and "[DONE]" not in frames
    else:
        body = await raw.json()
        assert raw.status == 502 and body["error"]["code"] == "upstream_bad_response"
        assert named in body["error"]["message"]
    failed = await chat.wait_for_event(conversation_id, FAILED)
    assert failed.data["error_code"] == "upstream_bad_response"


async def _sse_payloads(resp: aiohttp.ClientResponse) -> list[Any]:
    """The JSON payloads of a chat stream's frames, up to its end (`[DONE]` left out)."""
    reader = SseReader(resp)
    frames = []
    while (frame := await reader.frame()) is not None:
        frames.append(frame)
    return [orjson.loads(f.data) for f in frames if f.data != "[DONE]"]


@pytest.mark.parametrize("recorded", ["same", "other"])
async def test_a_stream_cut_short_behind_the_runtime_ends_with_the_recorded_answer(
    chat: Chat, monkeypatch: pytest.MonkeyPatch, recorded: str
) -> None:
    """A runtime that loses the deltas part way and then answers with the turn's recorded
    result (the Ray runtime retrying on a host it lost touch with): the client still gets
    the whole recorded text, or an error saying how to get it when what it was sent is not
    the recorded text's beginning; never a cut-off answer presented as complete."""
    runtime = chat.service.app[RUNTIME]
    real_stream = runtime.stream

    async def lossy_stream(key: Any, command: Any) -> AsyncIterator[Any]:
        deltas = 0
        async for item in real_stream(key, command):
            if isinstance(item, TextDelta):
                deltas += 1
                if deltas == 1:
                    yield item
            elif isinstance(item, TurnResult):
                if recorded == "other":
                    item = dataclasses.replace(item, content="another answer altogether")
                yield item

    monkeypatch.setattr(runtime, "stream", lossy_stream)
    raw = await chat.raw_post({"model": UPSTREAM_MODEL, "messages": HELLO, "stream": True})
    payloads = await _sse_payloads(raw)
    conversation_id = raw.headers["X-SVC-Conversation-Id"]
    answer = (await chat.wait_for_event(conversation_id, COMPLETED)).data["content"]
    text = "".join(
        p["choices"][0]["delta"].get("content", "") for p in payloads if p.get("choices")
    )
    if recorded == "same":
        assert text == answer and len(answer) > 0
        assert payloads[-1]["choices"][0]["finish_reason"] == "stop"
    else:
        error = payloads[-1]["error"]
        assert error["code"] == "stream_interrupted" and "Idempotency-Key" in error["message"]
        assert not any(p.get("choices") and p["choices"][0]["finish_reason"] for p in payloads)


async def test_a_token_limit_over_the_bound_names_the_field_sent(chat: Chat) -> None:
    raw = await chat.raw_post(
        {"model": OFFLINE, "messages": HELLO, "max_completion_tokens": 2_000_000}
    )
    body = await raw.json()
    assert raw.status == 400
    assert body["error"]["message"] == (
        "invalid request: max_completion_tokens: must be at most 1000000"
    )


async def test_refused_by_scope_or_rate_limit_the_named_conversation_is_still_named(
    chat: Chat,
) -> None:
    first = await chat.client().chat.completions.with_raw_response.create(
        model=OFFLINE, messages=HELLO
    )
    named = {"X-SVC-Conversation-Id": first.headers["X-SVC-Conversation-Id"]}
    admin_only = await chat.issue_key(chat.workspace, scopes=("admin:read",))
    with pytest.raises(openai.PermissionDeniedError) as refused:
        await chat.client(admin_only).chat.completions.create(
            model=OFFLINE, messages=HELLO, extra_headers=named
        )
    limited = chat.client(await chat.issue_key(chat.workspace, rpm=1))
    await clear_of_minute_boundary()  # both requests in one window of the limit
    await limited.chat.completions.create(model=OFFLINE, messages=HELLO, extra_headers=named)
    with pytest.raises(openai.RateLimitError) as limited_out:
        await limited.chat.completions.create(model=OFFLINE, messages=HELLO, extra_headers=named)
    for error in (refused.value, limited_out.value):
        headers = error.response.headers
        assert headers["X-SVC-Conversation-Id"] == named["X-SVC-Conversation-Id"]


async def test_a_developer_message_is_a_system_message_toward_the_model(chat: Chat) -> None:
    """OpenAI's newer name for `system`: accepted, and sent as `system`, which every model
    server knows."""
    messages: Any = [{"role": "developer", "content": "answer in French"}, *HELLO]
    raw = await chat.client().chat.completions.with_raw_response.create(
        model=UPSTREAM_MODEL, messages=messages
    )
    assert raw.parse().choices[0].message.content
    sent = chat.stub.bodies[-1]["messages"]
    assert sent[0] == {"role": "system", "content": "answer in French"}
    started = await chat.wait_for_event(
        raw.headers["X-SVC-Conversation-Id"], "conversation.turn_started"
    )
    assert started.data["request_messages"] == 2


async def test_a_legacy_function_message_is_refused_by_name(chat: Chat) -> None:
    messages: Any = [*HELLO, {"role": "function", "name": "f", "content": "42"}]
    with pytest.raises(openai.BadRequestError) as caught:
        await chat.client().chat.completions.create(model=UPSTREAM_MODEL, messages=messages)
    assert "messages.1.role: role 'function'" in caught.value.message
    assert chat.stub.calls == 0


TOOL_CALL: Any = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("history", "named"),
    [
        (
            [{"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}],
            "messages.1.tool_calls: an assistant message with tool_calls is not supported",
        ),
        (
            [{"role": "assistant", "content": None, "function_call": TOOL_CALL["function"]}],
            "messages.1.function_call: an assistant message with function_call",
        ),
    ],
)
async def test_assistant_tool_calls_are_refused_naming_the_message(
    chat: Chat, history: list[Any], named: str
) -> None:
    """Client tools are refused, so are the calls an assistant made of them: forwarded
    without them, the tool messages that answer them made the model server refuse."""
    messages: Any = [*HELLO, *history, {"role": "user", "content": "go on"}]
    resp = await chat.raw_post({"model": UPSTREAM_MODEL, "messages": messages})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["code"] == "invalid_request"
    assert named in error["message"] and "drop" in error["message"]
    assert "X-SVC-Conversation-Id" not in resp.headers
    assert chat.stub.calls == 0
    # No tool use at all (an empty list, a null) is no history of it.
    quiet: Any = [*HELLO, {"role": "assistant", "content": "hi", "tool_calls": []}]
    quiet += [{"role": "user", "content": "go on"}]
    ok = await chat.raw_post({"model": UPSTREAM_MODEL, "messages": quiet})
    assert ok.status == 200, await ok.text()


async def test_a_tool_message_reaches_the_model_as_labelled_user_text(chat: Chat) -> None:
    """`tool` is one of the spec's roles. A model server refuses a tool message that answers
    no call of the history (this endpoint makes none), so its text goes as a user message
    saying what it is; the OpenAI SDK's form (with `tool_call_id`) is taken as well. It joins
    the user message beside it: templates that want user and assistant to take turns refuse
    two user messages in a row."""
    messages: Any = [
        *HELLO,
        {"role": "assistant", "content": "let me compute"},
        {"role": "tool", "name": "calc", "content": "42"},
        {"role": "tool", "tool_call_id": "call_1", "content": "[1, 2]"},
        {"role": "user", "content": "so?"},
        {"role": "assistant", "content": "so 42"},
        {"role": "user", "content": "and now?"},
        {"role": "tool", "name": "calc", "content": "43"},
        {"role": "user", "content": "thanks"},
        {"role": "user", "content": "bye"},
    ]
    raw = await chat.client().chat.completions.with_raw_response.create(
        model=UPSTREAM_MODEL, messages=messages
    )
    assert raw.parse().choices[0].message.content
    sent = chat.stub.bodies[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant"] * 2 + ["user"] * 2
    assert sent[2] == {
        "role": "user",
        "content": "Output of the tool calc:\n42\n\nOutput of a tool:\n[1, 2]\n\nso?",
    }
    assert sent[4] == {
        "role": "user",
        "content": "and now?\n\nOutput of the tool calc:\n43\n\nthanks",
    }
    assert sent[5] == {"role": "user", "content": "bye"}  # two of the client's own stay two
    started = await chat.wait_for_event(
        raw.headers["X-SVC-Conversation-Id"], "conversation.turn_started"
    )
    assert started.data["request_messages"] == 10


async def streamed_body(chat: Chat) -> str:
    """The raw SSE body of a streamed answer, which is a 200 whatever comes after the grace."""
    resp = await chat.raw_post({"model": UPSTREAM_MODEL, "messages": HELLO, "stream": True})
    assert resp.status == 200
    return await resp.text()


async def sdk_streamed_text(chat: Chat) -> str:
    """The text of a streamed answer as the OpenAI SDK reads it."""
    stream = await chat.client().chat.completions.create(
        model=UPSTREAM_MODEL, messages=HELLO, stream=True
    )
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def test_a_stream_waiting_for_its_first_word_sends_heartbeats(
    chat: Chat, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reasoning model may think for minutes before its first word: a silent response
    met a proxy's idle timeout (a 504 the SDKs retry as a new turn). Past a grace, the
    stream answers 200 and sends SSE comments until the first delta; the SDK skips them."""
    monkeypatch.setattr(gateway.chat, "FIRST_ITEM_GRACE_S", 0.05, raising=False)
    monkeypatch.setattr(gateway.chat, "STREAM_HEARTBEAT_S", 0.05, raising=False)
    chat.stub.delay_s = 0.6
    body = await streamed_body(chat)
    before_answer = body.split("data: ", 1)[0]
    assert before_answer.count(": \n\n") >= 2, body[:200]
    assert body.rstrip().endswith("data: [DONE]")
    assert (await sdk_streamed_text(chat)).startswith("tok0")  # the SDK skips heartbeats
    # A failure that comes after the grace is the stream's error frame.
    chat.stub.faults.append(stub_upstream.Fault(400, "no such parameter"))
    body = await streamed_body(chat)
    frames = [line for line in body.splitlines() if line.startswith("data: ")]
    assert orjson.loads(frames[-1][6:])["error"]["code"] == "upstream_rejected", frames


async def test_a_stream_the_model_pauses_in_sends_heartbeats(
    chat: Chat, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model may pause mid-answer as long as before its first word (composing a tool
    call, an upstream stall): the heartbeats go on between deltas too."""
    monkeypatch.setattr(gateway.chat, "STREAM_HEARTBEAT_S", 0.05, raising=False)
    chat.stub.chunk_delay_s = 0.3
    body = await streamed_body(chat)
    after_first_delta = body.split("data: ", 2)[2]
    assert ": \n\n" in after_first_delta.split("data: [DONE]")[0], body[:400]
    assert (await sdk_streamed_text(chat)).startswith("tok0")  # the SDK skips heartbeats


@pytest.mark.parametrize("stream", [False, True])
async def test_a_turn_the_runtime_refused_unrun_names_no_conversation(
    chat: Chat, stream: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Refused by a stopping runtime before any actor ran it: no conversation exists under
    the id drawn for it, so the 503 names none (a client continuing it got a 404). The
    refusal is the answer, not also an ERROR line about a failed task."""
    runtime = chat.service.app[RUNTIME]

    async def refuse(*_: Any, **__: Any) -> Any:
        raise RuntimeStopping()

    async def refuse_stream(*_: Any, **__: Any) -> AsyncIterator[Any]:
        raise RuntimeStopping()
        yield  # an async generator, as the runtime's stream is

    monkeypatch.setattr(runtime, "ask", refuse)
    monkeypatch.setattr(runtime, "stream", refuse_stream)
    body = {"model": UPSTREAM_MODEL, "messages": HELLO, "stream": stream}
    resp = await chat.raw_post(body)
    error = (await resp.json())["error"]
    assert resp.status == 503 and error["code"] == "runtime_stopping", error
    assert "X-SVC-Conversation-Id" not in resp.headers
    # One the client named is still named: it is the client's.
    resp = await chat.raw_post(body, **{"X-SVC-Conversation-Id": "c-named"})
    assert resp.status == 503 and resp.headers["X-SVC-Conversation-Id"] == "c-named"

    # A keyed request's id comes from its key: a first attempt refused unrun names none,
    # and a retry of one that ran names the conversation that attempt recorded.
    keyed = {"Idempotency-Key": f"refused-{stream}"}
    resp = await chat.raw_post(body, **keyed)
    assert resp.status == 503 and "X-SVC-Conversation-Id" not in resp.headers
    monkeypatch.undo()
    ran = await chat.raw_post(body, **keyed)
    assert ran.status == 200, await ran.text()
    await ran.read()
    monkeypatch.setattr(runtime, "ask", refuse)
    monkeypatch.setattr(runtime, "stream", refuse_stream)
    resp = await chat.raw_post(body, **keyed)
    assert resp.status == 503, await resp.text()
    assert resp.headers["X-SVC-Conversation-Id"] == ran.headers["X-SVC-Conversation-Id"]

    # A turn this process stopped waiting for runs on in its Ray host, and is recorded
    # under the id: that 503 names it.
    async def abandon(*_: Any, **__: Any) -> Any:
        raise AnswerAbandoned()

    monkeypatch.setattr(runtime, "ask", abandon)
    resp = await chat.raw_post({**body, "stream": False})
    assert resp.status == 503 and "X-SVC-Conversation-Id" in resp.headers
    # Not "did not start" (review finding): its own code, and without a key no SDK retry,
    # which would run the turn a second time.
    assert (await resp.json())["error"]["code"] == "answer_abandoned"
    assert resp.headers["x-should-retry"] == "false"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("keyed", [False, True])
async def test_a_turn_found_running_after_a_host_was_lost(
    chat: Chat, monkeypatch: pytest.MonkeyPatch, keyed: bool
) -> None:
    """QA finding (Ray, a host killed mid-turn): the runtime's retry met the turn still
    recorded as running, and a request without a key was told to "retry shortly with the
    same Idempotency-Key", with no conversation named, and an SDK retry ran the turn again
    in a new conversation. It names the conversation where the outcome is recorded, and says
    not to retry; a keyed request is told when the turn is given up. A stream that had
    begun gets the same words in its error frame (review finding: it had the keyed ones)."""
    expires_at = "2027-01-01T00:00:00Z"

    async def lost(key: Any, command: Any, **_: Any) -> Any:
        raise TurnInProgress.of("t1", key.id, command.workspace_id, expires_at)

    async def lost_mid_stream(key: Any, command: Any, **_: Any) -> AsyncIterator[Any]:
        yield TextDelta("half an answer ")
        await lost(key, command)

    runtime = chat.service.app[RUNTIME]
    monkeypatch.setattr(runtime, "ask", lost)
    monkeypatch.setattr(runtime, "stream", lost_mid_stream)
    headers = {"Idempotency-Key": uid("idem-")} if keyed else {}
    resp = await chat.raw_post({"model": OFFLINE, "messages": HELLO}, **headers)
    error = (await resp.json())["error"]
    assert resp.status == 409 and error["code"] == "turn_in_progress", error
    _assert_told_of_the_running_turn(error["message"], resp.headers, keyed, expires_at)
    if not keyed:  # an SDK's retry would run the turn again, in a new conversation
        assert resp.headers["x-should-retry"] == "false"
    headers = {"Idempotency-Key": uid("idem-")} if keyed else {}
    resp = await chat.raw_post({"model": OFFLINE, "messages": HELLO, "stream": True}, **headers)
    assert resp.status == 200
    frames = [f async for f in _frames(resp)]
    error = json.loads(frames[-1].data)["error"]
    assert error["code"] == "turn_in_progress", error
    _assert_told_of_the_running_turn(error["message"], resp.headers, keyed, expires_at)


def _assert_told_of_the_running_turn(
    message: str, headers: Any, keyed: bool, expires_at: str
) -> None:
    conversation = headers["X-SVC-Conversation-Id"]
    assert expires_at in message
    if keyed:
        assert "same Idempotency-Key" in message
    else:
        assert f"running in conversation {conversation}" in message
        assert "sending this request again runs a new turn" in message


async def test_tool_output_joins_no_two_speakers_under_one_name(chat: Chat) -> None:
    """Tool output joins the user message beside it, and takes that user's `name`; two
    users' words are not put under one name, which would tell the model bob said alice's."""
    messages: Any = [
        {"role": "user", "content": "Q", "name": "alice"},
        {"role": "tool", "tool_call_id": "call_1", "content": "out"},
        {"role": "user", "content": "next", "name": "bob"},
        {"role": "assistant", "content": "A"},
        {"role": "tool", "tool_call_id": "call_2", "content": "more"},
        {"role": "user", "content": "and", "name": "carol"},
    ]
    await chat.client().chat.completions.create(model=UPSTREAM_MODEL, messages=messages)
    sent = chat.stub.bodies[-1]["messages"]
    assert sent == [
        {"role": "user", "content": "Q\n\nOutput of a tool:\nout", "name": "alice"},
        {"role": "user", "content": "next", "name": "bob"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "Output of a tool:\nmore\n\nand", "name": "carol"},
    ], sent


async def test_a_tool_message_needs_its_text(chat: Chat) -> None:
    messages: Any = [*HELLO, {"role": "tool", "tool_call_id": "call_1", "content": None}]
    resp = await chat.raw_post({"model": UPSTREAM_MODEL, "messages": messages})
    error = (await resp.json())["error"]
    assert resp.status == 400, error
    assert "a tool message needs content" in error["message"]
    assert chat.stub.calls == 0


async def _upstream_answers_once(
    chat: Chat, message: dict[str, Any], finish_reason: str, *, stream: bool
) -> Any:
    """A chat whose upstream answers `message` with `finish_reason`: one chat.completion, or
    as a stream, its whole message as the first delta then a finishing chunk. The SDK's raw
    response."""
    if stream:
        chunks = [
            {"choices": [{"index": 0, "delta": message}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": finish_reason}]},
        ]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        fault = stub_upstream.Fault(200, body, content_type="text/event-stream")
    else:
        choice = {"index": 0, "message": message, "finish_reason": finish_reason}
        fault = stub_upstream.Fault(
            200, json.dumps({"choices": [choice]}), content_type="application/json"
        )
    chat.stub.faults.append(fault)
    return await chat.client().chat.completions.with_raw_response.create(
        model=UPSTREAM_MODEL, messages=HELLO, stream=stream
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_an_upstream_tool_call_ends_the_answer_as_a_stop(chat: Chat, stream: bool) -> None:
    """QA finding: a model server that answered a tool call (this endpoint sends it no
    tools) gave the client `finish_reason: "tool_calls"` and no calls, and an agent loop
    iterating `message.tool_calls` failed on None. The call is not passed on, so the answer
    ended as a stop; an empty one streams its role first and an empty finishing delta."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    answer = {"role": "assistant", "content": None, "tool_calls": [call]}
    raw = await _upstream_answers_once(chat, answer, "tool_calls", stream=stream)
    parsed = raw.parse()
    if isinstance(parsed, openai.AsyncStream):
        got = [c.choices[0] async for c in parsed if c.choices]
        assert [(c.delta.role, c.delta.content, c.finish_reason) for c in got] == [
            ("assistant", "", None),
            (None, None, "stop"),
        ]
    else:
        assert parsed.choices[0].finish_reason == "stop"
        assert parsed.choices[0].message.content == ""
    completed = await chat.wait_for_event(raw.headers["X-SVC-Conversation-Id"], COMPLETED)
    assert completed.data["finish_reason"] == "stop"


async def test_an_assistants_refusal_part_is_its_text(chat: Chat) -> None:
    """QA finding: OpenAI's clients may send a declined answer back as a `refusal` part, a
    shape its SDK types allow for assistant content; it was a 400. It is the assistant's
    text, as a refusal with content null is; a user's message still sends text only."""
    declined = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I won't."}]}
    messages: Any = [*HELLO, declined, {"role": "user", "content": "why?"}]
    resp = await chat.raw_post({"model": UPSTREAM_MODEL, "messages": messages})
    assert resp.status == 200, await resp.text()
    sent = chat.stub.bodies[-1]["messages"]
    assert {"role": "assistant", "content": "I won't."} in sent
    user_refusal: Any = [{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]
    resp = await chat.raw_post({"model": UPSTREAM_MODEL, "messages": user_refusal})
    error = (await resp.json())["error"]
    assert resp.status == 400 and "a refusal part is an assistant's" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_refusal_is_the_answer_recorded_and_returned(chat: Chat, stream: bool) -> None:
    """A model that declines answers content null and a `refusal`: that text is the answer,
    not an empty one."""
    refusal = "I can\u2019t help with that."
    answer = {"role": "assistant", "content": None, "refusal": refusal}
    raw = await _upstream_answers_once(chat, answer, "stop", stream=stream)
    parsed = raw.parse()
    if isinstance(parsed, openai.AsyncStream):
        chunks_got = [c async for c in parsed]
        text = "".join(c.choices[0].delta.content or "" for c in chunks_got if c.choices)
    else:
        text = parsed.choices[0].message.content or ""
    assert text == refusal
    completed = await chat.wait_for_event(raw.headers["X-SVC-Conversation-Id"], COMPLETED)
    assert completed.data["content"] == refusal


async def test_content_as_text_parts_and_null_assistant_content(chat: Chat) -> None:
    messages: Any = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "one "}, {"type": "text", "text": "two"}],
        },
        {"role": "assistant", "content": None},
        {"role": "user", "content": "three"},
        # A refusal, as OpenAI returns one, sent back as history: the model sees it said so.
        {"role": "assistant", "content": None, "refusal": "I can't help with that."},
        {"role": "user", "content": "four"},
    ]
    await chat.client().chat.completions.create(model=UPSTREAM_MODEL, messages=messages)
    sent = chat.stub.bodies[-1]["messages"]
    contents = ["one two", "", "three", "I can't help with that.", "four"]
    assert [m["content"] for m in sent] == contents
    image: Any = [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
    with pytest.raises(openai.BadRequestError) as caught:
        await chat.client().chat.completions.create(
            model=UPSTREAM_MODEL, messages=[{"role": "user", "content": image}]
        )
    assert "of type image_url, which is not supported" in caught.value.message
    with pytest.raises(openai.BadRequestError):
        await chat.client().chat.completions.create(
            model=UPSTREAM_MODEL, messages=[{"role": "user", "content": None}]
        )


async def test_every_error_series_is_exported_before_its_first_error(chat: Chat) -> None:
    """QA finding: a series appeared at its code's first error, and `rate()`, which needs two
    samples, left that burst out of the error-rate alerts. Every code exported is one
    docs/chat.md lists."""
    text = await (await chat.service.http.get(chat.service.url("/metrics"))).text()
    for code in TURN_ERROR_CODES:
        assert f'svc_turn_errors_total{{code="{code}"}}' in text, code
    for status in ANSWERED_STATUSES:
        assert f'svc_http_errors_total{{status="{status}"}}' in text, status
    table = Path(__file__).parents[2] / "docs" / "chat.md"
    documented = {
        code.strip()
        for row in table.read_text(encoding="utf-8").splitlines()
        if re.match(r"\| \d{3} \|", row)
        for code in row.split("|")[3].split(",")
    }
    assert set(TURN_ERROR_CODES) <= documented, set(TURN_ERROR_CODES) - documented


async def closed_by_clients(chat: Chat) -> float:
    text = await (await chat.service.http.get(chat.service.url("/metrics"))).text()
    found = re.search(r'^svc_http_errors_total\{status="499"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


async def test_disconnect_mid_stream_still_records_the_turn(
    chat: Chat, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    hang_ups = await closed_by_clients(chat)
    chat.stub.tokens = 20
    chat.stub.chunk_delay_s = 0.05
    resp = await chat.raw_post({"model": UPSTREAM_MODEL, "messages": HELLO, "stream": True})
    conversation_id = resp.headers["X-SVC-Conversation-Id"]
    reader = SseReader(resp)
    first = await reader.frame()
    assert first is not None and "tok0" in first.data
    resp.close()
    completed = await chat.wait_for_event(conversation_id, COMPLETED)
    assert completed.data["content"] == "".join(f"tok{i} " for i in range(20))
    assert completed.data["finish_reason"] == "stop"
    assert chat.stub.calls == 1
    # A hang-up, in the access log and the metrics, as one before the stream started.
    async with asyncio.timeout(10):
        while True:  # the handler meets the closed connection at its next write
            if await closed_by_clients(chat) > hang_ups:
                break
            await asyncio.sleep(0.05)
    assert await closed_by_clients(chat) == hang_ups + 1
    access = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    streamed = [line for line in access if "POST /v1/chat/completions" in line]
    assert len(streamed) == 1 and '" 499 ' in streamed[0], streamed


async def test_a_json_client_that_leaves_mid_turn_is_a_hang_up_and_the_turn_is_recorded(
    chat: Chat, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    hang_ups = await closed_by_clients(chat)
    chat.stub.delay_s = 0.5
    body = {"model": UPSTREAM_MODEL, "messages": HELLO}
    key = {"Idempotency-Key": uid("idem-")}
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):  # leaves while the model is thinking
            await chat.raw_post(body, **key)
    retried = await chat.raw_post(body, **key)  # answered from the record
    assert retried.status == 200
    conversation_id = retried.headers["X-SVC-Conversation-Id"]
    completed = await chat.wait_for_event(conversation_id, COMPLETED)
    assert completed.data["content"] == (await retried.json())["choices"][0]["message"]["content"]
    assert chat.stub.calls == 1
    async with asyncio.timeout(10):
        while True:  # the first request's handler returns when the turn is recorded
            if await closed_by_clients(chat) > hang_ups:
                break
            await asyncio.sleep(0.05)
    assert await closed_by_clients(chat) == hang_ups + 1
    access = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    answered = [line for line in access if "POST /v1/chat/completions" in line]
    assert len(answered) == 2, answered
    left, retried = (sum(f'" {status} ' in line for line in answered) for status in (499, 200))
    assert left == retried == 1, answered


async def test_a_body_cut_short_is_one_hang_up(chat: Chat) -> None:
    """Review finding: a client that left in the middle of its body was counted as two
    hang-ups, by the handler's answer and again by the check for a client gone."""
    hang_ups = await closed_by_clients(chat)
    host, port = chat.service.server.host, chat.service.server.port
    _, writer = await asyncio.open_connection(host, port)
    writer.write(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
        f"{chat.key}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        '{"model": '.encode()
    )
    await writer.drain()
    writer.close()
    async with asyncio.timeout(10):
        while await closed_by_clients(chat) == hang_ups:  # noqa: ASYNC110 (a metric: polled)
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # a second count would come within this
    assert await closed_by_clients(chat) == hang_ups + 1


async def test_the_warning_of_a_failed_turn_names_its_request_id(
    chat: Chat, caplog: pytest.LogCaptureFixture
) -> None:
    """QA finding: the WARNING line of a 502 could not be tied to its request: only the
    access log line (INFO, gone at SVC_LOG_LEVEL=warning) held the id the client saw."""
    caplog.set_level(logging.WARNING, logger="gateway.errors")
    failed = stub_upstream.Fault(500, "the model server failed")
    chat.stub.faults.extend([failed, failed])  # and its one retry (SVC_LLM_RETRIES)
    answer = await chat.raw_post({"model": UPSTREAM_MODEL, "messages": HELLO})
    assert answer.status == 502
    (line,) = _logged(caplog, "gateway.errors", "POST /v1/chat/completions -> 502")
    assert f"({answer.headers['X-Request-Id']})" in line, line


async def test_a_json_client_that_leaves_before_its_turn_fails_is_a_hang_up_too(
    chat: Chat, caplog: pytest.LogCaptureFixture
) -> None:
    """QA finding: the answer (an upstream's 502) reached no one, and the access log and the
    metrics said 502, where a 200 in its place was a 499; and no line said the client left."""
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    caplog.set_level(logging.INFO, logger="gateway.errors")
    hang_ups = await closed_by_clients(chat)
    upstream_errors = await _metric(chat, r'svc_http_errors_total\{status="502"\}')
    chat.stub.delay_s = 0.5
    failed = stub_upstream.Fault(500, "the model server failed")
    chat.stub.faults.extend([failed, failed])  # and its one retry (SVC_LLM_RETRIES)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):  # leaves while the model is thinking
            await chat.raw_post({"model": UPSTREAM_MODEL, "messages": HELLO})
    async with asyncio.timeout(10):
        while await closed_by_clients(chat) == hang_ups:  # noqa: ASYNC110 (a metric: polled)
            await asyncio.sleep(0.05)
    assert await closed_by_clients(chat) == hang_ups + 1
    assert _logged(caplog, "gateway.errors", "the client closed the connection before its")
    assert _logged(caplog, "gateway.errors", "502 upstream_error")  # the turn did fail
    # Counted once, as what the client got: a hang-up, not a 502 it never received.
    assert await _metric(chat, r'svc_http_errors_total\{status="502"\}') == upstream_errors
    (access,) = _logged(caplog, "aiohttp.access", "POST /v1/chat/completions")
    assert '" 499 ' in access, access


async def _stream_never_read(
    chat: Chat, stream: bool = True
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A turn (streamed unless `stream` is false) sent from a socket with a tiny receive
    window, which the caller does not read: the gateway's writes soon wait for it to drain."""
    body = orjson.dumps({"model": UPSTREAM_MODEL, "messages": HELLO, "stream": stream})
    host, port = chat.service.server.host, chat.service.server.port
    reader, writer = await asyncio.open_connection(host, port)
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {chat.key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    return reader, writer


async def test_a_client_that_stops_reading_then_leaves_is_a_hang_up_not_an_error(
    chat: Chat, caplog: pytest.LogCaptureFixture
) -> None:
    """A client with a tiny receive window that never reads: the gateway's writes back up
    until one waits for the socket to drain, then the client closes. That is the client
    leaving (499, the turn recorded), not an internal error."""
    caplog.set_level(logging.INFO, logger="gateway.chat")
    chat.stub.tokens = 20_000  # megabytes of chunks: far more than the socket buffers hold
    errors_before = await turn_errors(chat, "internal_error")
    reader, writer = await _stream_never_read(chat)
    status_line = await reader.readline()
    assert b" 200 " in status_line
    await asyncio.sleep(1.0)  # the gateway's writer is now paused on a full socket
    writer.close()
    async with asyncio.timeout(30):
        while True:
            if "chat client went away mid-stream" in caplog.text:
                break
            await asyncio.sleep(0.05)
    assert await turn_errors(chat, "internal_error") == errors_before
    assert "chat stream failed" not in caplog.text


async def test_a_client_that_stops_reading_and_stays_is_cut_off(
    chat: Chat, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review finding: a write waiting for a client that neither reads nor leaves waited
    for ever, holding the handler and the answer's undelivered text. Now the stream is cut
    off, as a feed's stalled reader is, and the turn is recorded all the same."""
    caplog.set_level(logging.INFO, logger="gateway.chat")
    monkeypatch.setattr(gateway.chat, "STREAM_WRITE_TIMEOUT_S", 0.5)
    chat.stub.tokens = 20_000
    reader, writer = await _stream_never_read(chat)
    headers = []
    while (line := await reader.readline()) not in (b"\r\n", b""):
        headers.append(line.decode())
    assert " 200 " in headers[0]
    (conversation_id,) = [
        h.split(":", 1)[1].strip() for h in headers if h.lower().startswith("x-svc-conversation-id")
    ]
    try:
        async with asyncio.timeout(30):
            while True:  # cut off (its socket aborted) by the gateway: the client stays
                if "its stream is cut off" in caplog.text:
                    break
                await asyncio.sleep(0.05)
            while True:  # the turn runs on without a reader, and is recorded
                events = await chat.events(conversation_id)
                if any(e.type == COMPLETED for e in events):
                    break
                await asyncio.sleep(0.05)
    finally:
        writer.close()


async def test_a_client_that_stops_reading_a_json_answer_is_cut_off(
    chat: Chat, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review finding: a JSON answer goes to the connection whole, and aiohttp then waited
    without a time limit for a client that neither read it nor left, holding the handler
    and the answer's bytes. Now the connection is closed and the request logged as a
    hang-up (499)."""
    caplog.set_level(logging.INFO, logger="gateway.http_server")
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    monkeypatch.setattr(gateway.http_server, "RESPONSE_STALL_S", 0.5)
    # A control character is six bytes in JSON (`\\u0001`): about 6 MB, more than the
    # socket buffers hold.
    chat.stub.reply = "\x01" * 990_000
    hang_ups = await _metric(chat, r'svc_http_errors_total\{status="499"\}')
    reader, writer = await _stream_never_read(chat, stream=False)
    await _cut_off_as_a_hang_up(caplog, reader, writer, "POST /v1/chat/completions")
    assert await _metric(chat, r'svc_http_errors_total\{status="499"\}') == hang_ups + 1


async def test_a_client_that_stops_reading_an_export_is_cut_off(
    chat: Chat, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review finding: a download written by its handler page by page waited for each page
    to drain without a time limit; the docs said it was cut off like a JSON answer."""
    caplog.set_level(logging.INFO, logger="gateway.http_server")
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    monkeypatch.setattr(gateway.http_server, "RESPONSE_STALL_S", 0.5)
    chat.stub.reply = "\x01" * 990_000  # six bytes each in the JSON export: about 6 MB
    answer = await chat.raw_post({"model": UPSTREAM_MODEL, "messages": HELLO})
    assert answer.status == 200
    conversation_id = answer.headers["X-SVC-Conversation-Id"]
    await answer.read()
    admin = await chat.issue_key(chat.workspace, scopes=("admin:read",))
    host, port = chat.service.server.host, chat.service.server.port
    reader, writer = await asyncio.open_connection(host, port)
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    path = f"/v1/admin/conversations/export?conversation_id={conversation_id}"
    writer.write(
        f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {admin}\r\n\r\n".encode()
    )
    await _cut_off_as_a_hang_up(caplog, reader, writer, "GET /v1/admin/conversations/export")


async def _cut_off_as_a_hang_up(
    caplog: pytest.LogCaptureFixture,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    request: str,
) -> None:
    """The answer to `request` began (200) on a connection whose client then reads nothing:
    waits for the gateway to end it, then checks it said why and logged a hang-up (499)."""
    try:
        assert b" 200 " in await reader.readline()
        async with asyncio.timeout(30):
            while not _logged(caplog, "aiohttp.access", request):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    finally:
        writer.close()
    assert _logged(caplog, "gateway.http_server", "took none of its answer")
    (access,) = _logged(caplog, "aiohttp.access", request)
    assert '" 499 ' in access, access


def _logged(caplog: pytest.LogCaptureFixture, logger: str, text: str) -> list[str]:
    lines = (r.getMessage() for r in caplog.records if r.name == logger)
    return [line for line in lines if text in line]


async def _metric(chat: Chat, series: str) -> float:
    text = await (await chat.service.http.get(chat.service.url("/metrics"))).text()
    found = re.search(rf"^{series} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def turn_errors(chat: Chat, code: str) -> float:
    return await _metric(chat, rf'svc_turn_errors_total\{{code="{code}"\}}')


async def test_a_client_gone_before_its_stream_starts_is_not_a_server_error(
    chat: Chat, caplog: pytest.LogCaptureFixture
) -> None:
    """The second turn of a conversation waits in the actor's mailbox behind the first; its
    client leaves meanwhile, so its stream's headers meet a closed connection."""
    # The first turn takes 2 s; the second's client leaves after 1 s (time enough, on a
    # loaded host, for its request to reach the server), while it waits behind the first.
    chat.stub.chunk_delay_s = 0.4
    internal_errors = await turn_errors(chat, "internal_error")  # the registry is per process
    body = {"model": UPSTREAM_MODEL, "messages": HELLO, "stream": True}
    first = await chat.raw_post(body)
    conversation_id = first.headers["X-SVC-Conversation-Id"]
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(1.0):
            await chat.raw_post(body, **{"X-SVC-Conversation-Id": conversation_id})
    await first.read()
    async with asyncio.timeout(20):
        while True:
            events = await chat.events(conversation_id)
            if sum(e.type == COMPLETED for e in events) == 2:
                break  # both turns recorded, the second without a reader
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # the second handler has met the closed connection by now
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    assert await turn_errors(chat, "internal_error") == internal_errors


async def turns_counted(chat: Chat) -> float:
    text = await (await chat.service.http.get(chat.service.url("/metrics"))).text()
    found = re.search(r"^svc_turn_duration_seconds_count (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def test_turn_metrics_count_turns_not_refused_requests(chat: Chat) -> None:
    """The alert divides failed turns by turns: both count the requests that reached the
    conversation actor. One refused before (an unknown model, a bad key) is neither."""
    turns, refused = await turns_counted(chat), await turn_errors(chat, "model_not_found")
    rejected = await turn_errors(chat, "upstream_rejected")
    await chat.client().chat.completions.create(model=OFFLINE, messages=HELLO)
    with pytest.raises(openai.NotFoundError):
        await chat.client().chat.completions.create(model="gpt-nope", messages=HELLO)
    with pytest.raises(openai.AuthenticationError):
        await chat.client("svc_not-a-key").chat.completions.create(model=OFFLINE, messages=HELLO)
    chat.stub.faults.append(stub_upstream.Fault(400, "the model refused the request"))
    resp = await chat.raw_post({"model": UPSTREAM_MODEL, "messages": HELLO})
    assert resp.status == 502
    assert await turns_counted(chat) == turns + 2
    assert await turn_errors(chat, "upstream_rejected") == rejected + 1
    assert await turn_errors(chat, "model_not_found") == refused
    assert await turn_errors(chat, "unauthorized") == 0


async def test_cursor_header_gives_read_your_writes(chat: Chat, database_url: str) -> None:
    """The read models are held back (their batch waits on a lock) until the read with the
    answer's cursor has begun: only that wait can show it the answer. (Review finding: the
    admin key, issued after the turn and waited for, had let them catch up already.)"""
    admin = await chat.issue_key(chat.workspace, scopes=("*",))
    holder = await asyncpg.connect(database_url)
    try:
        hold = holder.transaction()
        await hold.start()
        await holder.execute("LOCK TABLE messages IN EXCLUSIVE MODE")  # reads still pass
        raw = await chat.client().chat.completions.with_raw_response.create(
            model=OFFLINE, messages=[{"role": "user", "content": "remember the walrus"}]
        )
        answer = raw.parse().choices[0].message.content or ""
        path, conversation = (
            "/v1/admin/conversations/messages",
            raw.headers["X-SVC-Conversation-Id"],
        )
        unwaited = await chat.service.get(path, admin, id=conversation)
        assert answer[:40] not in await unwaited.text()  # not applied yet
        waited = asyncio.create_task(
            chat.service.get_json(
                path, admin, id=conversation, min_cursor=raw.headers["X-SVC-Cursor"]
            )
        )
        runner = chat.service.app[PROJECTIONS]
        async with asyncio.timeout(10):
            while True:  # the read is waiting on its cursor before the models may move
                if runner._readers_waiting:
                    break
                await asyncio.sleep(0.01)
        await hold.rollback()
        body = await waited
    finally:
        await holder.close()
    text = orjson.dumps(body).decode()
    assert "remember the walrus" in text
    assert answer[:40] in text


async def test_disconnect_before_the_first_delta_still_records_the_turn(
    chat: Chat, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    # The client leaves after 1 s (time enough, on a loaded host, for its request to reach
    # the server), while the model thinks for 2 s.
    chat.stub.delay_s = 2.0
    key = uid("idem-")
    body = {"model": UPSTREAM_MODEL, "messages": HELLO, "stream": True}
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(1.0):
            await chat.raw_post(body, **{"Idempotency-Key": key})
    # The retry with the same key waits for the first attempt in the actor's mailbox.
    resp = await chat.raw_post(body, **{"Idempotency-Key": key})
    text = await resp.text()
    assert resp.status == 200 and "tok4" in text and text.rstrip().endswith("data: [DONE]")
    assert chat.stub.calls == 1
    async with asyncio.timeout(10):  # both requests' handlers have returned
        while True:
            lines = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
            if sum("POST /v1/chat/completions" in line for line in lines) >= 2:
                break
            await asyncio.sleep(0.02)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
