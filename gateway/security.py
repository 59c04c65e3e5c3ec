"""Transport security: hidden paths, HTTPS enforcement, CORS, security headers, client IPs.

- `/debug/pprof` and `/admin/` are never served on the gateway port (404 envelope).
- `SVC_REQUIRE_SECURE`: plain HTTP is redirected to HTTPS (GET/HEAD, 308) or refused (403);
  loopback clients are always allowed; `X-Forwarded-Proto` counts only from a trusted proxy.
- `SVC_TRUSTED_PROXIES` (live): only requests from these peers use `X-Forwarded-For`.
- `SVC_CORS_ORIGINS` (+ `SVC_WEBUI_ORIGIN`): allowed browser origins; blank = same-origin only.
- Every response carries CSP (`SVC_CSP` or the default), nosniff, a referrer policy and a
  frame ban.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Iterable

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler
from yarl import URL

from gateway.errors import error_body
from gateway.settings import Settings
from gateway.state import SETTINGS
from schemas.errors import (
    UNSUPPORTED_ENCODING_MESSAGE,
    Forbidden,
    InvalidInput,
    NotFound,
    UnsupportedEncoding,
)
from schemas.settings_catalog import Network, parse_networks
from schemas.text import is_utf8

DEFAULT_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
HIDDEN_PREFIXES = ("/debug/pprof", "/admin/")
HIDDEN_EXACT = frozenset({"/admin", "/debug/pprof"})
CORS_METHODS = "GET, POST, PUT, PATCH, DELETE, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type, Idempotency-Key, Last-Event-ID, X-SVC-Conversation-Id"
# x-should-retry: the openai SDKs obey it, and in a browser they only see what is exposed;
# without it they retry a failure that the same request will meet again.
EXPOSED_HEADERS = (
    "X-SVC-Conversation-Id, X-SVC-Cursor, Retry-After, X-RateLimit-Limit, "
    "X-RateLimit-Remaining, X-RateLimit-Reset, x-should-retry, X-Request-Id"
)
# Orchestrators probe these, and Prometheus scrapes the last, over plain HTTP from the node
# or the pod network, not from loopback. None carries a secret or a tenant's data (but for
# /metrics once SVC_METRICS_TOKEN is set, which is then no exception).
PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
CLIENT_IP: web.RequestKey[str] = web.RequestKey("svc_client_ip", str)

log = logging.getLogger(__name__)


def _ip(text: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address((text or "").strip())
    except ValueError:
        return None


IPV6_GROUP_PREFIX = 64


def address_group(address: str) -> str:
    """What a per-address limit counts a client by: an IPv4 address (an IPv4-mapped IPv6
    one too), or an IPv6 address's /64, which one host usually holds whole and could
    otherwise step through; text that is no address, as it is."""
    ip = _ip(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.ip_network(f"{ip}/{IPV6_GROUP_PREFIX}", strict=False))
    return address if ip is None else str(ip)


def _trusted(address: str | None, networks: Iterable[Network]) -> bool:
    """Whether `address` is in `networks`; an IPv4-mapped IPv6 address (a dual-stack
    socket's, or a proxy's hop written so) as the IPv4 address it is, too."""
    ip = _ip(address)
    if ip is None:
        return False
    forms = [ip]
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        forms.append(ip.ipv4_mapped)
    return any(form in net for form in forms for net in networks)


def _proxies(settings: Settings) -> tuple[Network, ...]:
    try:
        return parse_networks(settings.text("SVC_TRUSTED_PROXIES"))
    except ValueError:
        return ()


def client_ip(request: web.Request) -> str:
    """The client's address: the peer, or from a trusted proxy the rightmost untrusted
    address of X-Forwarded-For."""
    if CLIENT_IP in request:
        return request[CLIENT_IP]
    peer = request.remote or ""
    networks = _proxies(request.app[SETTINGS])
    result = peer
    if _trusted(peer, networks):
        hops = [_without_port(h) for h in _list_values(request, "X-Forwarded-For")]
        for hop in reversed([h for h in hops if h]):
            result = hop
            if not _trusted(hop, networks):
                break
    request[CLIENT_IP] = result
    return result


def _list_values(request: web.Request, name: str) -> list[str]:
    """The values of a comma-list header over all its lines, in order, each stripped ([] when
    it is absent): a proxy may add a forwarding line of its own after the client's rather
    than append to it (HAProxy's `option forwardfor`), and the first line alone would be the
    client's own writing."""
    if name not in request.headers:
        return []
    joined = ",".join(request.headers.getall(name))
    return [value.strip() for value in joined.split(",")]


def _without_port(hop: str) -> str:
    """`203.0.113.9:5120` and `[2001:db8::1]:443`, as some load balancers write a hop, are
    the addresses before the port; anything else is left as it is."""
    if hop.startswith("[") and "]" in hop:
        return hop[1 : hop.index("]")]
    host, colon, port = hop.rpartition(":")
    if colon and port.isdigit() and _ip(host) is not None and ":" not in host:
        return host
    return hop


def _is_secure(request: web.Request, settings: Settings) -> bool:
    if request.secure:
        return True
    if _trusted(request.remote, _proxies(settings)):
        # The rightmost value is the one the trusted proxy in front of us set; values to
        # its left came with the request, from a client that may have written them itself.
        # A proxy may add a header line of its own rather than append to the client's.
        proto = _list_values(request, "X-Forwarded-Proto")
        return bool(proto) and proto[-1].lower() == "https"
    return False


def _is_loopback(request: web.Request, settings: Settings) -> bool:
    """Whether the client is on this host. A request a trusted proxy forwarded saying how it
    was reached (X-Forwarded-Proto) is not: the proxy is the way in from anywhere, and
    which client it names, if it names one at all, a proxy that does not append to
    X-Forwarded-For leaves to the client to write. Local tools reach the gateway's own port."""
    ip = _ip(client_ip(request))
    if ip is None or not ip.is_loopback:
        return False
    if not _trusted(request.remote, _proxies(settings)):
        return True
    # A trusted proxy's request that says it was forwarded but names no client (an empty
    # or unreadable X-Forwarded-For) is for a client that may be anywhere; one with no
    # forwarding headers at all is a local tool's, on the gateway's own port.
    if "X-Forwarded-For" in request.headers and not any(
        _ip(_without_port(hop)) for hop in _list_values(request, "X-Forwarded-For")
    ):
        return False
    return "X-Forwarded-Proto" not in request.headers


_warned_of_local_proxy = False


def _warn_of_an_untrusted_local_proxy(request: web.Request, settings: Settings) -> None:
    """A loopback request that a proxy forwarded (it says where from): with the proxy not in
    SVC_TRUSTED_PROXIES every request looks local, and localhost is always allowed, so
    SVC_REQUIRE_SECURE protects nothing. Said once per process."""
    global _warned_of_local_proxy
    if _warned_of_local_proxy or _trusted(request.remote, _proxies(settings)):
        return  # a trusted proxy's client that is itself local: nothing to set
    if "X-Forwarded-Proto" in request.headers or "X-Forwarded-For" in request.headers:
        _warned_of_local_proxy = True
        log.warning(
            "SVC_REQUIRE_SECURE: requests arrive from a proxy on this host (%s) that is not "
            "in SVC_TRUSTED_PROXIES, so they all count as local and are let through over "
            "plain HTTP; add the proxy's address to SVC_TRUSTED_PROXIES",
            request.remote,
        )


def _enforce_https(request: web.Request, settings: Settings) -> web.Response | None:
    """None when the request may go on; else the redirect (GET, HEAD) to send instead.
    Anything else over plain HTTP is refused (a body may already be on its way)."""
    if not settings.flag("SVC_REQUIRE_SECURE") or _is_secure(request, settings):
        return None
    if _is_loopback(request, settings):
        _warn_of_an_untrusted_local_proxy(request, settings)
        return None
    if request.path == "/metrics" and settings.text("SVC_METRICS_TOKEN"):
        # Its bearer token would cross the network in clear: refused, not redirected (a
        # scraper following the redirect would send it once more).
        raise Forbidden(
            "plain HTTP is not accepted for /metrics while SVC_METRICS_TOKEN is set: the "
            "token would cross the network in clear; scrape it over HTTPS",
            code="https_required",
        )
    if request.path in PROBE_PATHS:
        return None
    if request.method not in ("GET", "HEAD"):
        raise Forbidden("plain HTTP is not accepted: use HTTPS", code="https_required")
    location = _https_location(request, settings)
    message = f"plain HTTP is not accepted: use {location}"
    body = orjson.dumps(error_body(message, "permission_error", "https_required"))
    return web.Response(
        status=308, body=body, content_type="application/json", headers={"Location": location}
    )


def _https_location(request: web.Request, settings: Settings) -> str:
    """The same path over HTTPS, on the configured public host when there is one (a Host
    header is the client's to choose, so it only serves when nothing is configured)."""
    public = URL(settings.text("SVC_PUBLIC_URL").strip())
    host = public.raw_authority if public.scheme == "https" and public.host else request.host
    return f"https://{host}{request.path_qs}"


def allowed_origins(settings: Settings) -> frozenset[str]:
    origins = set(settings.items("SVC_CORS_ORIGINS"))
    webui = settings.text("SVC_WEBUI_ORIGIN").strip()
    if webui:
        origins.add(webui)
    return frozenset(_as_browsers_send(o) for o in origins)


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _as_browsers_send(origin: str) -> str:
    """An origin as a browser's Origin header spells it: scheme and host in lower case, no
    default port, no trailing slash (`HTTPS://App.example:443/` is `https://app.example`),
    so a configured spelling that means the same origin matches it."""
    parts = URL(origin.strip().rstrip("/"))
    if not parts.scheme or not parts.host:
        return origin.strip().rstrip("/")
    scheme = parts.scheme.lower()
    port = "" if parts.port in (None, _DEFAULT_PORTS.get(scheme)) else f":{parts.port}"
    # Browsers send an internationalised host in its ASCII (IDNA) form; yarl's `host` would
    # decode it, and a configured `https://xn--bcher-kva.example` would then match nothing.
    host = (parts.raw_host or "").lower()
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}{port}"


_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,100}$")
_MAX_REQUESTED_HEADERS = 64


def _allowed_headers(request: web.Request) -> str:
    """The headers an allowed origin may send: ours, and whatever it asks for that is a
    header name. Clients add their own (the OpenAI JS SDK's `X-Stainless-*`, `OpenAI-*`):
    a fixed list blocked every call of theirs. The origin is trusted by configuration;
    what a header carries is checked where it is read, as for any client."""
    requested = request.headers.get("Access-Control-Request-Headers", "")
    names = [n.strip() for n in requested.split(",") if n.strip()][:_MAX_REQUESTED_HEADERS]
    extra = [n for n in names if _HEADER_NAME.match(n)]
    return ", ".join([CORS_HEADERS, *extra])


def _preflight(request: web.Request, origin: str) -> web.Response:
    response = web.Response(status=204)
    response.headers.update(
        {
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Allow-Methods": CORS_METHODS,
            "Access-Control-Allow-Headers": _allowed_headers(request),
            "Access-Control-Allow-Credentials": "true",
            "Access-Control-Max-Age": "600",
            "Vary": "Origin, Access-Control-Request-Headers",
        }
    )
    return response


def _is_preflight(request: web.Request) -> bool:
    return (
        request.method == "OPTIONS"
        and "Origin" in request.headers
        and "Access-Control-Request-Method" in request.headers
    )


_HOST = re.compile(r"(?:\[[0-9A-Fa-f:.]+(?:%25[\w.~-]+)?\]|[A-Za-z0-9._~-]+)(?::(\d{0,5}))?")
"""RFC 9110's Host: a name or IPv4 address (letters, digits, `.`, `-`, `_`, `~`), or an IPv6
address in brackets, and a port (possibly empty): no user, path, space, or list."""


def _check_host(request: web.Request) -> None:
    """RFC 9112 (3.2): a Host that is not a host (and port) is a 400. The redirect to HTTPS
    writes the Host into its Location when SVC_PUBLIC_URL is unset, and a Location of
    `https://good.example@evil.example/...` sends the client elsewhere."""
    host = request.headers.get("Host")
    if host is None:  # HTTP/1.0 (the parser refuses an HTTP/1.1 request without one)
        return
    found = _HOST.fullmatch(host)
    if found is None or (found.group(1) and int(found.group(1)) > 65535):
        raise InvalidInput(
            "the Host header is not a host name or address with an optional port "
            "(example.com:8780, [2001:db8::1]:443)",
            code="invalid_header",
        )


DECODED_ENCODINGS = frozenset({"gzip", "deflate", "identity"})


def _check_content_encoding(request: web.Request) -> None:
    """One coding the HTTP parser decodes, or none: it decodes gzip and deflate and passes
    any other coding (`x-gzip`, `compress`, a list such as `gzip, gzip`) through as it is,
    so the service would read bytes that a proxy in front read otherwise."""
    values = _list_values(request, "Content-Encoding")
    named = [] if values == [""] else [coding.lower() for coding in values]  # one empty: none
    if len(named) > 1 or (named and named[0] not in DECODED_ENCODINGS):
        raise UnsupportedEncoding(UNSUPPORTED_ENCODING_MESSAGE)


def _check_header_encoding(request: web.Request) -> None:
    """aiohttp keeps header bytes that are not UTF-8 as lone surrogates, which every later
    `encode()` (key hashing, JWT decoding, JSON rendering) would fail on: refuse them here,
    once, for every route."""
    for name, value in request.headers.items():
        if not is_utf8(value):
            raise InvalidInput(f"header {name} is not valid UTF-8", code="invalid_header")


@web.middleware
async def security_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    _check_header_encoding(request)
    _check_host(request)
    _check_content_encoding(request)
    path = request.path
    if path in HIDDEN_EXACT or path.startswith(HIDDEN_PREFIXES):
        raise NotFound("not found: no such endpoint")
    settings = request.app[SETTINGS]
    redirect = _enforce_https(request, settings)
    if redirect is not None:
        return redirect
    if _is_preflight(request):
        origin = request.headers["Origin"].rstrip("/")
        if origin not in allowed_origins(settings):
            raise Forbidden(f"origin {origin} is not allowed", code="cors_origin_not_allowed")
        return _preflight(request, origin)
    return await handler(request)


def security_headers(settings: Settings | None) -> dict[str, str]:
    """The headers every response carries, whatever its request (CORS aside)."""
    csp = settings.text("SVC_CSP").strip() if settings is not None else ""
    return {
        "Content-Security-Policy": csp or DEFAULT_CSP,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "X-Frame-Options": "DENY",
    }


async def add_security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: applies to every response, streaming and errors included."""
    settings = request.app[SETTINGS]
    headers = response.headers
    for name, value in security_headers(settings).items():
        headers.setdefault(name, value)
    origin = request.headers.get("Origin", "").rstrip("/")
    allowed = allowed_origins(settings)
    if not origin and not allowed:
        return
    # Whether the CORS headers are there depends on Origin (allowed, other, or none sent):
    # a shared cache must not hand the copy made for one to another.
    varies = {v.strip().lower() for line in headers.getall("Vary", ()) for v in line.split(",")}
    if "origin" not in varies:
        headers.add("Vary", "Origin")
    if origin and origin in allowed:
        headers["Access-Control-Allow-Origin"] = origin
        headers["Access-Control-Allow-Credentials"] = "true"
        headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
