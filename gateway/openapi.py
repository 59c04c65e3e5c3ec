"""The OpenAPI 3.1 document, generated from the pydantic models in `schemas/`.

`add_routes` functions describe their routes with `document(...)` (method, path, the request
and response models, the auth and a tag); every registered route without a description still
appears, with the generic error responses. Models become `components/schemas` through
`model_json_schema`, with nested definitions hoisted beside them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from pydantic import BaseModel, Field

TITLE = "SVC service control API"
API_VERSION = "v1.0"
_PARAM = re.compile(r"\{([^}:]+)(?::[^}]*)?\}")
_REF = "#/components/schemas/{model}"


class ErrorBody(BaseModel):
    message: str = Field(description="human-readable")
    type: str | None = Field(default=None, description="e.g. invalid_request_error")
    code: str | None = Field(default=None, description="e.g. unauthorized")


class ErrorEnvelope(BaseModel):
    """The body of every non-2xx response."""

    error: ErrorBody


IDEMPOTENCY_KEY = (
    "Idempotency-Key",
    "your id for this write (1 to 128 letters, digits, '.', '_', ':' or '-'; a quoted "
    "string is read without its quotes): a retry with the same key is never "
    "done twice; it gets the first attempt's outcome or, where that showed a secret once "
    "(a key, a token, a client secret), 409 duplicate_request",
)
"""The request header of every write that records a command (its command id)."""


@dataclass(frozen=True, slots=True)
class RouteDoc:
    method: str
    path: str
    summary: str
    tag: str
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    query: type[BaseModel] | None = None
    auth: str = "bearer"
    response_status: int = 200
    content_type: str = "application/json"
    extra_statuses: tuple[int, ...] = ()
    other_content_types: tuple[str, ...] = ()
    """Other media types of the success response (text/event-stream, text/markdown)."""
    request_headers: tuple[tuple[str, str], ...] = ()
    """(name, description) of the request headers the route reads."""
    response_headers: tuple[tuple[str, str], ...] = ()
    """(name, description) of the headers its success response carries."""
    error: type[BaseModel] | None = None
    """The body of its error responses, when not the service's ErrorEnvelope."""
    form_request: bool = False
    """The request body is application/x-www-form-urlencoded."""
    other_responses: tuple[tuple[int, type[BaseModel]], ...] = ()
    """(status, body) of the route's other successful answers, e.g. a 200 beside its 201."""


@dataclass
class RouteDocs:
    routes: dict[tuple[str, str], RouteDoc] = field(default_factory=dict)
    unserved: set[tuple[str, str]] = field(default_factory=set)
    """Routes that only say their capability is not built (gateway/unbuilt.py): left out
    of the document, which describes what the service does."""

    def add(self, doc: RouteDoc) -> None:
        self.routes[(doc.method.upper(), doc.path)] = doc


REGISTRY = RouteDocs()
"""Process-wide: route descriptions are static facts about the code, like the routes."""


def document(
    method: str,
    path: str,
    *,
    summary: str,
    tag: str,
    request: type[BaseModel] | None = None,
    response: type[BaseModel] | None = None,
    query: type[BaseModel] | None = None,
    auth: str = "bearer",
    response_status: int = 200,
    content_type: str = "application/json",
    extra_statuses: tuple[int, ...] = (),
    other_content_types: tuple[str, ...] = (),
    request_headers: tuple[tuple[str, str], ...] = (),
    response_headers: tuple[tuple[str, str], ...] = (),
    error: type[BaseModel] | None = None,
    form_request: bool = False,
    other_responses: tuple[tuple[int, type[BaseModel]], ...] = (),
) -> None:
    """Describe one route for the OpenAPI document. `auth`: "bearer" or "none"."""
    REGISTRY.add(
        RouteDoc(
            method.upper(),
            path,
            summary,
            tag,
            request,
            response,
            query,
            auth,
            response_status,
            content_type,
            extra_statuses,
            other_content_types,
            request_headers,
            response_headers,
            error,
            form_request,
            other_responses,
        )
    )


class _Components:
    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {"ErrorEnvelope": {}}
        self.add(ErrorEnvelope)

    def add(self, model: type[BaseModel]) -> dict[str, str]:
        name = model.__name__
        schema = model.model_json_schema(ref_template=_REF)
        for def_name, definition in schema.pop("$defs", {}).items():
            self.schemas.setdefault(def_name, definition)
        self.schemas[name] = schema
        return {"$ref": _REF.format(model=name)}


_EXTRA_STATUSES = {
    408: "the request body did not arrive in time",
    409: "conflict",
    413: "request body too large",
    429: "too many requests",
    501: "feature disabled (its setting is off)",
    502: "the upstream model server failed",
    503: "unavailable for now (retry shortly)",
    504: "the upstream model call timed out",
}


def _error_responses(doc: RouteDoc | None, comps: _Components) -> dict[str, Any]:
    schema = (
        comps.add(doc.error)
        if doc is not None and doc.error is not None
        else {"$ref": _REF.format(model="ErrorEnvelope")}
    )
    # An error of its own shape comes in the route's own media type (SCIM's errors are
    # application/scim+json); the service's envelope is always application/json.
    media = doc.content_type if doc is not None and doc.error is not None else "application/json"
    ref = {"content": {media: {"schema": schema}}}
    statuses = {400: "invalid request", 404: "not found", 500: "internal error"}
    if doc is None or doc.auth != "none":
        statuses.update({401: "missing or invalid API key", 403: "insufficient scope"})
        statuses[429] = "rate limit exceeded (per-key rate_limit_rpm)"
        # Credentials are looked up in the database: any authenticated route may meet it down.
        statuses[503] = _EXTRA_STATUSES[503]
    if doc is not None and (doc.request is not None or doc.form_request):
        statuses[413] = _EXTRA_STATUSES[413]  # past SVC_MAX_BODY_BYTES
        statuses[408] = _EXTRA_STATUSES[408]  # past gateway.errors.BODY_DEADLINE_S
    for status in doc.extra_statuses if doc else ():
        statuses.setdefault(status, _EXTRA_STATUSES.get(status, "error"))
    # A route's own error shape is its handler's refusals; a failure of the service (5xx)
    # is the envelope whatever the route, as gateway.errors answers it.
    envelope = {
        "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorEnvelope")}}}
    }
    return {
        str(s): {"description": d, **(envelope if s >= 500 else ref)}
        for s, d in sorted(statuses.items())
    }


def _query_parameters(model: type[BaseModel]) -> list[dict[str, Any]]:
    schema = model.model_json_schema(ref_template=_REF)  # by alias: the names on the wire
    required = set(schema.get("required", []))
    return [
        _query_parameter(name, prop, name in required)
        for name, prop in schema.get("properties", {}).items()
    ]


def _query_parameter(name: str, prop: dict[str, Any], required: bool) -> dict[str, Any]:
    param: dict[str, Any] = {"name": name, "in": "query", "required": required, "schema": prop}
    if "description" in prop:
        param["description"] = prop["description"]
    if prop.get("type") == "array":
        # A list is the parameter repeated (?types=a&types=b), not one comma-joined value.
        param |= {"style": "form", "explode": True}
    return param


def _operation(method: str, path: str, doc: RouteDoc | None, comps: _Components) -> dict[str, Any]:
    op: dict[str, Any] = {
        "operationId": f"{method.lower()}_{re.sub(r'[^A-Za-z0-9]+', '_', path).strip('_')}",
        "summary": doc.summary if doc else f"{method} {path}",
        "tags": [doc.tag if doc else "Other"],
    }
    params = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in _PARAM.findall(path)
    ]
    if doc and doc.query:
        params.extend(_query_parameters(doc.query))
    for name, text in doc.request_headers if doc else ():
        params.append(
            {"name": name, "in": "header", "required": False, "description": text,
             "schema": {"type": "string"}}
        )  # fmt: skip
    if params:
        op["parameters"] = params
    if doc and doc.request:
        schema = comps.add(doc.request)
        media = "application/x-www-form-urlencoded" if doc.form_request else _json_media(doc)
        op["requestBody"] = {"required": True, "content": {media: {"schema": schema}}}
    ok: dict[str, Any] = {"description": "success"}
    if doc and doc.response_status == 204:
        pass  # no content
    elif doc and doc.response:
        ok["content"] = {doc.content_type: {"schema": comps.add(doc.response)}}
    elif doc and doc.content_type != "application/json":
        kind = "object" if doc.content_type.endswith("json") else "string"
        ok["content"] = {doc.content_type: {"schema": {"type": kind}}}
    for media in doc.other_content_types if doc else ():
        ok.setdefault("content", {})[media] = {"schema": {"type": "string"}}
    if doc and doc.response_headers:
        ok["headers"] = {
            name: {"description": text, "schema": {"type": "string"}}
            for name, text in doc.response_headers
        }
    op["responses"] = {
        str(doc.response_status if doc else 200): ok,
        **{
            str(status): {
                "description": "success",
                "content": {"application/json": {"schema": comps.add(model)}},
            }
            for status, model in (doc.other_responses if doc else ())
        },
        **_error_responses(doc, comps),
    }
    if doc is None or doc.auth != "none":
        op["security"] = [{"bearerAuth": []}]
    else:
        op["security"] = []
    return op


def _json_media(doc: RouteDoc) -> str:
    """A JSON request body's media type: the route's own when it is a JSON one (SCIM's)."""
    return doc.content_type if doc.content_type.endswith("json") else "application/json"


def _app_routes(app: web.Application) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    for route in app.router.routes():
        method = route.method.upper()
        info = route.get_info()
        path = info.get("path") or info.get("formatter") or info.get("prefix")
        if method in ("HEAD", "OPTIONS", "*") or not path:
            continue
        if (method, str(path)) in REGISTRY.unserved:
            continue
        if (method, path) not in seen:
            seen.append((method, str(path)))
    return seen


def build_document(app: web.Application, version: str) -> dict[str, Any]:
    comps = _Components()
    paths: dict[str, dict[str, Any]] = {}
    for method, path in sorted(_app_routes(app), key=lambda mp: (mp[1], mp[0])):
        doc = REGISTRY.routes.get((method, path))
        paths.setdefault(_PARAM.sub(r"{\1}", path), {})[method.lower()] = _operation(
            method, path, doc, comps
        )
    return {
        "openapi": "3.1.0",
        "info": {
            "title": TITLE,
            "version": API_VERSION,
            "description": f"Build {version}. Errors use the envelope ErrorEnvelope.",
        },
        "servers": [{"url": "/"}],
        "paths": paths,
        "components": {
            "schemas": dict(sorted(comps.schemas.items())),
            "securitySchemes": {
                "bearerAuth": {"type": "http", "scheme": "bearer", "description": "API key"}
            },
        },
    }
