"""Hostile input, everywhere: every operation the running gateway's /openapi.json lists gets a
bounded sweep of bad requests, made with a credential that passes authentication (an API key
holding every scope; an admin session for the routes that need one; the SCIM token for SCIM),
so that what answers is the handler's own validation.

The product rule checked: bad input is the client's mistake, so it gets a 4xx carrying the
envelope `{"error": {"message", "type", "code"}}`, never a 5xx. Routes whose documented errors
have another shape (the OAuth token endpoint: RFC 6749; SCIM: RFC 7644 error documents; SAML:
XML and redirects) only have to stay below 500.

What each operation gets, one change at a time on top of a request that is otherwise valid (so
that a bad value reaches as deep into the handler as it can):

* each path parameter: 5,000 characters, a NUL (%00), unicode, "..%2F..", bytes that are not
  UTF-8, and the id of a resource of another workspace (which must not be accepted either);
* each query parameter the document lists: a wrong type, huge and negative numbers, an
  empty value, the parameter twice, and for cursors, cursors that decode but point outside
  the log;
* each header parameter: 5,000 characters, empty, unicode;
* each JSON body: none, not JSON, `[]`, `null`, `{}` and other broken documents; then every
  property (and those one level down) set in turn to the wrong type, 10**30, negative numbers,
  NaN-like strings, 100,000 characters, a lone surrogate, nesting 50 deep...; every property
  at once wrong;
* the form endpoints (OAuth token, SAML ACS): garbage forms, charsets and Basic credentials.

Nothing is skipped. No route shuts the service down; the probing key is never a target (the
foreign ids are another workspace's), each operation with a path parameter gets resources of
its own, and the SCIM routes are swept before the SCIM token route (whose valid requests rotate
the token). Two test-only adjustments: the client-log limiter (60 per minute per address) is
raised so the sweep reaches that route's validation, and the admin-session routes use a
session of their own each. SAML is disabled by default: every SAML route then answers
501 feature_disabled whatever the input, which the spec's error table names as the answer for
a disabled feature and this sweep accepts; `test_saml_routes_...` sweeps them again enabled.

Every failure is collected, with the server's traceback when the log has one, and the one
assertion at the end lists them all.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import io
import json
import logging
import re
import shutil
import traceback
import warnings
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlencode, urlsplit
from xml.etree import ElementTree

import aiohttp
import pytest
import stub_upstream
from platform_support import Running, running, settings_for, uid
from self_signed import key_and_cert
from yarl import URL

import gateway.admin_common
import gateway.identity.admin
import gateway.identity.service
from eventstore.cursor import LogPoint, encode_cursor
from gateway.settings import CATALOG
from gateway.state import CURSORS, PROJECTIONS, SETTINGS, STORE
from gateway.system import CLIENT_LOG_LIMITER, READINESS

ALL_SCOPES = ("*", "admin:read", "admin:write", "mcp", "chat")
TIMEOUT = aiohttp.ClientTimeout(total=60)
CONCURRENCY = 8
MIN_OPERATIONS = 72
VALID_SETTING_BY_TYPE = {"duration": "30s", "enum": "chat"}
"""A valid value of the settings swept, by type where "1" is not one."""
UPSTREAM_MODEL = "stub-model"
SCIM_PREFIX = "/scim/v2"
REFUSED_BASES = {
    ("GET /saml/login", "query valid base"): '"feature_disabled"',  # SAML is off by default
    # A code matches for 30 s of one enrolled secret: a mismatch is as deep as a fixed one goes.
    ("POST /v1/admin/auth/totp/verify", "body valid base"): '"totp_mismatch"',
    # RFC 7644's value filters in a PATCH path are not evaluated (docs/identity.md).
    (f"PATCH {SCIM_PREFIX}/Users/{{id}}", "body valid variant: filtered path"): "invalidPath",
}
"""Valid requests refused as far into their handler as a fixed request can get, with the
text their answer must hold."""
SCIM_USER_SCHEMA = "urn:ietf:params:scim:schemas:core:2.0:User"
SCIM_PATCH_SCHEMA = "urn:ietf:params:scim:api:messages:2.0:PatchOp"
SCIM_SEARCH_SCHEMA = "urn:ietf:params:scim:api:messages:2.0:SearchRequest"
SESSION_ROUTES = (
    "/v1/admin/auth/logout",
    "/v1/admin/auth/session",
    "/v1/admin/auth/totp/enrol",
    "/v1/admin/auth/totp/verify",
)
"""Routes that only a signed-in user (an admin session) may use: an API key gets a 401."""
PASSWORD = "correct-horse-battery-9"
MAX_INT8 = 2**63 - 1
ERROR_ID = re.compile(r"svc-[0-9a-f-]{36}")
CLIENT_LOGGER = "svc.client"
"""What /v1/client-log writes: a client's own log lines, at the client's level."""
OWN_LOGGERS = frozenset({"gateway", "actors", "eventstore", "projections", "svc", "aiohttp"})
"""An error these log while answering a 4xx is a failure too (a handler, an actor or a
projection that broke on the input). Libraries' own error lines (pysaml2 logs every response
it refuses) are only shown."""

JsonSchema = dict[str, Any]
Headers = tuple[tuple[str, str], ...]


# -- the operations, from the OpenAPI document ------------------------------------------------


@dataclass(frozen=True)
class Operation:
    method: str
    template: str
    path_params: tuple[str, ...]
    query: dict[str, JsonSchema]
    headers: tuple[str, ...]
    body: JsonSchema | None
    """The resolved JSON schema of a JSON body; None when there is none (or it is a form)."""
    form: bool

    @property
    def label(self) -> str:
        return f"{self.method} {self.template}"

    @property
    def error_shape(self) -> str:
        """How the route's errors look: "envelope", or a shape only held to status < 500."""
        if self.template == "/v1/oauth/token":
            return "oauth (RFC 6749)"
        if self.template.startswith(SCIM_PREFIX):
            return "scim (RFC 7644)"
        if self.template.startswith("/saml/"):
            return "saml"
        return "envelope"

    @property
    def takes_body(self) -> bool:
        return self.method in ("POST", "PUT", "PATCH")


def resolve(schema: JsonSchema, components: dict[str, JsonSchema]) -> JsonSchema:
    ref = schema.get("$ref")
    if isinstance(ref, str):
        return resolve(components[ref.rsplit("/", 1)[1]], components)
    return schema


def main_type(schema: JsonSchema, components: dict[str, JsonSchema]) -> JsonSchema:
    """The non-null alternative of an optional (anyOf [X, null]) schema, resolved."""
    schema = resolve(schema, components)
    for option in schema.get("anyOf", []):
        option = resolve(option, components)
        if option.get("type") != "null":
            return main_type(option, components)
    return schema


def operations(document: dict[str, Any]) -> list[Operation]:
    components = document["components"]["schemas"]
    found = []
    for template, methods in document["paths"].items():
        for method, op in methods.items():
            params = op.get("parameters", [])
            query = {p["name"]: p["schema"] for p in params if p["in"] == "query"}
            headers = tuple(p["name"] for p in params if p["in"] == "header")
            content = op.get("requestBody", {}).get("content", {})
            json_schema = content.get("application/json", {}).get("schema")
            found.append(
                Operation(
                    method=method.upper(),
                    template=template,
                    path_params=tuple(p["name"] for p in params if p["in"] == "path"),
                    query=query,
                    headers=headers,
                    body=None if json_schema is None else resolve(json_schema, components),
                    form="application/x-www-form-urlencoded" in content,
                )
            )
    return found


# -- hostile values ---------------------------------------------------------------------------


def nested(depth: int) -> Any:
    value: Any = "bottom"
    for level in range(depth):
        value = [value] if level % 2 else {"n": value}
    return value


def wrong_type(schema: JsonSchema, example: Any) -> Any:
    kind = schema.get("type")
    if kind is None and example is not None:
        kind = {str: "string", bool: "boolean", int: "integer", float: "number"}.get(
            type(example), "array" if isinstance(example, list) else "object"
        )
    return {
        "string": 12345,
        "integer": "twelve",
        "number": "twelve",
        "boolean": "maybe",
        "array": {"not": "a list"},
        "object": ["not", "an", "object"],
    }.get(str(kind), {"unexpected": ["shape"]})


HOSTILE_JSON: tuple[tuple[str, Any], ...] = (
    ("null", None),
    ("10**30", 10**30),
    ("-1", -1),
    ("1.5", 1.5),
    ('"NaN"', "NaN"),
    ('""', ""),
    ("100k chars", "x" * 100_000),
    ("lone surrogate", "\ud800"),
    ("nested 50", nested(50)),
    ("mixed list", [1, "a", None, {"$ne": None}]),
)
HOSTILE_STRINGS: tuple[tuple[str, str], ...] = (
    ('"9"*5000', "9" * 5000),
    ('"1e400"', "1e400"),
    ("fullwidth digits", "\uff11\uff12"),
    ("unicode", "\u00fcn\u00ef\u00e7\u00f8d\u00e9 \U0001f4a5 \u202e"),
)
"""For properties whose valid value is a string: strings a parser downstream may trip on."""

WHOLE_BODY: tuple[tuple[str, Any], ...] = (
    ("10**30", 10**30),
    ("100k chars", "x" * 100_000),
    ("nested 50", nested(50)),
    ("null", None),
)
"""Values given to every property at once (besides the wrong type of each)."""

JSON = "application/json"
FORM = "application/x-www-form-urlencoded"
RAW_BODIES: tuple[tuple[str, bytes, str | None], ...] = (
    ("no body", b"", JSON),
    ("not json", b"not json", JSON),
    ("[]", b"[]", JSON),
    ("null", b"null", JSON),
    ("{}", b"{}", JSON),
    ("NaN literal", b'{"a": NaN}', JSON),
    ("1e999", b"1e999", JSON),
    ("10**30 alone", b"1" + b"0" * 30, JSON),
    ("invalid UTF-8", b'{"a": "\xff\xfe"}', JSON),
    ("UTF-8 BOM", b'\xef\xbb\xbf{"a": 1}', JSON),
    ("truncated", b'{"a": [1, 2', JSON),
    ("nested 70", b"[" * 70 + b"]" * 70, JSON),
    ("bogus charset", b"{}", "application/json; charset=x-bogus"),
    ("JSON as text/plain", b"{}", "text/plain"),
    ("no content type", b"{}", None),
)

BAD_UTF8 = "%FF%FE"


UNIQUE = "@UNIQUE@"
"""In a base body: replaced by a fresh id in every request made of it, so that two probes of
a create route do not stop at each other's name (409) before reaching what they test."""


def dump(value: Any) -> bytes:
    """JSON that orjson will not write: 10**30, NaN, lone surrogates (as \\ud800 escapes)."""
    text = json.dumps(value, allow_nan=True)
    while UNIQUE in text:
        text = text.replace(UNIQUE, uid(), 1)
    return text.encode()


def path_values(foreign: str | None) -> list[tuple[str, str]]:
    """(label, percent-encoded value) for one path parameter."""
    values = [
        ("5000 chars", "a" * 5000),
        ("NUL", "a%00b"),
        ("unicode", quote("\u00fcn\u00ef\u00e7\u00f8d\u00e9-\U0001f4a5", safe="")),
        ("..%2F..", "..%2F..%2Fadmin"),
        ("not UTF-8", "a" + BAD_UTF8),
        ("space", "%20"),
        ("other-workspace shape", "ws-elsewhere%3Ausr_0123456789abcdef0123"),
    ]
    if foreign is not None:
        values.append(("another workspace's id", quote(foreign, safe="")))
    return values


def cursor_values() -> list[tuple[str, str]]:
    return [
        # The plain form of earlier builds, refused as such.
        ("plain cursor at the int8 limit", encode_cursor(LogPoint(MAX_INT8, MAX_INT8))),
        ("plain cursor at position max", encode_cursor(LogPoint(0, MAX_INT8))),
        ("plain cursor at tx max", encode_cursor(LogPoint(MAX_INT8, 0))),
        ("plain cursor-shaped garbage", "c1" + "!" * 22),
        ("plain cursor of the origin", "c1" + "A" * 22),
        # Sealed-shaped: refused by their spelling, whatever the deployment's key.
        ("sealed cursor-shaped garbage", "c2" + "!" * 22),
        ("sealed cursor with spare bits set", "c2" + "A" * 21 + "B"),
        ("sealed cursor one character long", "c2" + "A" * 23),
        ("audit cursor with spare bits set", "a2" + "A" * 21 + "B"),
    ]


def query_values(name: str, schema: JsonSchema) -> list[tuple[str, list[str]]]:
    """(label, percent-encoded values) for one query parameter; two values: it is repeated."""
    kind = main_type(schema, {}).get("type", "string")
    wrong = {"integer": "abc", "number": "abc", "boolean": "maybe"}.get(kind, "[1, {}]")
    values = [
        ("wrong type", [quote(wrong, safe="")]),
        ("10**30", ["1" + "0" * 30]),
        ('"9"*5000', ["9" * 5000]),
        ("negative", ["-1"]),
        ("1.5", ["1.5"]),
        ("NaN", ["NaN"]),
        ("empty", [""]),
        ("repeated", ["1", "2"]),
        ("5000 chars", ["x" * 5000]),
        ("unicode", [quote("\u00fcn\u00ef\U0001f4a5", safe="")]),
        ("not UTF-8", [BAD_UTF8]),
    ]
    if "cursor" in name.lower() or name == "before":  # `before`: the audit log's cursor
        values += [(label, [value]) for label, value in cursor_values()]
    return values


# -- probes -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    op: Operation
    kind: str
    path: str
    """Percent-encoded path and query string."""
    body: bytes | None = None
    content_type: str | None = None
    headers: Headers = ()
    """Credentials and the probe's own headers."""
    foreign: bool = False
    """The path names another workspace's resource: a 2xx would be a leak."""


@dataclass
class Sweep:
    """Everything one run needs: the service, its credentials, the valid requests to vary."""

    svc: Running
    http: aiohttp.ClientSession
    key: str
    components: dict[str, JsonSchema] = field(default_factory=dict)
    scim_token: str = ""
    sessions: dict[str, Headers] = field(default_factory=dict)
    """Per operation label: the cookie and CSRF header of an admin session of its own."""
    path_bases: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    """Per operation label: valid values of its path parameters (one dict per variant)."""
    foreign: dict[tuple[str, str], str] = field(default_factory=dict)
    """(operation label, parameter): the id of a resource of another workspace."""
    body_bases: dict[str, dict[str, Any]] = field(default_factory=dict)
    body_variants: dict[str, list[tuple[str, dict[str, Any]]]] = field(default_factory=dict)
    """Other valid bodies, sent as they are (they take paths the base does not)."""
    query_bases: dict[str, dict[str, str]] = field(default_factory=dict)
    form_base: dict[str, str] = field(default_factory=dict)

    def credentials(self, op: Operation) -> Headers:
        if op.template.startswith(SCIM_PREFIX):
            return (("Authorization", f"Bearer {self.scim_token}"),)
        if op.template in SESSION_ROUTES:
            return self.sessions[op.label]
        if op.template == "/v1/oauth/token" or op.template.startswith("/saml/"):
            return ()
        return (("Authorization", f"Bearer {self.key}"),)

    def query(self, op: Operation) -> dict[str, list[str]]:
        return {k: [quote(v, safe="")] for k, v in self.query_bases.get(op.label, {}).items()}

    def json_body(self, op: Operation) -> tuple[bytes | None, str | None]:
        base = self.body_bases.get(op.label)
        return (None, None) if base is None else (dump(base), JSON)

    def body_base(self, op: Operation, path: dict[str, str]) -> dict[str, Any] | None:
        """The valid body at these path values: a setting's value must suit its key."""
        if op.label == "PUT /v1/admin/settings/{key}":
            return {"value": VALID_SETTING_BY_TYPE.get(CATALOG[path["key"]].type, "1")}
        return self.body_bases.get(op.label)


def fill(template: str, values: dict[str, str]) -> str:
    return re.sub(r"\{([^}]+)\}", lambda m: values.get(m.group(1), "probe-unknown"), template)


def with_query(path: str, params: dict[str, list[str]]) -> str:
    parts = [f"{quote(name, safe='')}={value}" for name, vals in params.items() for value in vals]
    return path + ("?" + "&".join(parts) if parts else "")


def path_probes(sweep: Sweep, op: Operation, base: dict[str, str]) -> Iterator[Probe]:
    body, content_type = sweep.json_body(op)
    for name in op.path_params:
        for label, value in path_values(sweep.foreign.get((op.label, name))):
            path = with_query(fill(op.template, {**base, name: value}), sweep.query(op))
            foreign = label == "another workspace's id"
            kind = f"path {name}={label}"
            yield Probe(op, kind, path, body, content_type, sweep.credentials(op), foreign)


def query_probes(sweep: Sweep, op: Operation, base: dict[str, str]) -> Iterator[Probe]:
    path = fill(op.template, base)
    valid = sweep.query(op)
    body, content_type = sweep.json_body(op)
    auth = sweep.credentials(op)
    if op.query:
        yield Probe(op, "query valid base", with_query(path, valid), body, content_type, auth)
    unknown = with_query(path, {**valid, "zz_unknown": ["1"]})
    yield Probe(op, "query unknown parameter", unknown, body, content_type, auth)
    for name, schema in op.query.items():
        for label, values in query_values(name, schema):
            query = with_query(path, {**valid, name: values})
            yield Probe(op, f"query {name}={label}", query, body, content_type, auth)


def header_probes(sweep: Sweep, op: Operation, base: dict[str, str]) -> Iterator[Probe]:
    path = with_query(fill(op.template, base), sweep.query(op))
    body, content_type = sweep.json_body(op)
    for name in op.headers:
        # Each its own, so that no two writes share an Idempotency-Key by accident.
        for label, value in (
            ("5000 chars", "h" * 4990 + uid()),
            ("empty", ""),
            ("unicode", "\u00fcn\u00ef\u00e7\u00f8d\u00e9-" + uid()),
        ):
            headers = (*sweep.credentials(op), (name, value))
            yield Probe(op, f"header {name}={label}", path, body, content_type, headers)


def properties(op: Operation, base: dict[str, Any], sweep: Sweep) -> dict[str, JsonSchema]:
    """Property name -> schema: the documented properties and the base's own keys."""
    props: dict[str, Any] = dict(op.body.get("properties", {})) if op.body else {}
    props.update({name: {} for name in base if name not in props})
    return {name: main_type(schema, sweep.components) for name, schema in props.items()}


def mutations(
    base: dict[str, Any], props: dict[str, JsonSchema], prefix: str = ""
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(label, body): `base` with one property set to one hostile value."""
    for name, schema in props.items():
        example = base.get(name)
        values: list[tuple[str, Any]] = [("wrong type", wrong_type(schema, example))]
        values += HOSTILE_JSON
        if schema.get("type") == "string" or isinstance(example, str):
            values += HOSTILE_STRINGS
        for label, value in values:
            yield f"{prefix}{name}={label}", {**base, name: value}


def nested_mutations(
    base: dict[str, Any], props: dict[str, JsonSchema], sweep: Sweep
) -> Iterator[tuple[str, dict[str, Any]]]:
    """One level down: the properties of an object property, or of a list's first object."""
    for name, schema in props.items():
        inner = base.get(name)
        if isinstance(inner, list) and inner and isinstance(inner[0], dict):
            item_props = main_type(schema.get("items", {}), sweep.components).get("properties", {})
            inner_props = {k: main_type(s, sweep.components) for k, s in item_props.items()}
            inner_props.update({k: {} for k in inner[0] if k not in inner_props})
            for label, changed in mutations(inner[0], inner_props, f"{name}.0."):
                yield label, {**base, name: [changed, *inner[1:]]}
        elif isinstance(inner, dict) and inner:
            inner_props = {
                k: main_type(s, sweep.components) for k, s in schema.get("properties", {}).items()
            }
            inner_props.update({k: {} for k in inner if k not in inner_props})
            for label, changed in mutations(inner, inner_props, f"{name}."):
                yield label, {**base, name: changed}


def body_probes(
    sweep: Sweep, op: Operation, base_path: dict[str, str], *, whole: bool = True
) -> Iterator[Probe]:
    """The body sweep at one set of path values; `whole`: with the probes that do not depend
    on them (broken documents, every property at once), sent once per operation."""
    path = with_query(fill(op.template, base_path), sweep.query(op))
    auth = sweep.credentials(op)
    base = sweep.body_base(op, base_path)
    props = properties(op, base or {}, sweep)
    if whole:
        for label, raw, content_type in RAW_BODIES:
            yield Probe(op, f"body {label}", path, raw, content_type, auth)
        for label, variant in sweep.body_variants.get(op.label, []):
            yield Probe(op, f"body valid variant: {label}", path, dump(variant), JSON, auth)
        if base is not None:
            wrong = {name: wrong_type(schema, base.get(name)) for name, schema in props.items()}
            yield Probe(op, "body every property the wrong type", path, dump(wrong), JSON, auth)
            for label, value in WHOLE_BODY:
                body = dump(dict.fromkeys(props, value))
                yield Probe(op, f"body every property={label}", path, body, JSON, auth)
    if base is None:
        return
    yield Probe(op, "body valid base", path, dump(base), JSON, auth)
    changes = [*mutations(base, props)]
    if op.label not in SHALLOW:
        changes += nested_mutations(base, props, sweep)
    for label, changed in changes:
        yield Probe(op, f"body {label}", path, dump(changed), JSON, auth)


SHALLOW = frozenset({f"PUT {SCIM_PREFIX}/Users/{{id}}"})
"""Bodies swept one level only: a SCIM PUT states the user as a POST does, and goes through
the same parsing, whose nested properties the POST's sweep reaches."""


def basic(user: bytes, password: bytes) -> str:
    return "Basic " + base64.b64encode(user + b":" + password).decode()


def form_probes(sweep: Sweep, op: Operation) -> Iterator[Probe]:
    """The OAuth token endpoint: garbage forms, each field changed, garbage Basic credentials."""
    path, valid = op.template, sweep.form_base
    yield Probe(op, "form valid base", path, urlencode(valid).encode(), FORM)
    for label, raw, content_type in (
        ("no body", b"", FORM),
        ("%%%", b"%%%", FORM),
        ("=&=&", b"=&=&&==", FORM),
        ("not UTF-8", b"grant_type=\xff\xfe&client_id=\xc3", FORM),
        ("100k without =", b"a" * 100_000, FORM),
        ("10k fields", b"&".join(b"f%d=1" % i for i in range(10_000)), FORM),
        ("NUL", b"grant_type=client_credentials&client_id=a%00b", FORM),
        ("bad escape", b"grant_type=client%ZZcredentials", FORM),
        ("bogus charset", urlencode(valid).encode(), f"{FORM}; charset=x-bogus"),
        ("UTF-16 charset", urlencode(valid).encode(), f"{FORM}; charset=utf-16"),
        ("JSON body", dump(valid), FORM),
        ("form sent as JSON", urlencode(valid).encode(), JSON),
        ("no content type", urlencode(valid).encode(), None),
        ("multipart garbage", b"--x\r\n\r\n--", "multipart/form-data; boundary=x"),
        ("multipart no boundary", b"--x\r\n\r\n--", "multipart/form-data"),
    ):
        yield Probe(op, f"form {label}", path, raw, content_type)
    for name in valid:
        for label, value in (
            ("missing", None),
            ("empty", ""),
            ("5000 chars", "v" * 5000),
            ("unicode", "\u00fcn\u00ef\U0001f4a5"),
            ("repeated", ["a", "b"]),
        ):
            fields: list[tuple[str, str]] = [(k, v) for k, v in valid.items() if k != name]
            if isinstance(value, list):
                fields += [(name, v) for v in value]
            elif value is not None:
                fields.append((name, value))
            yield Probe(op, f"form {name}={label}", path, urlencode(fields).encode(), FORM)
    client = (valid["client_id"].encode(), valid["client_secret"].encode())
    only_grant = urlencode({"grant_type": "client_credentials"}).encode()
    for label, header, body in (
        ("Basic not base64", "Basic !!!", only_grant),
        ("Basic no colon", "Basic " + base64.b64encode(b"nocolon").decode(), only_grant),
        ("Basic not UTF-8", basic(b"\xff\xfe", b"\xfd"), only_grant),
        ("Basic empty", "Basic ", only_grant),
        ("Basic only colon", basic(b"", b""), only_grant),
        ("Basic 3700 chars", basic(b"u" * 2000, b"p" * 1700), only_grant),
        ("Basic and form both", basic(*client), urlencode(valid).encode()),
        ("Bearer instead", f"Bearer {sweep.key}", only_grant),
    ):
        yield Probe(op, f"form {label}", path, body, FORM, (("Authorization", header),))


def saml_form_probes(op: Operation, in_response_to: str = "_none") -> Iterator[Probe]:
    """The SAML ACS (an HTTP-POST binding form): garbage forms and garbage SAML responses."""
    for label, raw, content_type in (*RAW_BODIES[:3], ("not UTF-8", b"SAMLResponse=\xff", FORM)):
        yield Probe(op, f"body {label}", op.template, raw, content_type)
    for label, xml in saml_documents(in_response_to):
        response = base64.b64encode(xml).decode()
        for relay in ("/dashboard", "https://evil.example/"):
            form = urlencode({"SAMLResponse": response, "RelayState": relay}).encode()
            yield Probe(op, f"form {label} (RelayState {relay})", op.template, form, FORM)
    for label, value in (
        ("not base64", "!!!"),
        ("not base64, unicode", "\u00fc\U0001f4a5"),
        ("100k", "A" * 100_000),
        ("empty", ""),
    ):
        form = urlencode({"SAMLResponse": value}).encode()
        yield Probe(op, f"form SAMLResponse {label}", op.template, form, FORM)


PROTOCOL = "urn:oasis:names:tc:SAML:2.0:protocol"


def saml_documents(in_response_to: str) -> list[tuple[str, bytes]]:
    """Hostile SAML responses answering `in_response_to` (so that they get past the check of
    an outstanding request, when it is a real one, and reach the SAML library)."""
    head = f'<samlp:Response xmlns:samlp="{PROTOCOL}" ID="_r1" InResponseTo="{in_response_to}"'
    valid_head = f'{head} Version="2.0" IssueInstant="2024-01-01T00:00:00Z"'
    entities = (
        '<!ENTITY b "bbbbbbbbbb"><!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;">'
        '<!ENTITY d "&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;">'
    )
    documents = [
        ("not XML", "<samlp:Response><<<"),
        ("unsigned, no assertion", f"{valid_head}/>"),
        ("bad version and instant", f'{head} Version="99" IssueInstant="yesterday"/>'),
        (
            "external entity",
            '<?xml version="1.0"?><!DOCTYPE r [<!ENTITY x SYSTEM "file:///etc/passwd">]>'
            f"{valid_head}>&x;</samlp:Response>",
        ),
        (
            "entity expansion",
            f'<?xml version="1.0"?><!DOCTYPE r [{entities}]>{valid_head}>&d;</samlp:Response>',
        ),
        ("nested 5000 deep", f"{valid_head}>{'<a>' * 5000}{'</a>' * 5000}</samlp:Response>"),
    ]
    return [(label, xml.encode()) for label, xml in documents]


def probes_for(sweep: Sweep, op: Operation) -> list[Probe]:
    bases = sweep.path_bases.get(op.label, [{}])
    found = [
        *path_probes(sweep, op, bases[0]),
        *query_probes(sweep, op, bases[0]),
        *header_probes(sweep, op, bases[0]),
    ]
    if op.form:
        found += form_probes(sweep, op)
    elif op.template == "/saml/acs":
        found += saml_form_probes(op)
    elif op.takes_body:
        for index, base in enumerate(bases):
            variant = ", ".join(f"{k}={v}" for k, v in base.items()) if len(bases) > 1 else ""
            for probe in body_probes(sweep, op, base, whole=index == 0):
                kind = f"{probe.kind} ({variant})" if variant else probe.kind
                found.append(
                    Probe(op, kind, probe.path, probe.body, probe.content_type, probe.headers)
                )
    return found


# -- sending and judging ----------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    text: str


@dataclass
class Failure:
    probe: Probe
    status: int
    reason: str
    excerpt: str
    traceback: str = ""

    def render(self) -> str:
        lines = [
            f"{self.probe.op.label}  [{self.probe.kind}]  -> {self.status}: {self.reason}",
            f"    body: {self.excerpt}",
        ]
        return "\n".join(lines + ["    " + line for line in self.traceback.splitlines()])


async def send(http: aiohttp.ClientSession, base: str, probe: Probe) -> Answer:
    headers = dict(probe.headers)
    if probe.content_type is not None:
        headers["Content-Type"] = probe.content_type
    body = probe.body
    try:
        async with http.request(
            probe.op.method,
            URL(base + probe.path, encoded=True),
            # aiohttp warns about a raw body over 1 MiB (it would block the loop): a stream.
            data=io.BytesIO(body) if body is not None and len(body) > 2**20 else body,
            headers=headers,
            timeout=TIMEOUT,
            allow_redirects=False,
            skip_auto_headers=() if probe.content_type else ("Content-Type",),
        ) as resp:
            streaming = resp.headers.get("Content-Type", "").startswith("text/event-stream")
            if resp.status < 300 and streaming:
                return Answer(resp.status, "")  # a feed, open: its status is the answer
            raw = await resp.read()
            return Answer(resp.status, raw.decode("utf-8", "replace"))
    except TimeoutError:
        return Answer(0, "no answer within the client timeout")
    except aiohttp.ClientError as exc:
        return Answer(-1, f"{type(exc).__name__}: {exc}")


def envelope_problem(text: str) -> str | None:
    try:
        body = json.loads(text)
    except ValueError:
        return "not JSON"
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return "no error object"
    error = body["error"]
    if not isinstance(error.get("message"), str) or not error["message"]:
        return "no message"
    if "type" not in error or "code" not in error:
        return "error object lacks type or code"
    return None


def feature_disabled(text: str) -> bool:
    return envelope_problem(text) is None and json.loads(text)["error"]["code"] == (
        "feature_disabled"
    )


def judge(probe: Probe, answer: Answer) -> Failure | None:
    excerpt = answer.text[:300].replace("\n", " ")
    if answer.status == 0:
        return Failure(probe, 0, "no answer within 10 s (client timeout)", excerpt)
    if answer.status < 0:
        return Failure(probe, -1, "connection failed", excerpt)
    if answer.status == 501 and probe.op.template.startswith("/saml/"):
        if feature_disabled(answer.text):
            return None  # the spec's answer for a feature switched off: SAML, by default
    if answer.status >= 500:
        return Failure(probe, answer.status, "5xx", excerpt)
    if answer.status >= 400 and probe.op.error_shape == "envelope":
        problem = envelope_problem(answer.text)
        if problem is not None:
            return Failure(probe, answer.status, f"4xx without the envelope ({problem})", excerpt)
    if probe.foreign and 200 <= answer.status < 300:
        return Failure(probe, answer.status, "another workspace's id was accepted", excerpt)
    return None


def refused_bases(answers: list[tuple[Probe, Answer]]) -> list[str]:
    """The valid requests each mutation starts from that were not accepted: a base gone
    stale (a renamed field, say) would stop every mutation of its operation at the first
    validation error, and the sweep would no longer reach the handlers behind it."""
    return [
        f"{probe.op.label} ({probe.kind}): {answer.status} {answer.text[:200]}"
        for probe, answer in answers
        if "valid" in probe.kind.split(":")[0].split()
        and answer.status >= 400
        and REFUSED_BASES.get((probe.op.label, probe.kind), "\0") not in answer.text
        # The sweep sends many changes of one user at once: one that lost each of its tries
        # to the others is refused as it should be (409), its handler reached all the same.
        and USER_CHANGED_MESSAGE not in answer.text
    ]


USER_CHANGED_MESSAGE = "changed while this change was being made"


async def send_all(
    http: aiohttp.ClientSession, base: str, probes: list[Probe]
) -> list[tuple[Probe, Answer]]:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(probe: Probe) -> tuple[Probe, Answer]:
        async with gate:
            return probe, await send(http, base, probe)

    return list(await asyncio.gather(*(one(p) for p in probes)))


def logged_traceback(error_id: str, records: list[logging.LogRecord]) -> str:
    """The last frames of the traceback the log holds for a 500's error id."""
    for record in records:
        if error_id in record.getMessage() and record.exc_info:
            lines = "".join(traceback.format_exception(*record.exc_info)).splitlines()
            return "\n".join(lines[-12:])
    return ""


def verdict(answers: list[tuple[Probe, Answer]], records: list[logging.LogRecord]) -> str:
    """The report of every failure (grouped, then each with its traceback) and of every error
    the server logged without a 5xx to show for it; empty when there is none."""
    failures = [f for probe, answer in answers if (f := judge(probe, answer)) is not None]
    answered: set[str] = set()
    for failure in failures:
        match = ERROR_ID.search(failure.excerpt)
        if match is not None:
            answered.add(match.group(0))
            failure.traceback = logged_traceback(match.group(0), records)
    unanswered = [
        r
        for r in records
        if r.name.split(".")[0] in OWN_LOGGERS
        and r.name != CLIENT_LOGGER
        and not any(e in r.getMessage() for e in answered)
    ]
    if not failures and not unanswered:
        return ""
    groups = Counter((f.probe.op.label, f.status, f.reason) for f in failures)
    lines = [f"{len(failures)} failures in {len(groups)} groups:"]
    lines += [f"  {n:4d} x {op} -> {status} {why}" for (op, status, why), n in groups.items()]
    lines += ["", *(f.render() for f in failures)]
    if unanswered:
        lines.append("\nerrors the server logged without answering a 5xx:")
        for r in unanswered:
            lines.append(f"  {r.name}: {r.getMessage()[:300]}")
            if r.exc_info:
                lines.append("".join(traceback.format_exception(*r.exc_info))[-1500:])
    return "\n".join(lines)


def printed_verdict(
    name: str, answers: list[tuple[Probe, Answer]], records: list[logging.LogRecord], ops: int
) -> str:
    """The verdict, printed with the sweep's figures for the reader of the run."""
    print(f"\n{name}: {len(answers)} requests over {ops} operations")
    print("statuses:", sorted(Counter(answer.status for _, answer in answers).items()))
    report = verdict(answers, records)
    print(report or "no failures")
    if library_errors(records):
        print("library error lines (not failures):\n" + library_errors(records))
    return report


def library_errors(records: list[logging.LogRecord]) -> str:
    """Error lines of libraries (not failures: shown for the reader of the run)."""
    return "\n".join(
        f"  {r.name}: {r.getMessage()[:200]}"
        for r in records
        if r.name.split(".")[0] not in OWN_LOGGERS
    )


# -- the world the probes act on --------------------------------------------------------------


async def call(
    sweep: Sweep, method: str, path: str, body: Any = None, key: str | None = None
) -> tuple[Any, aiohttp.ClientResponse]:
    async with sweep.http.request(
        method,
        sweep.svc.url(path),
        json=body,
        headers={"Authorization": f"Bearer {key or sweep.key}"},
        timeout=aiohttp.ClientTimeout(total=30),
    ) as resp:
        answer = await resp.json(content_type=None)
        assert resp.status < 300, (method, path, resp.status, answer)
        return answer, resp


async def new_agent(sweep: Sweep, key: str | None = None) -> str:
    body = {"name": uid("agent-"), "model": UPSTREAM_MODEL}
    return str((await call(sweep, "POST", "/v1/admin/agents", body, key))[0]["id"])


async def new_user(sweep: Sweep, key: str | None = None) -> tuple[str, str]:
    name = uid("user-")
    body = {"user_name": name, "password": PASSWORD, "roles": ["member"]}
    return str((await call(sweep, "POST", "/v1/admin/users", body, key))[0]["id"]), name


async def new_api_key(sweep: Sweep, key: str | None = None) -> str:
    body = {"name": uid("k-"), "scopes": ["chat"]}
    return str((await call(sweep, "POST", "/v1/admin/apikeys", body, key))[0]["id"])


async def new_client(sweep: Sweep, key: str | None = None) -> tuple[str, str]:
    body = {"name": uid("client-"), "scopes": ["chat"]}
    client, _ = await call(sweep, "POST", "/v1/admin/oauth/clients", body, key)
    return str(client["client_id"]), str(client["client_secret"])


async def new_session(sweep: Sweep, user_name: str) -> Headers:
    body = {"username": user_name, "password": PASSWORD}
    async with sweep.http.post(sweep.svc.url("/v1/admin/auth/login"), json=body) as resp:
        assert resp.status == 200, await resp.text()
        csrf = (await resp.json())["csrf_token"]
        token = resp.cookies["svc_session"].value
    return (("Cookie", f"svc_session={token}"), ("X-CSRF-Token", csrf))


async def start_totp_enrolment(sweep: Sweep, session: Headers) -> None:
    """Verify's valid base needs an enrolment started; the sweep's own enrol probes run
    beside it, in no set order, and check a password first, so they cannot be relied on."""
    body = {"current_password": PASSWORD}
    url = sweep.svc.url("/v1/admin/auth/totp/enrol")
    async with sweep.http.post(url, json=body, headers=dict(session)) as resp:
        assert resp.status == 200, await resp.text()


def settings_keys() -> list[str]:
    """One stored, restart-applied key of each type (a secret one too): a hostile value
    accepted for a live key would change the service under the rest of the sweep."""
    chosen: dict[tuple[str, bool], str] = {}
    for spec in CATALOG.values():
        if spec.storable and spec.apply == "R":
            chosen.setdefault((spec.type, spec.secret), spec.key)
    return sorted(chosen.values())


async def path_bases_for(sweep: Sweep, op: Operation) -> list[dict[str, str]]:
    """Valid values of `op`'s path parameters: a fresh resource of its own for each operation,
    so that what one operation's probes change never reaches another's."""
    template = op.template
    if not op.path_params:
        return [{}]
    if "{agent_id}" in template:
        return [{"agent_id": await new_agent(sweep)}]
    if "{key_id}" in template:
        return [{"key_id": await new_api_key(sweep)}]
    if template.startswith("/v1/admin/oauth/clients/"):
        return [{"id": (await new_client(sweep))[0]}]
    if template.startswith("/v1/admin/settings/"):
        return [{"key": key} for key in settings_keys()]
    if template.startswith("/v1/admin/identity/secrets/"):
        return [{"scope": "ldap", "name": "bind_password"}]
    if template.startswith(("/v1/admin/users/", f"{SCIM_PREFIX}/Users/")):
        return [{"id": (await new_user(sweep))[0], "role": "member"}]
    if template == f"{SCIM_PREFIX}/ResourceTypes/{{id}}":
        return [{"id": "User"}]
    if template == f"{SCIM_PREFIX}/Schemas/{{id}}":
        return [{"id": SCIM_USER_SCHEMA}]
    return [dict.fromkeys(op.path_params, "probe-unknown")]


def foreign_ids(op: Operation, agent: str, user: str, key: str, client: str) -> dict[str, str]:
    """`op`'s path parameters that name a workspace's resource -> one of another workspace."""
    template = op.template
    found = {}
    if "agent_id" in op.path_params:
        found["agent_id"] = agent
    if "key_id" in op.path_params:
        found["key_id"] = key
    if template.startswith("/v1/admin/oauth/clients/"):
        found["id"] = client
    if template.startswith(("/v1/admin/users/", f"{SCIM_PREFIX}/Users/")):
        found["id"] = user
    return found


EMAIL = {"value": "ada@example.com", "primary": True, "type": "work"}


def body_bases(login_user: str, scim_user: str) -> dict[str, dict[str, Any]]:
    """A valid body per operation: each probe changes one thing in it."""
    parameters = {"temperature": 0.5, "top_p": 0.5, "max_tokens": 10, "reasoning_effort": "low"}
    scim_user_body = {
        "schemas": [SCIM_USER_SCHEMA],
        "userName": f"{scim_user}-{UNIQUE}",
        "name": {"givenName": "Ada", "familyName": "Probe"},
        "displayName": "Ada Probe",
        "emails": [EMAIL],
        "externalId": f"ext-{UNIQUE}",
        "active": True,
        "password": PASSWORD,
    }
    search = {
        "schemas": [SCIM_SEARCH_SCHEMA],
        "filter": f'userName eq "{scim_user}"',
        "startIndex": 1,
        "count": 10,
        "attributes": ["userName"],
    }
    return {
        "POST /v1/admin/agents": {
            "name": f"probe-agent-{UNIQUE}",
            "model": UPSTREAM_MODEL,
            "description": "d",
            "system_prompt": "s",
            "parameters": parameters,
        },
        "PATCH /v1/admin/agents/{agent_id}": {"description": "d2", "parameters": parameters},
        "POST /v1/admin/apikeys": {
            "name": "probe-key",
            "scopes": ["chat"],
            "rate_limit_rpm": 60,
            "expires_at": "2099-01-01T00:00:00Z",
        },
        "POST /v1/admin/auth/login": {
            "username": login_user,
            "password": PASSWORD,
            "workspace_id": "default",
            "totp_code": "123456",
        },
        "POST /v1/admin/auth/totp/enrol": {"current_password": PASSWORD},
        "POST /v1/admin/auth/totp/verify": {"code": "123456"},
        "PUT /v1/admin/identity/secrets/{scope}/{name}": {"value": "s3cret"},
        "POST /v1/admin/oauth/clients": {"name": "probe-client", "scopes": ["chat"]},
        "POST /v1/admin/roles": {"name": "probe.role", "permissions": {"agents": "read"}},
        "POST /v1/admin/scim/token": {"action": "issue"},
        "POST /v1/admin/users": {
            "user_name": f"probe-user-{UNIQUE}",
            "password": PASSWORD,
            "roles": ["member"],
            "display_name": "P",
            "emails": [EMAIL],
            "external_id": "ext",
        },
        "PATCH /v1/admin/users/{id}": {"display_name": "Probe", "active": True, "emails": [EMAIL]},
        "POST /v1/admin/users/{id}/apikeys": {"name": "probe", "scopes": ["chat"]},
        "PUT /v1/admin/users/{id}/password": {"password": PASSWORD + "-2"},
        "POST /v1/admin/users/{id}/roles": {"role": "member"},
        "POST /v1/chat/completions": {
            "model": UPSTREAM_MODEL,
            "messages": [{"role": "user", "content": "hello", "name": "probe"}],
            "max_tokens": 2,
        },
        "POST /v1/client-log": {
            "entries": [
                {
                    "level": "info",
                    "message": "m",
                    "source": "probe",
                    "at": "2024-01-01T00:00:00Z",
                    "context": {"k": "v", "n": 1},
                }
            ]
        },
        f"POST {SCIM_PREFIX}/Users": scim_user_body,
        f"PUT {SCIM_PREFIX}/Users/{{id}}": {**scim_user_body, "userName": f"scim-put-{UNIQUE}"},
        f"PATCH {SCIM_PREFIX}/Users/{{id}}": {
            "schemas": [SCIM_PATCH_SCHEMA],
            "Operations": [{"op": "replace", "path": "displayName", "value": "Patched"}],
        },
        f"POST {SCIM_PREFIX}/Users/.search": search,
        f"POST {SCIM_PREFIX}/.search": search,
    }


def scim_patch(*steps: dict[str, Any]) -> dict[str, Any]:
    return {"schemas": [SCIM_PATCH_SCHEMA], "Operations": list(steps)}


def body_variants() -> dict[str, list[tuple[str, dict[str, Any]]]]:
    filtered = 'emails[type eq "work"].value'
    return {
        "PATCH /v1/admin/users/{id}": [("emails alone", {"emails": [EMAIL]})],
        f"PATCH {SCIM_PREFIX}/Users/{{id}}": [
            ("add emails", scim_patch({"op": "add", "path": "emails", "value": [EMAIL]})),
            ("no path", scim_patch({"op": "replace", "value": {"emails": [EMAIL]}})),
            ("filtered path", scim_patch({"op": "replace", "path": filtered, "value": "x@y.z"})),
            ("remove a name", scim_patch({"op": "remove", "path": "name.givenName"})),
        ],
    }


def query_bases(conversation_id: str, head: str, scim_user: str) -> dict[str, dict[str, str]]:
    yesterday = (dt.datetime.now(dt.UTC) - dt.timedelta(days=1)).isoformat()
    return {
        "GET /v1/admin/conversations/events": {"id": conversation_id, "at_version": "1"},
        "GET /v1/admin/conversations/export": {"conversation_id": conversation_id},
        "GET /v1/admin/conversations/messages": {"id": conversation_id, "min_cursor": head},
        "GET /v1/admin/conversations/turns": {"conversation_id": conversation_id},
        "GET /v1/admin/conversations": {"limit": "10", "offset": "0"},
        "GET /v1/admin/analytics": {"since": yesterday, "bucket": "hour"},
        "GET /v1/admin/users": {"limit": "10", "offset": "0"},
        "GET /v1/admin/audit": {"limit": "10"},
        "GET /v1/events/stream": {"cursor": head},
        "GET /v1/web/stream": {"cursor": head},
        f"GET {SCIM_PREFIX}/Users": {"filter": f'userName eq "{scim_user}"', "count": "5"},
    }


async def issue_scim_token(sweep: Sweep) -> str:
    issued, _ = await call(sweep, "POST", "/v1/admin/scim/token", {"action": "issue"})
    token = str(issued["token"])
    auth = {"Authorization": f"Bearer {token}"}
    async with asyncio.timeout(20):  # until the read model knows the token
        while True:
            url = sweep.svc.url(f"{SCIM_PREFIX}/ServiceProviderConfig")
            async with sweep.http.get(url, headers=auth) as resp:
                if resp.status == 200:
                    return token
            await asyncio.sleep(0.05)


async def settle(svc: Running) -> None:
    """Until every read model has applied everything written so far."""
    head = await svc.app[STORE].head()
    if head:
        assert await svc.app[PROJECTIONS].wait_for(head, 20.0)


async def prepare(sweep: Sweep, ops: list[Operation]) -> None:
    svc = sweep.svc
    other_key, _ = await svc.issue_key(uid("ws-other-"), ALL_SCOPES)
    elsewhere = (
        await new_agent(sweep, other_key),
        (await new_user(sweep, other_key))[0],
        await new_api_key(sweep, other_key),
        (await new_client(sweep, other_key))[0],
    )
    for op in ops:
        for name, foreign in foreign_ids(op, *elsewhere).items():
            sweep.foreign[(op.label, name)] = foreign
        sweep.path_bases[op.label] = await path_bases_for(sweep, op)

    chat = {"model": "svc-offline", "messages": [{"role": "user", "content": "hi"}]}
    _, resp = await call(sweep, "POST", "/v1/chat/completions", chat)
    conversation_id = resp.headers["X-SVC-Conversation-Id"]
    login_user, session_user = (await new_user(sweep))[1], (await new_user(sweep))[1]
    client_id, client_secret = await new_client(sweep)
    sweep.form_base = {
        "grant_type": "client_credentials",
        "client_id": client_id,
        "client_secret": client_secret,
        "scope": "chat",
    }
    sweep.scim_token = await issue_scim_token(sweep)
    scim_user = (await new_user(sweep))[1]
    await settle(svc)
    for op in ops:
        if op.template in SESSION_ROUTES:
            sweep.sessions[op.label] = await new_session(sweep, session_user)
    await start_totp_enrolment(sweep, sweep.sessions["POST /v1/admin/auth/totp/verify"])
    sweep.body_bases = body_bases(login_user, uid("scim-"))
    sweep.body_variants = body_variants()
    head = svc.app[CURSORS].seal(await svc.app[STORE].head())  # as clients are given it
    sweep.query_bases = query_bases(conversation_id, head, scim_user)
    # The client-log route allows 60 requests a minute per address: enough for any browser,
    # too few for a sweep that wants to reach its validation each time.
    svc.app[CLIENT_LOG_LIMITER].per_minute = 1_000_000


def upstream_settings(tmp_path: Path, stub: Any) -> dict[str, str]:
    return {
        "SVC_DATA_DIR": str(tmp_path),
        "SVC_LLM_GATEWAY_URL": stub.base_url,
        "SVC_LLM_MODEL": UPSTREAM_MODEL,
        "SVC_LLM_RETRIES": "1",
        "SVC_LLM_CALL_TIMEOUT_S": "30",
    }


def probe_session() -> aiohttp.ClientSession:
    """No cookie jar (a login probe must not sign the sweep in), CONCURRENCY connections."""
    return aiohttp.ClientSession(
        cookie_jar=aiohttp.DummyCookieJar(), connector=aiohttp.TCPConnector(limit=CONCURRENCY)
    )


# -- the tests --------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def patient_read_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that waits for its read models answers 503 after 5 s: a sweep of thousands of
    requests on a loaded machine must not take such a wait for a fault of its input."""
    monkeypatch.setattr(gateway.identity.service, "APPLY_TIMEOUT_S", 60.0)
    monkeypatch.setattr(gateway.identity.admin, "APPLY_TIMEOUT_S", 60.0)
    monkeypatch.setattr(gateway.admin_common, "READ_YOUR_WRITES_TIMEOUT_S", 60.0)


async def test_hostile_input_gets_a_4xx_never_a_5xx(
    database_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stub = await stub_upstream.StubUpstream(tokens=2).start()
    settings = settings_for(database_url, **upstream_settings(tmp_path, stub))
    try:
        with caplog.at_level(logging.ERROR):
            async with running(settings, extra_routes=()) as svc, probe_session() as http:
                default = svc.app[SETTINGS].default_workspace_id
                key, _ = await svc.issue_key(default, ALL_SCOPES)  # settings need the default
                async with http.get(svc.url("/openapi.json")) as resp:
                    assert resp.status == 200
                    document = await resp.json()
                sweep = Sweep(svc, http, key, document["components"]["schemas"])
                ops = operations(document)
                await prepare(sweep, ops)
                caplog.clear()

                # SCIM first: a valid request to the SCIM token route rotates its token.
                answers = []
                for batch in (
                    [op for op in ops if op.template.startswith(SCIM_PREFIX)],
                    [op for op in ops if not op.template.startswith(SCIM_PREFIX)],
                ):
                    probes = [probe for op in batch for probe in probes_for(sweep, op)]
                    answers += await send_all(http, svc.base, probes)
                await settle(svc)  # whatever the probes wrote, the read models took
                svc.app[READINESS].timeout_s = 30.0  # "ready" however loaded the host
                ready, _, _ = await svc.request("GET", "/readyz")
                records = list(caplog.records)
    finally:
        await stub.stop()

    report = printed_verdict("hostile-input sweep", answers, records, len(ops))
    assert ready == 200, "the service is not ready after the sweep"
    assert not report, report
    assert len(ops) >= MIN_OPERATIONS, f"the document lists {len(ops)} operations"
    assert not (stale := refused_bases(answers)), "\n".join(stale)


# -- SAML, enabled ----------------------------------------------------------------------------

SAML_ROOT = "http://svc.example.test"
"""Plain http: the ACS does not then bind a response to the browser's cookie, so a response
answering a real outstanding request reaches the SAML library without one."""


def idp_metadata(directory: Path) -> str:
    """The metadata of an identity provider that signs with a key of its own."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pysaml2's import-time deprecation warnings
        from saml2 import BINDING_HTTP_REDIRECT
        from saml2.config import IdPConfig
        from saml2.metadata import create_metadata_string

    key, cert = key_and_cert("idp")
    (directory / "idp.key").write_text(key)
    (directory / "idp.crt").write_text(cert)
    config = IdPConfig()
    config.load(
        {
            "entityid": "https://idp.example.test/idp",
            "xmlsec_binary": shutil.which("xmlsec1"),
            "key_file": str(directory / "idp.key"),
            "cert_file": str(directory / "idp.crt"),
            "service": {
                "idp": {
                    "endpoints": {
                        "single_sign_on_service": [
                            ("https://idp.example.test/sso", BINDING_HTTP_REDIRECT)
                        ]
                    }
                }
            },
        }
    )
    return str(create_metadata_string(None, config).decode())


async def outstanding_request(svc: Running, http: aiohttp.ClientSession) -> str:
    """Start a SAML login; the id of the AuthnRequest it sent to the IdP."""
    async with http.get(svc.url("/saml/login?next=/dashboard"), allow_redirects=False) as resp:
        assert resp.status == 302, await resp.text()
        location = resp.headers["Location"]
    encoded = parse_qs(urlsplit(location).query)["SAMLRequest"][0]
    xml = zlib.decompress(base64.b64decode(encoded), -15)
    return str(ElementTree.fromstring(xml).get("ID"))


@pytest.mark.skipif(shutil.which("xmlsec1") is None, reason="xmlsec1 is not installed")
@pytest.mark.filterwarnings("ignore::DeprecationWarning:saml2.*")
async def test_saml_routes_answer_hostile_input_below_500_when_enabled(
    database_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With SAML disabled every SAML route answers 501 whatever it is sent; enabled, the ACS
    parses what it is sent: garbage forms, and hostile SAML responses, some answering a real
    outstanding request so that they reach the SAML library."""
    sp_key, sp_cert = key_and_cert("svc sp")
    saml = {
        "SVC_SAML_ENABLED": "1",
        "SVC_SAML_ROOT_URL": SAML_ROOT,
        "SVC_SAML_IDP_METADATA": idp_metadata(tmp_path),
        "SVC_SAML_SP_CERT": sp_cert,
        "SVC_SAML_DEFAULT_ROLE": "member",
    }
    with caplog.at_level(logging.ERROR):
        async with running(settings_for(database_url, **saml), extra_routes=()) as svc:
            key, _ = await svc.issue_key(svc.app[SETTINGS].default_workspace_id, ALL_SCOPES)
            status, _, _ = await svc.request(
                "PUT", "/v1/admin/identity/secrets/saml/sp_key", key, json={"value": sp_key}
            )
            assert status == 204
            async with probe_session() as http:
                async with http.get(svc.url("/openapi.json")) as resp:
                    ops = [
                        op
                        for op in operations(await resp.json())
                        if op.template.startswith("/saml/")
                    ]
                sweep = Sweep(svc, http, key)
                probes = [p for op in ops for p in probes_for(sweep, op)]
                acs = next(op for op in ops if op.template == "/saml/acs")
                for label, xml in saml_documents("unused"):
                    request_id = await outstanding_request(svc, http)
                    document = xml.replace(
                        b'InResponseTo="unused"', f'InResponseTo="{request_id}"'.encode()
                    )
                    form = urlencode({"SAMLResponse": base64.b64encode(document).decode()})
                    kind = f"form {label}, answering an outstanding request"
                    probes.append(Probe(acs, kind, acs.template, form.encode(), FORM))
                caplog.clear()
                answers = await send_all(http, svc.base, probes)
                records = list(caplog.records)

    report = printed_verdict("SAML sweep", answers, records, len(ops))
    assert not report, report
