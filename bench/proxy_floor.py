"""The floor under any aiohttp gateway on this machine: a pass-through proxy that persists
nothing, checks nothing and forwards each chat request to the stub model server, streaming
the answer back chunk by chunk as it arrives.

What it costs per request is what SVC's gateway pays before it authenticates, records a turn
or projects anything, so its requests/s at a concurrency bound what `gateway_chat.py` can
report there. Run it beside the stub and point `gateway_chat.py` at it:

    python bench/stub_upstream.py --port 8790 --tokens 16 &
    python bench/proxy_floor.py --port 8781 --upstream http://127.0.0.1:8790/v1 &
    python bench/gateway_chat.py --gateway http://127.0.0.1:8781 --key unused \\
        --gateway-pid <proxy pid> --concurrency 1,32 --no-baseline

It serves `POST /v1/chat/completions` only.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM: web.AppKey[str] = web.AppKey("upstream", str)
_HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "content-encoding"}


async def forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    url = request.app[UPSTREAM] + "/chat/completions"
    headers = {"Content-Type": "application/json"}
    async with request.app[SESSION].post(url, data=body, headers=headers) as upstream:
        response = web.StreamResponse(status=upstream.status)
        for name, value in upstream.headers.items():
            if name.lower() not in _HOP_BY_HOP:
                response.headers[name] = value
        await response.prepare(request)
        # Each piece the upstream sends goes out as it comes: no merging, as SVC forwards.
        async for piece in upstream.content.iter_any():
            await response.write(piece)
        await response.write_eof()
        return response


async def _session(app: web.Application) -> AsyncIterator[None]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        app[SESSION] = session
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8781)
    parser.add_argument("--upstream", default="http://127.0.0.1:8790/v1")
    args = parser.parse_args()
    app = web.Application()
    app[UPSTREAM] = args.upstream.rstrip("/")
    app.cleanup_ctx.append(_session)
    app.router.add_post("/v1/chat/completions", forward)
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
