"""A model provider speaking the OpenAI chat-completions protocol to any compatible server.

One pooled `aiohttp.ClientSession` per provider, opened on first use and closed by `aclose()`.
A call streams (`stream: true`, `stream_options.include_usage`), so deltas reach the client as
the upstream produces them, unless the request says nobody reads the deltas
(`ModelRequest.stream` false: a JSON, non-streaming chat request): then the server is asked
for one `chat.completion`, which costs it and us less than a stream of chunks.

Failure policy:
- The call has one time budget covering every attempt and the back-off between them: the
  request's (`ModelRequest.call_timeout_s`, the one its turn recorded its expiry by) or else
  the provider's own `call_timeout_s`; 0 = none. When it runs out the call fails with
  `UpstreamTimeout` (code `ErrCallTimeout`) and is never retried.
- Transient failures (connection errors, HTTP 429, 502, 503, 504) are retried up to `retries`
  times with exponential back-off and jitter, but only while no delta has been yielded: once
  text reached the caller a retry would duplicate it. A 429 for an account out of credit
  (`QUOTA_CODES`) is no transient failure: `upstream_quota_exceeded` at once. When the
  retries are spent, the last refusal's `Retry-After` goes to the client.
- A 400 whose code names a problem of the client's request (`context_length_exceeded`, ...:
  `UPSTREAM_REQUEST_PROBLEMS`) is the client's 400 with that code; an unknown model name the
  client chose, its 404.
- Anything else becomes `UpstreamError` (502) carrying the upstream's message, shortened and
  scrubbed of credentials. The API key is sent only in the Authorization header and never
  appears in a log line or an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import email.utils
import json
import logging
import math
import random
import re
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import aiohttp
import orjson

from actors.models.port import (
    ChatMessage,
    Finished,
    ModelEvent,
    ModelRequest,
    TextDelta,
    Usage,
    well_formed,
)
from actors.models.tokens import estimate_prompt_tokens, estimate_tokens
from schemas.conversation import MAX_CONTENT
from schemas.errors import (
    UPSTREAM_REQUEST_PROBLEMS,
    InvalidInput,
    NotFound,
    UpstreamError,
    UpstreamTimeout,
)
from schemas.redaction import REDACTED, redact

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://api.openai.com/v1"
TRANSIENT_STATUSES = frozenset({429, 502, 503, 504})
QUOTA_CODES = frozenset({"insufficient_quota", "billing_hard_limit_reached", "billing_not_active"})
"""Error codes (or types) of a model server's refusal, a 429 most often, that mean the
account is out of credit: final (`upstream_quota_exceeded`), never retried as a rate limit."""
_MAX_MESSAGE_CHARS = 300
_MAX_EVENT_BYTES = 4 * 1024 * 1024
_MAX_RETRY_AFTER_S = 3600.0
"""A model server's `Retry-After` beyond an hour is no plan to ask again: it is passed on as
an hour (and the back-off's own wait is capped far lower)."""
# A message holds MAX_CONTENT characters; in JSON each may take up to 6 bytes (\uXXXX).
_MAX_COMPLETION_BYTES = 6 * MAX_CONTENT + 64 * 1024
# What a model server's messages hold of an API key besides what `redact` finds: an OpenAI
# style key by its prefix, and a key masked by its issuer (sk-ab****wxyz, ****wxyz), which
# still gives part of it away.
# A run is looked at from its start only (the lookbehind): from every character of a long run
# without `***`, the time would grow with the run's square.
_KEY_SHAPES = re.compile(
    r"\bsk-[A-Za-z0-9_\-]{6,}+|(?<![A-Za-z0-9_\-])[A-Za-z0-9_\-]*+\*{3,}+[A-Za-z0-9_\-]*+"
)


_JSON_BODY = {"Content-Type": "application/json"}
"""Request bodies are encoded with orjson, a few times faster than aiohttp's `json=`."""


class _Transient(Exception):
    def __init__(self, reason: str, retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


class OpenAICompatProvider:
    """Serves `model` (or, when `model` is blank, any model name the client asks for)."""

    name = "openai-compat"

    def __init__(
        self,
        *,
        base_url: str = "",
        model: str = "",
        api_key: str | None = None,
        call_timeout_s: float = 120.0,
        retries: int = 3,
        temperature: float | None = None,
        top_p: float | None = None,
        backoff_base_s: float = 0.25,
        backoff_max_s: float = 8.0,
        max_connections: int = 256,
    ) -> None:
        self.base_url = (base_url or DEFAULT_BASE_URL).rstrip("/")
        self.model = model
        self.model_names: tuple[str, ...] = (model,) if model else ()
        self._url = f"{self.base_url}/chat/completions"
        self._api_key = api_key or None
        self._call_timeout_s = call_timeout_s
        self._retries = max(0, retries)
        self._temperature = temperature
        self._top_p = top_p
        self._backoff_base_s = backoff_base_s
        self._backoff_max_s = backoff_max_s
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"OpenAICompatProvider(base_url={self.base_url!r}, model={self.model!r})"

    def serves(self, model: str) -> bool:
        return not self.model or model == self.model

    def reconfigure(
        self, *, call_timeout_s: float, temperature: float | None, top_p: float | None
    ) -> None:
        """Apply the live (L) settings; calls already running keep the values they began with."""
        self._call_timeout_s = call_timeout_s
        self._temperature = temperature
        self._top_p = top_p

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Accept": "text/event-stream"}
            if self._api_key:
                headers["Authorization"] = f"Bearer {self._api_key}"
            self._session = aiohttp.ClientSession(
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None),
                connector=aiohttp.TCPConnector(limit=self._max_connections),
                raise_for_status=False,
            )
        return self._session

    def payload(self, request: ModelRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model or request.model,
            "messages": _messages(request.messages),
            "stream": request.stream,
        }
        if request.stream:
            body["stream_options"] = {"include_usage": True}
        temperature = request.temperature if request.temperature is not None else self._temperature
        top_p = request.top_p if request.top_p is not None else self._top_p
        if temperature is not None:
            body["temperature"] = temperature
        if top_p is not None:
            body["top_p"] = top_p
        if request.max_tokens is not None:
            body[request.max_tokens_as] = request.max_tokens
        if request.stop:
            body["stop"] = list(request.stop)
        optional = {
            "seed": request.seed,
            "presence_penalty": request.presence_penalty,
            "frequency_penalty": request.frequency_penalty,
            "reasoning_effort": request.reasoning_effort,
            "verbosity": request.verbosity,
        }
        body.update({name: value for name, value in optional.items() if value is not None})
        return body

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        loop = asyncio.get_running_loop()
        budget = self._call_timeout_s if request.call_timeout_s is None else request.call_timeout_s
        deadline = loop.time() + budget if budget > 0 else None
        body = self.payload(request)
        headers = _JSON_BODY
        if request.traceparent:  # the turn's trace continues at the model server
            headers = {**_JSON_BODY, "traceparent": request.traceparent}
        attempt = 0
        while True:
            yielded = False
            try:
                attempt_events = self._attempt(body, headers, request.messages, deadline)
                async with contextlib.aclosing(attempt_events) as events:
                    async for item in events:
                        yielded = True
                        yield item
                return
            except _Transient as exc:
                if yielded:
                    raise UpstreamError(
                        f"model server connection failed mid-answer: {exc.reason}",
                        code="upstream_interrupted",
                    ) from None
                if attempt >= self._retries:
                    raise _unavailable(
                        f"model server unavailable after {attempt + 1} attempts: {exc.reason}",
                        exc,
                    ) from None
                delay = self._backoff(attempt, exc.retry_after_s)
                if deadline is not None and loop.time() + delay >= deadline:
                    # Not a timeout: the model server said no, and when to ask again.
                    raise _unavailable(
                        f"model server unavailable ({exc.reason}); the next attempt would "
                        f"come after the call's {budget:g}s budget (SVC_LLM_CALL_TIMEOUT_S)",
                        exc,
                    ) from None
                log.warning(
                    "model call attempt %d failed (%s); retrying in %.2fs",
                    attempt + 1,
                    exc.reason,
                    delay,
                )
                attempt += 1
                await asyncio.sleep(delay)
            except TimeoutError:
                raise _timeout(budget) from None

    def _backoff(self, attempt: int, retry_after_s: float | None) -> float:
        # The exponent is bounded: 2.0**1024 overflows, and SVC_LLM_RETRIES may be that large.
        ceiling = min(self._backoff_max_s, self._backoff_base_s * 2.0 ** min(attempt, 60))
        delay = ceiling / 2 + random.uniform(0, ceiling / 2)
        if retry_after_s is not None:
            delay = max(delay, min(retry_after_s, self._backoff_max_s))
        return delay

    async def _attempt(
        self,
        body: dict[str, Any],
        headers: Mapping[str, str],
        messages: tuple[ChatMessage, ...],
        deadline: float | None,
    ) -> AsyncGenerator[ModelEvent, None]:
        remaining = None if deadline is None else deadline - asyncio.get_running_loop().time()
        if remaining is not None and remaining <= 0:
            raise TimeoutError
        timeout = aiohttp.ClientTimeout(total=remaining)
        try:
            request = self._client().post(
                self._url, data=orjson.dumps(body), headers=headers, timeout=timeout
            )
            async with request as resp:
                if resp.status != 200:
                    await _raise_for_status(resp, self._api_key, forwarded=not self.model)
                if resp.content_type == "application/json":
                    completion = _json_body(await _read_capped(resp.content))
                    async for event in _from_completion(completion, messages):
                        yield event
                    return
                stream = _from_stream(resp.content, messages, self._api_key, resp.content_type)
                async for event in stream:
                    yield event
        except aiohttp.ServerTimeoutError:
            raise TimeoutError from None
        except aiohttp.ClientConnectorError as exc:
            # Caught before ClientConnectionError, its base: no connection was made (refused,
            # a name that does not resolve, a certificate that does not verify, a proxy).
            raise _Transient(
                f"could not connect ({type(exc).__name__}); check SVC_LLM_GATEWAY_URL and "
                "that the model server runs and is reachable from here"
            ) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise _Transient(type(exc).__name__) from None
        except aiohttp.RedirectClientError as exc:
            # Before InvalidURL, which a redirect to a malformed address also is: the server
            # sent it there, not the setting.
            raise UpstreamError(
                f"model server redirected the call to an address that is not http(s) or not a "
                f"URL ({type(exc).__name__}); set SVC_LLM_GATEWAY_URL to the model server's "
                "own address",
                code="upstream_bad_response",
            ) from None
        except (aiohttp.InvalidURL, aiohttp.NonHttpUrlClientError):
            raise UpstreamError(
                "SVC_LLM_GATEWAY_URL is not a usable URL; set it to the model server's "
                "http(s) address",
                code="upstream_misconfigured",
            ) from None
        except aiohttp.ClientResponseError as exc:
            # Not HTTP at all, a header past aiohttp's limits, a redirect loop: the server at
            # SVC_LLM_GATEWAY_URL is not a model server that works.
            raise UpstreamError(
                f"model server sent no usable HTTP response ({type(exc).__name__}: "
                f"{_scrub(str(exc.message)[:200], self._api_key)})",
                code="upstream_bad_response",
            ) from None
        except ValueError:
            # aiohttp's line reader refuses a line beyond its buffer limit.
            raise UpstreamError(
                "model server sent an oversized or malformed stream line",
                code="upstream_bad_stream",
            ) from None


async def _read_capped(content: aiohttp.StreamReader) -> bytes:
    """The whole body, refused as soon as it passes `_MAX_COMPLETION_BYTES`: an answer that
    large could not be recorded, and reading it all first would hold it all in memory."""
    body = bytearray()
    async for chunk in content.iter_any():
        body += chunk
        if len(body) > _MAX_COMPLETION_BYTES:
            raise UpstreamError(
                f"model server answered with a completion over {_MAX_COMPLETION_BYTES:,} "
                "bytes, more than a message holds; lower max_tokens",
                code="upstream_bad_response",
            )
    return bytes(body)


def _json_body(body: bytes) -> object:
    try:
        return _lenient_json(body)
    except ValueError:
        raise UpstreamError(
            "model server answered application/json that is not JSON", code="upstream_bad_response"
        ) from None


def _unavailable(message: str, last: _Transient) -> UpstreamError:
    """The retries are spent: the client is told when the model server said to ask again."""
    error = UpstreamError(message, code="upstream_unavailable")
    error.retry_after_s = last.retry_after_s
    return error


def _timeout(budget_s: float) -> UpstreamTimeout:
    return UpstreamTimeout(
        f"model call exceeded its {budget_s:g}s budget (SVC_LLM_CALL_TIMEOUT_S)",
        code="ErrCallTimeout",
    )


async def _raise_for_status(
    resp: aiohttp.ClientResponse, api_key: str | None, *, forwarded: bool
) -> None:
    """Raise what the upstream's refusal means here. `forwarded`: the client's own model
    name was sent (no SVC_LLM_MODEL), so the upstream's "no such model" is the client's
    404, which SDKs do not retry; with a configured model it is this server's 502. A 400
    whose code names a problem of the request (UPSTREAM_REQUEST_PROBLEMS) is the client's
    400 with that code."""
    status = resp.status
    if status in (401, 403):
        # Model servers quote the refused key here, often masked as a prefix and a suffix
        # (sk-ab****wxyz), which is still part of the secret: their text is not passed on.
        raise UpstreamError(
            f"model server refused the configured credentials (HTTP {status}); check "
            "SVC_NATIVE_API_KEY",
            code="upstream_auth_failed",
        )
    message, upstream_code = await _error_message(resp)
    message = _scrub(message, api_key)
    if upstream_code in QUOTA_CODES:
        # A 429 that no wait mends: the account is out of credit until someone pays.
        raise UpstreamError(
            f"the model server's account has no quota left (HTTP {status}: {message}); check "
            "the plan and billing of the account SVC_NATIVE_API_KEY belongs to",
            code="upstream_quota_exceeded",
        )
    if status == 404 and forwarded and upstream_code == "model_not_found":
        raise NotFound(f"the model server has no such model: {message}", code="model_not_found")
    if status == 400 and upstream_code in UPSTREAM_REQUEST_PROBLEMS:
        # The client's messages are too long or refused: its own 400, with the code it can
        # act on (the same request fails the same way, so no retry either).
        raise InvalidInput(f"the model server refused the request: {message}", code=upstream_code)
    if status in TRANSIENT_STATUSES:
        raise _Transient(f"HTTP {status}: {message}", _retry_after(resp.headers))
    code = {
        400: "upstream_rejected",
        404: "upstream_model_not_found",
        422: "upstream_rejected",
    }.get(status, "upstream_error")
    raise UpstreamError(f"model server answered HTTP {status}: {message}", code=code)


_ERROR_BODY_BYTES = 8192
"""The most of an error body read: an OpenAI error object is far smaller."""


async def _head(content: aiohttp.StreamReader, limit: int) -> bytes:
    """The body's first `limit` bytes, or all of it when shorter. One `read(n)` returns what
    has arrived so far, which may be part of an error object sent in two TCP segments or
    two chunks: its code (`insufficient_quota`, `context_length_exceeded`) was then lost."""
    head = bytearray()
    while len(head) < limit:
        part = await content.read(limit - len(head))
        if not part:
            break
        head += part
    return bytes(head)


async def _error_message(resp: aiohttp.ClientResponse) -> tuple[str, str | None]:
    """The upstream's error message and, in the OpenAI shape, its error code (its `type`
    when it has no code: OpenAI's quota refusals have said `insufficient_quota` in both)."""
    try:
        text = (await _head(resp.content, _ERROR_BODY_BYTES)).decode("utf-8", "replace")
    except TimeoutError:
        # The call's budget ran out while the refusal was being read: that is the call's
        # timeout (ErrCallTimeout), not the refusal, whatever the status said.
        raise
    except aiohttp.ClientError:
        return resp.reason or "no message", None
    with contextlib.suppress(ValueError):
        data = _lenient_json(text)
        if isinstance(data, dict):
            error = data.get("error", data)
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                code = error.get("code")
                if not isinstance(code, str) or not code:
                    code = error.get("type")
                code = well_formed(code) if isinstance(code, str) else None
                return well_formed(error["message"]), code
            if isinstance(error, str):
                return well_formed(error), None
    return text.strip() or resp.reason or "no message", None


_READ_CHARS = _MAX_MESSAGE_CHARS * 4
"""How much of a message (its white space collapsed) is searched for credentials: no scan
reads past it, as a stream's error chunk may be megabytes."""


def _scrub(message: str, api_key: str | None) -> str:
    message = " ".join(message.split())
    if len(message) > _READ_CHARS:
        # The word cut in two may be part of a credential its pattern no longer recognises
        # (a URL's password without its `@`): it goes, and what follows it.
        message = message[:_READ_CHARS]
        message = message.rsplit(" ", 1)[0] if " " in message else message
    if api_key:
        message = _without_key_fragments(message, api_key)
    message = _KEY_SHAPES.sub(REDACTED, redact(message, ()))
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[: _MAX_MESSAGE_CHARS - 3] + "..."
    return message


KEY_FRAGMENT_CHARS = 8
"""A model server may quote part of the key it was sent (cut short, or upper-cased): any run
of this many characters of it, in any case, is removed from its messages."""
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _without_key_fragments(message: str, api_key: str) -> str:
    # ASCII-only lowering keeps every index of `low` that of `message`.
    key, low = api_key.translate(_ASCII_LOWER), message.translate(_ASCII_LOWER)
    n = KEY_FRAGMENT_CHARS
    if len(key) < n:
        return message.replace(api_key, REDACTED)
    windows = {key[i : i + n] for i in range(len(key) - n + 1)}
    kept: list[str] = []
    start = i = 0
    while i <= len(low) - n:
        if low[i : i + n] not in windows:
            i += 1
            continue
        end = i + n
        while end < len(low) and low[i : end + 1] in key:
            end += 1
        kept += [message[start:i], REDACTED]
        start = i = end
    kept.append(message[start:])
    return "".join(kept)


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """The refusal's `Retry-After` in seconds (RFC 9110: a number of seconds or an HTTP
    date), at most `_MAX_RETRY_AFTER_S`; None when absent or not a time."""
    value = headers.get("Retry-After")
    if value is None:
        return None
    seconds: float | None
    try:
        seconds = float(value)
    except ValueError:
        seconds = _seconds_until(value)
    if seconds is None or not math.isfinite(seconds):
        return None
    return min(_MAX_RETRY_AFTER_S, max(0.0, seconds))


def _seconds_until(http_date: str) -> float | None:
    try:
        when = email.utils.parsedate_to_datetime(http_date)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT; an obsolete form may not say so
        when = when.replace(tzinfo=datetime.UTC)
    return (when - datetime.datetime.now(datetime.UTC)).total_seconds()


def _messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """The messages as sent upstream. A tool's output, sent as user text, joins the user
    message next to it: chat templates that insist on user and assistant taking turns
    (Mistral's, Llama 2's) refuse two user messages in a row, which the client never sent.
    Not when that would put two speakers' words under one `name`: those stay apart."""
    sent: list[dict[str, str]] = []
    voices: list[set[str | None]] = []  # whose words each message holds (a tool's: nobody's)
    holds_tool_output = False
    for message in messages:
        item = _message(message)
        is_tool = message.role == "tool"
        voice: set[str | None] = set() if is_tool else {message.name}
        if (
            sent
            and (is_tool or holds_tool_output)
            and item["role"] == sent[-1]["role"] == "user"
            and len(voices[-1] | voice) <= 1
        ):
            voices[-1] |= voice
            sent[-1] = _joined(sent[-1], item, voices[-1])
        else:
            sent.append(item)
            voices.append(voice)
        # Only a tool's output draws the next user message in: two user messages of the
        # client's own stay two, as sent.
        holds_tool_output = is_tool
    return sent


def _joined(first: dict[str, str], then: dict[str, str], voices: set[str | None]) -> dict[str, str]:
    joined = {"role": "user", "content": f"{first['content']}\n\n{then['content']}"}
    name = next(iter(voices), None)
    if name:
        joined["name"] = name
    return joined


def _message(message: ChatMessage) -> dict[str, str]:
    if message.role == "tool":
        return _tool_output_as_user_text(message)
    out = {"role": message.role, "content": message.content}
    if message.name:
        out["name"] = message.name
    return out


def _tool_output_as_user_text(message: ChatMessage) -> dict[str, str]:
    """A `tool` message answers an assistant's tool call; model servers refuse one without
    the `tool_call_id` of a call in the history, and this endpoint makes no calls (client
    tools are refused). Its text still belongs to the conversation: the model reads it as a
    user message that says what it is."""
    source = f"the tool {message.name}" if message.name else "a tool"
    return {"role": "user", "content": f"Output of {source}:\n{message.content}"}


async def _from_stream(
    content: aiohttp.StreamReader,
    messages: tuple[ChatMessage, ...],
    api_key: str | None,
    content_type: str,
) -> AsyncIterator[ModelEvent]:
    finish_reason: str | None = None
    usage: Usage | None = None
    completion_words = 0
    seen_data = False
    async for data in _sse_data(content):
        seen_data = True
        if data.strip() == "[DONE]":
            break
        chunk = _json_object(data)
        if _is_error_chunk(chunk):
            raise UpstreamError(
                f"model server failed mid-answer: {_scrub(_chunk_error(chunk), api_key)}",
                code="upstream_interrupted",
            )
        usage = _usage(chunk.get("usage")) or usage
        for choice in _choices(chunk):
            text = _answer_text(choice.get("delta"))
            if text:
                completion_words += estimate_tokens(text)
                yield TextDelta(text)
            reason = choice.get("finish_reason")
            if isinstance(reason, str) and reason:
                finish_reason = _finish_reason(reason)
    else:
        if not seen_data and content_type != "text/event-stream":
            # Not a stream cut short (which a retry may mend) but no stream at all: an HTML
            # page, a proxy's answer. Asking again gets the same.
            raise UpstreamError(
                f"model server answered 200 with neither a chat completion nor an event "
                f"stream (Content-Type: {content_type}); check that SVC_LLM_GATEWAY_URL is "
                "an OpenAI-compatible API",
                code="upstream_bad_stream",
            )
        if finish_reason is None:
            raise _Transient("stream ended before the answer finished")
    if usage is None:
        usage = Usage(estimate_prompt_tokens(messages), completion_words)
    yield Finished(finish_reason=finish_reason or "stop", usage=usage)


CALLS_NOT_PASSED_ON = frozenset({"tool_calls", "function_call"})


def _finish_reason(reason: object) -> str:
    """The upstream's reason the answer ended, as the client gets and the log records it.
    Empty or absent is `stop`. So is a tool or function call: this endpoint sends the model
    no tools and passes no call on, and a client told `tool_calls` looks for calls that are
    not in the answer (the openai SDKs' `message.tool_calls` is None)."""
    if not isinstance(reason, str) or not reason or reason in CALLS_NOT_PASSED_ON:
        return "stop"
    return reason


async def _from_completion(
    data: object, messages: tuple[ChatMessage, ...]
) -> AsyncIterator[ModelEvent]:
    """Some servers ignore `stream: true` and answer with one `chat.completion` object."""
    chunk = data if isinstance(data, dict) else {}
    choices = _choices(chunk)
    if not choices:
        raise UpstreamError("model server answered without choices", code="upstream_error")
    text = _answer_text(choices[0].get("message"))
    if text:
        yield TextDelta(text)
    usage = _usage(chunk.get("usage")) or Usage(
        estimate_prompt_tokens(messages), estimate_tokens(text)
    )
    yield Finished(finish_reason=_finish_reason(choices[0].get("finish_reason")), usage=usage)


def _answer_text(message: object) -> str:
    """The text of an answer's `message` (or a stream's `delta`): its `content`, or, when
    that is empty, its `refusal` (a model that declines says why there, content null): the
    answer recorded and returned is that text, not an empty one."""
    if not isinstance(message, dict):
        return ""
    return _text_of(message.get("content")) or _text_of(message.get("refusal"))


def _text_of(content: object) -> str:
    """A string, or the text parts of an array of parts joined without a separator, as the
    request's content is read (schemas/chat.py); parts of other types are no text. Absent
    or null is no text; any other JSON value is no answer at all, not an empty one."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise UpstreamError(
            f"model server answered content that is {_JSON_KIND.get(type(content), 'a value')},"
            " not text or an array of parts",
            code="upstream_bad_response",
        )
    return "".join(
        part["text"]
        for part in content
        if isinstance(part, dict)
        and part.get("type") == "text"
        and isinstance(part.get("text"), str)
    )


_JSON_KIND: dict[type, str] = {
    bool: "a boolean",
    int: "a number",
    float: "a number",
    dict: "an object",
}


async def _sse_data(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The `data` of each SSE event (multi-line data joined by newlines).

    Reads whatever the connection has buffered and splits it into lines here: a readline per
    line cost more than parsing the events. A line, or an event's data, longer than
    `_MAX_EVENT_BYTES` raises ValueError, like aiohttp's own line reader: a server that never
    ends its lines or its event costs that much memory, not all it sends. A line left
    unfinished when the stream ends was cut with the connection and is dropped, with its
    event (the SSE rule for an unfinished event); complete `data:` lines whose closing blank
    line never came are still an event when the body ended as HTTP ends one, as some servers
    end their streams that way, and not when the connection was cut."""
    lines = _SseLines()
    event = _SseEvent()
    try:
        async for chunk in content.iter_any():
            for data in event.ended_by(lines.feed(chunk)):
                yield data
    except aiohttp.ClientPayloadError:
        # The connection was cut inside the body (a chunked body without its last chunk):
        # the stream's end, cut. The events read stand (the caller decides whether the
        # answer had finished), those delivered before the cut but not read yet too; the
        # line and the event left open were never sent.
        for data in event.ended_by(lines.feed(_left_unread(content))):
            yield data
        return
    last, cut = lines.end()
    for data in event.ended_by(last):
        yield data
    if not cut and event.lines:
        yield event.take(b"") or ""


def _left_unread(content: aiohttp.StreamReader) -> bytes:
    """What the connection delivered before it was cut and nobody has read yet: aiohttp's
    readers raise the cut's error before they return it (a finishing chunk that arrived
    with the cut, while the previous one was being relayed). A private method of aiohttp's;
    tests/models/test_openai_compat.py fails should it go."""
    read_buffered = getattr(content, "_read_nowait", None)
    if read_buffered is None:
        return b""
    left: bytes = read_buffered(-1)
    return left


_BOM = b"\xef\xbb\xbf"


class _SseLines:
    """An event stream's bytes split into lines at any of the three ends SSE allows (CRLF,
    LF, a lone CR), past the byte order mark a stream may begin with."""

    def __init__(self) -> None:
        self._pending = b""
        self._started = False

    def feed(self, chunk: bytes) -> list[bytes]:
        """The lines this chunk completes; a line still open stays pending."""
        pending = self._pending + chunk
        if not self._started:
            if len(pending) < len(_BOM) and _BOM.startswith(pending):
                self._pending = pending
                return []
            self._started = True
            pending = pending.removeprefix(_BOM)
        elif b"\n" not in chunk and b"\r" not in chunk and not self._pending.endswith(b"\r"):
            if len(pending) > _MAX_EVENT_BYTES:
                raise ValueError("stream line too long")
            self._pending = pending
            return []
        # A CR ending the buffer may be the first half of a CRLF whose LF comes in the next
        # read: it waits, or the LF would read as a blank line and end the event early.
        held = b"\r" if pending.endswith(b"\r") else b""
        if held:
            pending = pending[:-1]
        if b"\r" in pending:
            pending = pending.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *complete, rest = pending.split(b"\n")
        if len(rest) > _MAX_EVENT_BYTES:
            raise ValueError("stream line too long")
        self._pending = rest + held
        return complete

    def end(self) -> tuple[list[bytes], bool]:
        """At the end of the stream: the line a lone CR ended last (if so), and whether a
        line was left unfinished, cut with the connection."""
        pending, self._pending = self._pending, b""
        if pending.endswith(b"\r"):
            return [pending[:-1]], False
        return [], bool(pending) and self._started


class _SseEvent:
    """The `data:` lines of the event being read, bounded by `_MAX_EVENT_BYTES` in all."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._size = 0

    def ended_by(self, raws: list[bytes]) -> Iterator[str]:
        """The data of each event these lines end, each line taken as its turn comes (an
        event too long is refused after those before it were handed on)."""
        for raw in raws:
            data = self.take(raw)
            if data is not None:
                yield data

    def take(self, raw: bytes) -> str | None:
        """Take one line: a blank line ends an event (its data is returned), a `data:` line
        adds to it, anything else (comments, other fields) is skipped."""
        if not raw:
            if not self.lines:
                return None
            data = "\n".join(self.lines)
            self.lines.clear()
            self._size = 0
            return data
        if raw.startswith(b"data:"):
            self._size += len(raw)
            if self._size > _MAX_EVENT_BYTES:
                raise ValueError("stream event too long")
            value = raw[5:].decode("utf-8", "replace")
            self.lines.append(value[1:] if value.startswith(" ") else value)
        return None


def _lenient_json(data: str | bytes) -> Any:
    """JSON as a model server may send it. orjson refuses a lone surrogate escape (`\ud83d`,
    an emoji cut in half by a server slicing strings), which JSON allows: that text is read
    with the standard parser instead and each lone surrogate becomes `?` (no UTF-8 form, so
    no event or response could carry it). ValueError when it is not JSON, however deeply
    nested (the standard parser raises RecursionError there)."""
    try:
        return orjson.loads(data)
    except ValueError:
        if b"\\u" not in (data.encode() if isinstance(data, str) else data):
            raise
    try:
        value = json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    return orjson.loads(json.dumps(value, ensure_ascii=False).encode("utf-8", "replace"))


def _json_object(data: str) -> dict[str, Any]:
    try:
        value = _lenient_json(data)
    except ValueError:
        raise UpstreamError(
            "model server sent a stream chunk that is not JSON", code="upstream_bad_stream"
        ) from None
    if not isinstance(value, dict):
        raise UpstreamError(
            "model server sent a stream chunk that is not an object", code="upstream_bad_stream"
        )
    return value


def _choices(chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return []
    return [c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0]


def _is_error_chunk(chunk: Mapping[str, Any]) -> bool:
    """An error in place of a chunk: `{"error": {...}}` (OpenAI, newer vLLM), or an error
    document itself, `{"object": "error", "message": ...}` (older vLLM and its kin). An
    `"error": null` beside a chunk's choices is no error."""
    return chunk.get("error") is not None or chunk.get("object") == "error"


def _chunk_error(chunk: Mapping[str, Any]) -> str:
    if chunk.get("object") == "error" and isinstance(chunk.get("message"), str):
        return str(chunk["message"])
    error = chunk.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    return str(error)


def _usage(value: object) -> Usage | None:
    if not isinstance(value, dict):
        return None
    prompt = value.get("prompt_tokens")
    completion = value.get("completion_tokens")
    if type(prompt) is int and type(completion) is int:  # a JSON true is no count
        return Usage(prompt_tokens=prompt, completion_tokens=completion)
    return None
