"""An OpenAI-compatible model server that answers at once, for benchmarks and tests.

    python bench/stub_upstream.py --port 8790 --tokens 16

POST /v1/chat/completions (also /chat/completions) answers a `chat.completion`, or with
`"stream": true` a `chat.completion.chunk` SSE stream of N token chunks, a finishing chunk,
a usage chunk when `stream_options.include_usage` is set, then `data: [DONE]`.

Tests script it through the `StubUpstream` object: queue `Fault`s (an HTTP error status for
the next call), set `delay_s` (wait before answering), `drop_after` (cut the connection after
that many chunks), `reply` (fixed text), `finish_reason` or `usage`; `calls`, `bodies` and `headers`
record what came in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from aiohttp import web


@dataclass(frozen=True, slots=True)
class Fault:
    status: int
    message: str = "stub upstream failure"
    retry_after_s: float | None = None
    content_type: str | None = None
    """When set, `message` is the whole body, of this type, not an OpenAI error document."""
    code: str | None = None
    """The OpenAI error document's `code` (and `type`), as `insufficient_quota`."""


class StubUpstream:
    def __init__(
        self,
        *,
        tokens: int = 8,
        reply: str | None = None,
        delay_s: float = 0.0,
        chunk_delay_s: float = 0.0,
    ) -> None:
        self.tokens = tokens
        self.reply = reply
        self.delay_s = delay_s
        self.chunk_delay_s = chunk_delay_s
        self.drop_after: int | None = None
        self.finish_reason: str | None = None
        """When set, the finish reason of every answer, whatever it is."""
        self.usage: dict[str, Any] | None = None
        """When set, the usage every answer reports, whatever it is."""
        self.faults: deque[Fault] = deque()
        self.calls = 0
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/chat/completions", self.chat)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> StubUpstream:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def words(self) -> list[str]:
        if self.reply is not None:
            parts = self.reply.split(" ")
            return [p + " " for p in parts[:-1]] + [parts[-1]]
        return [f"tok{i} " for i in range(self.tokens)]

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.faults:
            fault = self.faults.popleft()
            headers = {}
            if fault.retry_after_s is not None:
                headers["Retry-After"] = f"{fault.retry_after_s:g}"
            if fault.content_type is not None:
                return web.Response(
                    text=fault.message, status=fault.status, content_type=fault.content_type
                )
            return web.json_response(
                {
                    "error": {
                        "message": fault.message,
                        "type": fault.code or "stub_error",
                        "code": fault.code,
                    }
                },
                status=fault.status,
                headers=headers,
            )
        words = self.words()
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        finish = "stop"
        if isinstance(max_tokens, int) and max_tokens < len(words):
            words, finish = words[:max_tokens], "length"
        if self.finish_reason is not None:
            finish = self.finish_reason
        prompt = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": len(words),
            "total_tokens": prompt + len(words),
        }
        if self.usage is not None:
            usage = self.usage
        model = str(body.get("model", "stub"))
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await self._stream(request, model, words, finish, usage, include_usage)
        return web.json_response(
            {
                "id": f"chatcmpl-stub{self.calls}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(words)},
                        "finish_reason": finish,
                    }
                ],
                "usage": usage,
            }
        )

    async def _stream(
        self,
        request: web.Request,
        model: str,
        words: list[str],
        finish: str,
        usage: dict[str, int],
        include_usage: bool,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        base: dict[str, Any] = {
            "id": f"chatcmpl-stub{self.calls}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }

        async def send(choices: list[dict[str, Any]], usage_value: Any = None) -> None:
            chunk = {**base, "choices": choices}
            if include_usage:
                chunk["usage"] = usage_value
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        for i, word in enumerate(words):
            if self.drop_after is not None and i >= self.drop_after:
                assert request.transport is not None
                request.transport.close()
                return resp
            delta: dict[str, str] = {"content": word}
            if i == 0:
                delta["role"] = "assistant"
            await send([{"index": 0, "delta": delta, "finish_reason": None}])
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
        await send([{"index": 0, "delta": {}, "finish_reason": finish}])
        if include_usage:
            await send([], usage)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--tokens", type=int, default=16, help="token chunks per answer")
    args = parser.parse_args()
    stub = StubUpstream(tokens=args.tokens)
    web.run_app(stub.app(), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
