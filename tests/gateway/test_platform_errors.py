"""Every non-2xx answer carries the envelope: unknown paths, wrong methods, malformed JSON,
oversized bodies, validation failures and unexpected exceptions (500, process keeps serving)."""

from __future__ import annotations

import asyncio
import logging
import re
from types import SimpleNamespace
from typing import Any, cast

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from platform_support import (
    BOOM,
    BROKEN_STREAM,
    ECHO,
    STORE_BOOM,
    Running,
    access_logged,
    running,
    settings_for,
)
from yarl import URL

from gateway import errors as gateway_errors
from gateway import http_server, unbuilt
from gateway.http_server import MALFORMED_REQUEST, EnvelopeRequestHandler
from schemas.errors import RateLimited


def assert_envelope(body: object, code: str | None = None) -> dict[str, object]:
    assert isinstance(body, dict) and set(body) == {"error"}
    error = body["error"]
    assert isinstance(error, dict)
    assert set(error) == {"message", "type", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


async def test_unknown_path_and_wrong_method(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        status, body, _ = await svc.request("GET", "/no/such/thing")
        assert status == 404
        assert_envelope(body, "not_found")
        status, body, headers = await svc.request("DELETE", "/healthz")
        assert status == 405
        assert_envelope(body, "method_not_allowed")
        assert "GET" in headers["Allow"]


async def test_endpoints_of_the_interface_not_built_say_so(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """QA finding: the spec's endpoints of capabilities not built yet answered a bare 404, so
    a client could not tell a missing feature from a mistyped path."""
    async with running(settings_for(database_url)) as svc:
        key, _ = await svc.issue_key("default", ("*",))
        for method, template, capability in unbuilt.UNBUILT:
            path = template.replace("{id}", "m-1")
            status, body, headers = await svc.request(method, path, key)
            assert status == 501, (method, path, body)
            message = str(assert_envelope(body, "not_built")["message"])
            assert f"{method} {template}" in message and capability in message, message
            assert headers["x-should-retry"] == "false"  # the SDKs retry any 5xx otherwise
            # The spec's credential comes first where it gives one (review finding).
            status, body, _ = await svc.request(method, path)
            credentialed = template.startswith(("/v1/admin/", "/v1/mcp"))
            assert status == (401 if credentialed else 501), (method, path, body)
        chat_only, _ = await svc.issue_key("default", ("chat",))
        status, body, _ = await svc.request("POST", "/v1/mcp", chat_only)
        assert status == 401, body  # the spec: without the mcp scope, 401
        status, body, _ = await svc.request("GET", "/v1/admin/channels", chat_only)
        assert status == 403, body  # the rights of every admin route first
        status, body, headers = await svc.request("DELETE", "/v1/mcp")
        assert status == 405 and headers["Allow"] == "POST", body
        # A client's news, as a 404 is: no warning for the operator per probe.
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
        status, document, _ = await svc.request("GET", "/openapi.json")
        assert status == 200 and "/v1/mcp" not in document["paths"]


async def test_malformed_json_and_validation(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        status, body, _ = await svc.request("POST", ECHO, data=b'{"name": "x",')
        assert status == 400
        assert assert_envelope(body, "invalid_json")["type"] == "invalid_request_error"
        # Bytes that are not UTF-8 are said to be so, where (orjson spoke of surrogates).
        status, body, _ = await svc.request("POST", ECHO, data=b'{"name": "\xff\xfe"}')
        message = str(assert_envelope(body, "invalid_json")["message"])
        assert "not UTF-8 text (byte 0xff at offset 10)" in message, message

        status, body, _ = await svc.request("POST", ECHO, json={"name": "", "count": -1})
        assert status == 400
        error = assert_envelope(body, "invalid_request")
        assert "name" in str(error["message"]) and "count" in str(error["message"])

        status, body, _ = await svc.request("POST", ECHO, json={"name": "ok", "count": 2})
        assert status == 200 and body == {"name": "ok", "count": 2}


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "x-unknown"])
async def test_a_body_that_is_not_in_its_content_encoding_is_400(
    database_url: str, encoding: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with running(settings_for(database_url)) as svc:
        headers = {"Content-Encoding": encoding, "Content-Type": "application/json"}
        status, body, _ = await svc.request("POST", ECHO, data=b'{"name": "x"}', headers=headers)
        assert status in (400, 415), body
        assert_envelope(body)
        status, _, _ = await svc.request("GET", "/healthz")  # still serving
        assert status == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_coding_the_parser_would_pass_through_is_refused(database_url: str) -> None:
    """QA finding: codings the HTTP parser does not decode (`x-foo`, `compress`, `x-gzip`, a
    list such as `gzip, identity`) were read as plain bytes, where a proxy in front would
    read them otherwise; `br` and `zstd` were a 415."""
    plain = b'{"name": "x", "count": 1}'
    async with running(settings_for(database_url)) as svc:
        for coding in ("x-foo", "compress", "x-gzip", "gzip, identity", "gzip, gzip"):
            headers = {"Content-Encoding": coding, "Content-Type": "application/json"}
            status, body, _ = await svc.request("POST", ECHO, data=plain, headers=headers)
            assert status == 415 and body["error"]["code"] == "unsupported_media_type", coding
        for coding in ("identity", "Identity "):
            headers = {"Content-Encoding": coding, "Content-Type": "application/json"}
            status, body, _ = await svc.request("POST", ECHO, data=plain, headers=headers)
            assert status == 200, (coding, body)


async def test_an_expect_header_the_server_does_not_know_gets_the_envelope(
    database_url: str,
) -> None:
    async with running(settings_for(database_url)) as svc:
        headers = {"Expect": "foo"}
        status, body, _ = await svc.request("POST", ECHO, json={"name": "x"}, headers=headers)
        assert status == 417
        assert "Expect" in str(assert_envelope(body, "expectation_failed")["message"])
        status, body, _ = await svc.request("GET", "/healthz", headers=headers)
        assert status == 417
        assert_envelope(body, "expectation_failed")


async def test_oversized_body_is_413(database_url: str) -> None:
    settings = settings_for(database_url, SVC_MAX_BODY_BYTES="2048")
    async with running(settings) as svc:
        status, body, _ = await svc.request("POST", ECHO, data=b"x" * 10_000)
        assert status == 413
        assert_envelope(body, "payload_too_large")


async def test_unexpected_exception_is_500_with_id_and_traceback(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with running(settings_for(database_url)) as svc:
        with caplog.at_level(logging.ERROR, logger="gateway.errors"):
            status, body, _ = await svc.request("GET", BOOM)
        assert status == 500
        error = assert_envelope(body, "internal_error")
        match = re.fullmatch(r"internal error \(id (svc-[0-9a-f-]{36})\)", str(error["message"]))
        assert match, error
        assert "kaboom" not in str(error["message"])
        logged = [r for r in caplog.records if match.group(1) in r.getMessage()]
        assert logged and logged[0].exc_info is not None
        status, _, _ = await svc.request("GET", "/healthz")
        assert status == 200


REQUEST_ID = r"svc-[0-9a-f-]{36}"


async def test_every_response_names_its_request(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """QA finding: no response carried an id, so a client reporting a problem could name
    neither its request nor the log lines about it (the openai SDKs read X-Request-Id into
    `request_id`). Each answer has its own; a 500's message and traceback name the same."""
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    async with running(settings_for(database_url)) as svc:
        answers = [
            await svc.request("GET", path, headers={"X-Request-Id": "from-the-client"})
            for path in ("/healthz", "/healthz", "/no/such/thing", BOOM)
        ]
        ids = [headers["X-Request-Id"] for _, _, headers in answers]
        assert all(re.fullmatch(REQUEST_ID, i) for i in ids) and len(set(ids)) == len(ids)
        _, failed, _ = answers[-1]
        assert assert_envelope(failed)["message"] == f"internal error (id {ids[-1]})"
        await access_logged(caplog.records, ids[-1])
        access = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
        assert {line.rsplit(" ", 1)[1] for line in access} >= set(ids)


async def test_internal_svc_error_is_opaque_500_with_id(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A store failure (an SvcError of status 500) must not hand database detail or query
    parameters to the client: the same opaque id'd 500 as any unexpected exception."""
    async with running(settings_for(database_url)) as svc:
        with caplog.at_level(logging.ERROR, logger="gateway.errors"):
            status, body, _ = await svc.request("GET", STORE_BOOM)
        assert status == 500
        error = assert_envelope(body, "internal_error")
        match = re.fullmatch(r"internal error \(id (svc-[0-9a-f-]{36})\)", str(error["message"]))
        assert match, error
        logged = [r for r in caplog.records if match.group(1) in r.getMessage()]
        assert logged and logged[0].exc_info is not None


async def test_nul_character_is_400_not_500(database_url: str) -> None:
    """PostgreSQL text cannot hold NUL; a client sending one gets a 400, wherever it is."""
    async with running(settings_for(database_url)) as svc:
        status, body, _ = await svc.request("POST", ECHO, json={"name": "a\u0000b", "count": 1})
        assert status == 400
        assert_envelope(body, "invalid_character")
        status, body, _ = await svc.request(
            "POST", ECHO, json={"name": "ok", "count": 1, "x": {"k\u0000": 1}}
        )
        assert status == 400
        assert_envelope(body, "invalid_character")
        for raw in ("/v1/admin/conversations/messages?id=a%00b", "/v1/admin/users/a%00b"):
            async with svc.http.get(URL(svc.url(raw), encoded=True)) as resp:
                assert resp.status == 400, raw
                assert_envelope(await resp.json(), "invalid_character")
        # An escaped backslash followed by "u0000" is not a NUL.
        status, body, _ = await svc.request("POST", ECHO, data=b'{"name": "\\\\u0000", "count": 1}')
        assert status == 200 and body["name"] == "\\u0000"


async def test_deeply_nested_json_is_400_not_500(database_url: str) -> None:
    """A valid JSON document nested hundreds of levels deep is the client's mistake: a 400
    naming the limit, not a RecursionError while it is checked or validated."""
    async with running(settings_for(database_url)) as svc:
        for depth in (65, 600, 1000):
            deep = b'{"name": "ok", "count": 1, "x": ' + b"[" * depth + b"]" * depth + b"}"
            status, body, _ = await svc.request("POST", ECHO, data=deep)
            assert status == 400, depth
            assert "nested too deeply" in str(assert_envelope(body, "invalid_json")["message"])
        # Up to the limit it is an ordinary document (the echo model ignores "x").
        fine = b'{"name": "ok", "count": 1, "x": ' + b"[" * 63 + b"]" * 63 + b"}"
        status, body, _ = await svc.request("POST", ECHO, data=fine)
        assert status == 200 and body == {"name": "ok", "count": 1}


async def _raw_exchange(svc: Running, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send bytes that no HTTP client library would send; read the answer until the server
    closes the connection, which it must after an unparseable request (the read times out
    otherwise)."""
    port = URL(svc.base).port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout=10.0)  # up to EOF
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body


async def test_requests_the_http_parser_refuses_get_the_envelope(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp answers these before any middleware runs; they still carry the envelope, close
    the connection, and neither the answer nor the log quotes what the parser refused."""
    secret = "sk-" + "s3cret" * 4
    refused = {
        "not HTTP": b"HELLO THERE\r\n\r\n",
        "header line too long": (
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Token: " + secret.encode() * 400 + b"\r\n\r\n"
        ),
        "control character in a header": (
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + secret.encode()
            + b"\x01\r\n\r\n"
        ),
        "too many header lines": (
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
            + b"".join(b"X-A-%d: %s\r\n" % (i, secret.encode()) for i in range(130))
            + b"\r\n"
        ),
        "bad chunk size": (
            b"POST /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"zz\r\n" + secret.encode() + b"\r\n0\r\n\r\n"
        ),
    }
    async with running(settings_for(database_url, SVC_CSP="default-src 'none'")) as svc:
        caplog.set_level(logging.INFO, logger="aiohttp.access")
        with caplog.at_level(logging.DEBUG):
            for case, request in refused.items():
                status, headers, body = await _raw_exchange(svc, request)
                assert status == 400, case
                assert headers["content-type"].startswith("application/json"), case
                error = assert_envelope(orjson.loads(body), "invalid_request")
                assert error["message"] == MALFORMED_REQUEST, case
                assert secret not in body.decode("latin-1"), case
                # No application saw the request; its answer is still a response of this one.
                assert headers["x-content-type-options"] == "nosniff", case
                assert headers["content-security-policy"] == "default-src 'none'", case
                assert re.fullmatch(REQUEST_ID, headers["x-request-id"]), case
        assert not [r for r in caplog.records if "s3cret" in r.getMessage() + str(r.exc_info)]
        # Each has its access line, naming the client, and none is an error of the service.
        access = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
        assert len([line for line in access if line.startswith("127.0.0.1 ")]) >= len(refused)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        status, _, _ = await svc.request("GET", "/healthz")  # and the process keeps serving
        assert status == 200


async def test_bodies_that_do_not_decode_are_client_errors(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A form body not in its Content-Encoding is a 400 like a JSON one (it was a 500 on the
    OAuth token endpoint); an encoding this service does not decode is named as such."""
    head = "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: {type}\r\n"
    form = head.format(path="/v1/oauth/token", type="application/x-www-form-urlencoded")
    body = b"not gzip at all"
    length = f"Content-Length: {len(body)}\r\n\r\n".encode()
    async with running(settings_for(database_url)) as svc:
        with caplog.at_level(logging.INFO):
            gzip = (form + "Content-Encoding: gzip\r\n").encode() + length + body
            status, _, answer = await _raw_exchange(svc, gzip)
            assert status == 400, answer
            assert b"could not be read" in answer and b"Content-Encoding" in answer
            json_head = head.format(path=ECHO, type="application/json")
            brotli = (json_head + "Content-Encoding: br\r\n").encode() + length + body
            status, headers, answer = await _raw_exchange(svc, brotli)
            assert status == 415, answer
            error = orjson.loads(answer)["error"]
            assert error["code"] == "unsupported_media_type" and "gzip" in error["message"]
            assert headers["x-content-type-options"] == "nosniff"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # The log says the status sent (QA finding: it said 400 of the 415).
    refusals = [r.getMessage() for r in caplog.records if "malformed HTTP" in r.getMessage()]
    assert any("with 415 (ContentEncodingError)" in line for line in refusals), refusals


async def test_a_failure_after_a_stream_began_cuts_it_short_without_a_second_response(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with running(settings_for(database_url)) as svc:
        request = f"GET {BROKEN_STREAM} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        port = URL(svc.base).port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request)
            raw = await asyncio.wait_for(reader.read(), timeout=10.0)  # until it is closed
        finally:
            writer.close()
        status, _, _ = await svc.request("GET", "/healthz")  # and the process keeps serving
    assert raw.startswith(b"HTTP/1.1 200 ") and b"data: one" in raw
    assert raw.count(b"HTTP/1.1 ") == 1, raw  # no 500 written into the stream's body
    assert b"0\r\n\r\n" not in raw  # nor the end of a complete chunked body
    assert status == 200
    assert [r for r in caplog.records if "mid-stream" in str(r.exc_info)]  # logged, with its id


async def test_error_lines_name_the_path_still_encoded(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    forged = "x%0A2026-01-01 00:00:00,000 ERROR gateway.auth: forged"
    async with running(settings_for(database_url)) as svc:
        with caplog.at_level(logging.INFO):
            status, _, _ = await svc.request("GET", f"/test/boom/{forged}?access_token=tok")
    assert status == 500
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("gateway")]
    assert any("/test/boom/x%0A2026" in line for line in lines), lines
    assert not [line for line in lines if "\n" in line or "tok" in line.split("boom")[-1]]


def test_a_failure_outside_the_middleware_is_an_opaque_500(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """aiohttp's own 500 (an exception that escaped every middleware) gets the same opaque,
    id'd envelope as the error middleware's, and the traceback goes to the log only."""
    writer = SimpleNamespace(output_size=0)
    request = make_mocked_request("GET", "/somewhere", writer=writer)
    handler = cast(Any, SimpleNamespace(_manager=SimpleNamespace(settings=None)))
    with caplog.at_level(logging.ERROR, logger="gateway.errors"):
        response = EnvelopeRequestHandler.handle_error(
            handler, request, 500, RuntimeError("secret detail")
        )
    assert isinstance(response, web.Response) and response.status == 500
    assert response.headers["X-Content-Type-Options"] == "nosniff"  # no application's hooks
    assert response.body is not None
    error = assert_envelope(orjson.loads(bytes(response.body)), "internal_error")
    assert "secret detail" not in str(error["message"])
    assert any(r.exc_info for r in caplog.records if "svc-" in r.getMessage())
    writer.output_size = 10  # a response already under way cannot be replaced
    with pytest.raises(ConnectionError):
        EnvelopeRequestHandler.handle_error(handler, request, 500, RuntimeError("x"))


async def test_header_bytes_that_are_not_utf8_are_a_400(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each of these reached an encode() deep in a handler (key hashing, the session cookie,
    the idempotency id, the CORS error message) and answered 500."""
    bad = b"\xff\xfe"
    requests = {
        "bearer key": b"GET /v1/admin/overview HTTP/1.1\r\nAuthorization: Bearer svc_" + bad,
        "session cookie": b"GET /v1/admin/overview HTTP/1.1\r\nCookie: svc_session=" + bad,
        "idempotency key": (
            b"POST /v1/admin/agents HTTP/1.1\r\nAuthorization: Bearer svc_x\r\n"
            b"Idempotency-Key: " + bad
        ),
        "preflight origin": (
            b"OPTIONS /v1/models HTTP/1.1\r\nOrigin: http://" + bad + b"\r\n"
            b"Access-Control-Request-Method: GET"
        ),
    }
    async with running(settings_for(database_url)) as svc:
        with caplog.at_level(logging.WARNING):
            for case, head in requests.items():
                request = head + b"\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
                status, headers, body = await _raw_exchange(svc, request)
                assert status == 400, case
                assert headers["content-type"].startswith("application/json"), case
                assert "not valid UTF-8" in str(
                    assert_envelope(orjson.loads(body), "invalid_header")
                )
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_body_cut_short_by_the_client_is_not_a_server_error(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with running(settings_for(database_url)) as svc:
        port = URL(svc.base).port
        caplog.set_level(logging.INFO, logger="aiohttp.access")
        with caplog.at_level(logging.INFO):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                f"POST {ECHO} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Content-Length: 100\r\n\r\n{}".encode()
            )
            await writer.drain()
            await asyncio.sleep(0.2)  # the handler is waiting for the rest of the body
            writer.close()
            status, _, _ = await svc.request("GET", "/healthz")
            assert status == 200
            await access_logged(caplog.records, f"POST {ECHO}")  # its handler has finished
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_body_that_trickles_in_past_the_deadline_is_408_and_closes(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that sends part of its body and then nothing holds no handler for good: it
    gets a 408 in the envelope and the connection is closed."""
    monkeypatch.setattr(gateway_errors, "BODY_DEADLINE_S", 0.5)
    async with running(settings_for(database_url)) as svc:
        reader, writer = await asyncio.open_connection("127.0.0.1", URL(svc.base).port)
        try:
            writer.write(
                f"POST {ECHO} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Content-Length: 100\r\n\r\n{}".encode()
            )
            await writer.drain()
            # aiohttp drains what is left of the body for up to 10 s before it closes, so
            # the answer is read by its length, not up to the end of the stream.
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10.0)
            status_line, *lines = head.decode("latin-1").strip().split("\r\n")
            headers = {
                k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)
            }
            body = await reader.readexactly(int(headers["content-length"]))
        finally:
            writer.close()
        assert status_line.split()[1] == "408"
        assert headers.get("connection") == "close"
        assert_envelope(orjson.loads(body), "request_timeout")
        status, _, _ = await svc.request("GET", "/healthz")
        assert status == 200


async def test_a_connection_that_never_finishes_its_headers_is_closed(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_server, "IDLE_CONNECTION_S", 0.5)
    async with running(settings_for(database_url)) as svc:
        reader, writer = await asyncio.open_connection("127.0.0.1", URL(svc.base).port)
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and no blank line
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), timeout=10.0) == b""  # closed
        finally:
            writer.close()


@pytest.mark.parametrize(
    ("wait_s", "said"), [(0.2, "1"), (1.0, "1"), (2.0005, "3"), (59.0001, "60"), (59.9, "60")]
)
def test_retry_after_is_never_before_the_wait_ends(wait_s: float, said: str) -> None:
    """Review finding: a wait past a whole second by under a millisecond was rounded down,
    so a client retrying when told met the window it was refused in (another 429)."""
    response = gateway_errors.from_svc_error(RateLimited("slow down", retry_after_s=wait_s))
    assert response.headers["Retry-After"] == said
