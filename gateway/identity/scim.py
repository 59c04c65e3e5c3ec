"""SCIM 2.0 service provider (RFC 7643 / RFC 7644) under /scim/v2: Users only.

Authentication: the workspace's SCIM bearer token (issued, rotated, revoked at
POST /v1/admin/scim/token); only its sha256 is stored. Every client error (4xx) is a SCIM error
document (`urn:ietf:params:scim:api:messages:2.0:Error`, `status` as a string, `scimType` where
RFC 7644 section 3.12 defines one) with `application/scim+json`, never the service's envelope.
A server failure (5xx) is left to the gateway's error middleware, as everywhere else: a 500
answers only an id (`internal error (id svc-...)`) that is logged with the traceback, so no
database detail reaches the client. (A NUL in the URL is refused by that middleware too, with
the service's envelope: it runs before any SCIM handler.)

Supported: create, read, replace (PUT), PATCH (add/replace/remove on the core attributes, with
or without a path, operation names case-insensitive; email value filters; the User schema's
attributes this service does not keep left alone, as a POST leaves them), delete; list with
`filter` (`eq` on userName (case-insensitive), externalId or id), `startIndex` (1-based) and
`count`.
Deleting a user, or setting `active` to false, ends their sessions at once; the user's
principals are refused from then on (authn.py checks the user on every request).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web
from pydantic import BaseModel, Field, ValidationError

from actors.identity import directory_key
from gateway.auth import authorization_header, hash_key
from gateway.errors import count_error, read_json, validation_problems
from gateway.identity.admin import (
    cut_off,
    deprovision,
    finish_cut_off_before_reactivating,
    revoke_sessions,
    set_password,
)
from gateway.identity.common import (
    DIRECTORY_SOURCES,
    SCIM_ACTOR,
    actor_of,
    first_unshown,
    new_id,
    now,
    profile_of,
    retried_if_changed,
    storable,
)
from gateway.identity.passwords import BLANK, MAX_LENGTH, MIN_LENGTH, is_blank
from gateway.identity.service import Identity, identity
from projections.identity_queries import UserRow, find_scim_token, get_user, list_users
from schemas.errors import Conflict, InvalidInput, SvcError, Unauthorized, quoted
from schemas.identity import MAX_EMAILS, SIGNS_IN_ELSEWHERE, ProvisionUser, UpdateUser, UserProfile

PREFIX = "/scim/v2"
USER_SCHEMA = "urn:ietf:params:scim:schemas:core:2.0:User"
LIST_SCHEMA = "urn:ietf:params:scim:api:messages:2.0:ListResponse"
ERROR_SCHEMA = "urn:ietf:params:scim:api:messages:2.0:Error"
PATCH_SCHEMA = "urn:ietf:params:scim:api:messages:2.0:PatchOp"
SPC_SCHEMA = "urn:ietf:params:scim:schemas:core:2.0:ServiceProviderConfig"
RT_SCHEMA = "urn:ietf:params:scim:schemas:core:2.0:ResourceType"
SCHEMA_SCHEMA = "urn:ietf:params:scim:schemas:core:2.0:Schema"
CONTENT_TYPE = "application/scim+json"
MAX_COUNT = 200
DEFAULT_COUNT = 100
MAX_START_INDEX = 2**53 - 1
"""The largest startIndex passed on. A larger one is clamped to it, not refused (see _paging):
it is past any result a workspace can hold, fits PostgreSQL's bigint OFFSET, and is exactly
representable in every JSON parser (RFC 8259 section 6), since the response echoes it."""
MAX_PATCH_OPERATIONS = 1000
"""Identity providers send a handful; a bound keeps one request's work (each operation is
applied in turn) from holding the event loop."""

# `attr eq "value"`; the attribute may be qualified by the core User schema's URN (RFC 7644
# section 3.10), and the value is a JSON string (RFC 7644 section 3.4.2.2), escapes included.
_FILTER = re.compile(r'^\s*([\w:.]+)\s+eq\s+("(?:[^"\\]|\\.)*")\s*$', re.IGNORECASE)

ScimHandler = Callable[[web.Request, Identity, str], Awaitable[web.StreamResponse]]


class ScimError(Exception):
    def __init__(
        self,
        status: int,
        detail: str,
        scim_type: str | None = None,
        *,
        invalid_token: bool = False,
    ) -> None:
        """`invalid_token`: a 401 for a token sent and not good (RFC 6750 section 3), which
        tells a client to get a new one rather than to send one."""
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.scim_type = scim_type
        self.invalid_token = invalid_token


def scim_json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status, body=orjson.dumps(body), content_type=CONTENT_TYPE, headers=headers
    )


def _error(
    status: int, detail: str, scim_type: str | None, *, invalid_token: bool = False
) -> web.Response:
    body: dict[str, Any] = {"schemas": [ERROR_SCHEMA], "status": str(status), "detail": detail}
    if scim_type:
        body["scimType"] = scim_type
    response = scim_json(body, status)
    count_error(status)
    if status == 401:  # RFC 6750 section 3: how to authenticate
        challenge = 'Bearer realm="scim"'
        response.headers["WWW-Authenticate"] = (
            f'{challenge}, error="invalid_token"' if invalid_token else challenge
        )
    return response


def _from_svc(exc: SvcError) -> web.Response:
    scim_type = None
    if isinstance(exc, Conflict) and exc.code == "uniqueness":
        scim_type = "uniqueness"
    elif isinstance(exc, InvalidInput):
        scim_type = "invalidValue"
    return _error(exc.http_status, exc.message, scim_type)


def _scim_authorization(request: web.Request) -> str:
    """The one Authorization header: of two, which token was meant is not guessed (401)."""
    try:
        return authorization_header(request)
    except Unauthorized:
        raise ScimError(401, "send one Authorization header: Bearer <SCIM token>") from None


async def _workspace_of(request: web.Request, ident: Identity) -> str:
    header = _scim_authorization(request)
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ScimError(401, "a SCIM bearer token is required")
    found = await find_scim_token(ident.db, hash_key(token.strip()))
    if found is None or found.revoked_at is not None:
        raise ScimError(401, "invalid SCIM token", invalid_token=True)
    request[SCIM_ACTOR] = f"scim:{found.token_id}"
    return found.workspace_id


def scim_route(handler: ScimHandler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def run(request: web.Request) -> web.StreamResponse:
        ident = identity(request)
        try:
            workspace_id = await _workspace_of(request, ident)
            return await handler(request, ident, workspace_id)
        except ScimError as exc:
            return _error(exc.status, exc.detail, exc.scim_type, invalid_token=exc.invalid_token)
        except Unauthorized as exc:
            return _error(401, exc.message, None)
        except SvcError as exc:
            if exc.http_status >= 500:
                # A server failure (a store query that failed, say): its message may carry
                # database detail or parameter values, so it never becomes a SCIM `detail`;
                # the error middleware logs it and answers the opaque id.
                raise
            return _from_svc(exc)
        except ValidationError as exc:
            problems = validation_problems(exc, whole="body", names=_SCIM_NAMES)
            return _error(400, f"invalid value: {problems}", "invalidValue")

    return run


# --- representation ---------------------------------------------------------------------------


def _location(request: web.Request, user_id: str) -> str:
    return f"{request.scheme}://{request.host}{PREFIX}/Users/{user_id}"


def resource(request: web.Request, user: UserRow) -> dict[str, Any]:
    name = {
        k: v for k, v in (("givenName", user.given_name), ("familyName", user.family_name)) if v
    }
    out: dict[str, Any] = {
        "schemas": [USER_SCHEMA],
        "id": user.user_id,
        "userName": user.user_name,
        "meta": {
            "resourceType": "User",
            "created": user.created_at.isoformat(),
            "lastModified": user.updated_at.isoformat(),
            "location": _location(request, user.user_id),
            # No `version`: RFC 7643 3.1 makes it the ETag, which this service does not send
            # or honour (ServiceProviderConfig says etag unsupported); an If-Match sent with
            # it was ignored.
        },
    }
    if user.active is not None:
        out["active"] = user.active
    if name:
        out["name"] = name
    if user.display_name:
        out["displayName"] = user.display_name
    if user.external_id:
        out["externalId"] = user.external_id
    if user.emails:
        out["emails"] = user.emails
    return out


def _attr_name(name: str) -> str:
    """`urn:...:User:name.givenName` -> `name.givenname`: SCIM names are case-insensitive."""
    lowered = name.lower()
    prefix = USER_SCHEMA.lower() + ":"
    return lowered[len(prefix) :] if lowered.startswith(prefix) else lowered


_ALWAYS = frozenset({"id", "schemas"})


MAX_ATTRIBUTE_NAMES = 100
"""Distinct names an `attributes` or `excludedAttributes` list may hold: each is checked
against every returned resource, and a 4 MiB body holds hundreds of thousands of names,
which stalled the event loop for minutes. The User schema has a few dozen."""


def _names(raw: Any) -> list[str]:
    if isinstance(raw, str):
        raw = raw.split(",")
    if not isinstance(raw, list):
        return []
    names = list(dict.fromkeys(_attr_name(str(a).strip()) for a in raw if str(a).strip()))
    if len(names) > MAX_ATTRIBUTE_NAMES:
        raise ScimError(
            400,
            f"attributes and excludedAttributes name at most {MAX_ATTRIBUTE_NAMES} distinct "
            f"attributes each; this names {len(names):,}",
            "invalidValue",
        )
    return names


def project(res: dict[str, Any], attributes: list[str], excluded: list[str]) -> dict[str, Any]:
    """RFC 7644 section 3.9: `attributes` keeps only those (and the always-returned ones),
    `excludedAttributes` drops those; both accept `parent.sub` names, which apply to a
    complex attribute and to each value of a multi-valued one (`emails.value`)."""
    if attributes:
        tops = {a.split(".", 1)[0] for a in attributes}
        out = {k: v for k, v in res.items() if k.lower() in _ALWAYS or k.lower() in tops}
        for k, v in list(out.items()):
            subs = {a.split(".", 1)[1] for a in attributes if a.startswith(k.lower() + ".")}
            if subs and k.lower() not in attributes:
                out[k] = _sub_attributes(v, subs, keep=True)
        return out
    out = {k: v for k, v in res.items() if k.lower() in _ALWAYS or k.lower() not in excluded}
    for name in excluded:
        top, _, sub = name.partition(".")
        for k, v in list(out.items()):
            if sub and k.lower() == top:
                out[k] = _sub_attributes(v, {sub}, keep=False)
    return out


def _sub_attributes(value: Any, names: set[str], *, keep: bool) -> Any:
    """A complex value, or each value of a multi-valued attribute, with only the (lower-cased)
    sub-attributes `names` (`keep`) or without them."""
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if (k.lower() in names) == keep}
    if isinstance(value, list):
        return [_sub_attributes(item, names, keep=keep) for item in value]
    return value


class ScimReadQuery(BaseModel):
    """The query of a SCIM read, for the OpenAPI document: parsed as RFC 7644 reads it
    (`_projection`), never refused for its form."""

    attributes: str | None = Field(
        default=None, description="comma-separated attributes to return (and the id, always)"
    )
    excludedAttributes: str | None = Field(
        default=None, description="comma-separated attributes to leave out"
    )


class ScimListQuery(ScimReadQuery):
    """The query of a SCIM list (`_search`, `_paging`): lenient, as RFC 7644 3.4.2.4 asks."""

    filter: str | None = Field(
        default=None, description='userName eq "...", externalId eq "..." or id eq "..."'
    )
    startIndex: int = Field(
        default=1, description=f"1-based; below 1 reads as 1, beyond {MAX_START_INDEX} as it"
    )
    count: int = Field(
        default=DEFAULT_COUNT, description=f"page size; negative reads as 0, at most {MAX_COUNT}"
    )


def _projection(source: Any) -> tuple[list[str], list[str]]:
    params = _message_keys(source)
    return _names(params.get("attributes")), _names(params.get("excludedattributes"))


def _message_keys(source: Any) -> dict[str, Any]:
    """A query string's parameters or a SCIM message's members (a SearchRequest, a PatchOp,
    an operation) by lower-cased name: RFC 7643 section 2.1 makes attribute names
    case-insensitive, and a `Filter` read as no filter answered with every user."""
    out: dict[str, Any] = {}
    for key, value in source.items():
        out.setdefault(str(key).lower(), value)  # a query's first value, as .get gives
    return out


def _lower_keys(data: dict[str, Any]) -> dict[str, Any]:
    return {_attr_name(k): v for k, v in data.items()}


def _as_bool(value: Any, name: str = "active") -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ScimError(400, f"{name} must be a boolean", "invalidValue")


def _emails(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise ScimError(400, "emails must be an array", "invalidValue")
    _check_email_count(len(value))
    out = []
    for item in value:
        # Sub-attribute names are case-insensitive too (RFC 7643 section 2.1).
        item = _lower_keys(item) if isinstance(item, dict) else item
        if not isinstance(item, dict) or not isinstance(item.get("value"), str):
            raise ScimError(400, "each email needs a string value", "invalidValue")
        primary = _as_bool(item.get("primary"), "emails.primary")
        entry: dict[str, Any] = {"value": item["value"], "primary": bool(primary)}
        if isinstance(item.get("type"), str):
            entry["type"] = item["type"]
        out.append(entry)
    if sum(1 for entry in out if entry["primary"]) > 1:
        # RFC 7643 section 2.4: a primary value of true appears no more than once.
        raise ScimError(400, "at most one email may be primary", "invalidValue")
    return out


def _check_email_count(count: int) -> None:
    if count > MAX_EMAILS:
        raise ScimError(
            400, f"a user has at most {MAX_EMAILS} emails; this gives {count:,}", "invalidValue"
        )


_SCIM_NAMES = {
    "user_name": "userName",
    "display_name": "displayName",
    "given_name": "name.givenName",
    "family_name": "name.familyName",
    "external_id": "externalId",
}
"""UserProfile's fields as SCIM names them, for the messages that name them."""


def _check_shown(fields: dict[str, Any], kept: Mapping[str, Any]) -> dict[str, Any]:
    """`fields` with names and addresses a listing can show as given, as the admin API takes
    them (`first_unshown`; `kept`, the profile they change)."""
    problem = first_unshown(fields, kept)
    if problem is not None:
        named = (
            _SCIM_NAMES[problem.field]
            if problem.index is None
            else f"emails[{problem.index}].value"
        )
        raise ScimError(400, f"{named} {problem.reason}", "invalidValue")
    return fields


def _profile_fields(data: dict[str, Any], *, partial: bool = False) -> dict[str, Any]:
    """SCIM attributes (any case) -> UserProfile fields, for the attributes present. A `name`
    states both its parts (POST, PUT) unless `partial` (a PATCH add or replace, RFC 7644
    3.5.2.3: sub-attributes the value leaves out stay as they are)."""
    d = _lower_keys(data)
    out: dict[str, Any] = {}
    if "username" in d:
        out["user_name"] = d["username"]
    if "displayname" in d:
        out["display_name"] = d["displayname"]
    if "externalid" in d:
        out["external_id"] = d["externalid"]
    if "active" in d:
        out["active"] = _as_bool(d["active"])
    if "emails" in d:
        out["emails"] = _emails(d["emails"]) if d["emails"] is not None else []
    if "name" in d:
        if d["name"] is not None and not isinstance(d["name"], dict):
            raise ScimError(400, "name must be an object (givenName, familyName)", "invalidValue")
        name = _lower_keys(d["name"]) if isinstance(d["name"], dict) else {}
        for part, field in (("givenname", "given_name"), ("familyname", "family_name")):
            # null is unassigned (RFC 7643 section 2.5): both parts go.
            if part in name or not partial or d["name"] is None:
                out[field] = name.get(part)
    for dotted, field in (("name.givenname", "given_name"), ("name.familyname", "family_name")):
        if dotted in d:
            out[field] = d[dotted]
    return out


async def _json_object(request: web.Request) -> dict[str, Any]:
    """The body, a JSON object. read_json refuses a NUL in any string or key (PostgreSQL text
    cannot hold one, so no SCIM value with a NUL ever reaches the store): invalidValue; and an
    empty, malformed or too deeply nested body: invalidSyntax."""
    if request.content_type not in _JSON_TYPES:
        # RFC 7644 section 3.1: a client states application/scim+json (or JSON). A form
        # (curl -d's default) or text was read as JSON all the same.
        raise ScimError(
            415,
            f"the body must be sent as {CONTENT_TYPE} (or application/json), not "
            f"{request.content_type}",
        )
    try:
        data = await read_json(request)
    except InvalidInput as exc:
        scim_type = "invalidValue" if exc.code == "invalid_character" else "invalidSyntax"
        raise ScimError(400, exc.message, scim_type) from None
    if not isinstance(data, dict):
        raise ScimError(400, "the body must be a JSON object", "invalidSyntax")
    return data


_JSON_TYPES = frozenset({CONTENT_TYPE, "application/json"})


def _user_body(data: dict[str, Any]) -> dict[str, Any]:
    """A POST's or a PUT's body: a User resource, by its `schemas` (RFC 7643 section 3:
    required). One naming another resource (a Group) was created as a user."""
    schemas = _message_keys(data).get("schemas")
    if not isinstance(schemas, list) or not any(
        isinstance(name, str) and name.lower() == USER_SCHEMA.lower() for name in schemas
    ):
        raise ScimError(400, f"schemas must be an array holding {USER_SCHEMA}", "invalidSyntax")
    return data


async def _user(ident: Identity, workspace_id: str, user_id: str) -> UserRow:
    user = await get_user(ident.db, workspace_id, user_id)
    if user is None or user.deleted:
        raise ScimError(404, f"User {user_id} not found")
    return user


async def _writable_user(ident: Identity, workspace_id: str, user_id: str) -> UserRow:
    """A user SCIM may change. Not an owner: a SCIM token (which write on `security` issues)
    could otherwise set an owner's password or external id and sign in as them, or remove
    the last owner; owners are managed through the admin API, where only an owner may."""
    user = await _user(ident, workspace_id, user_id)
    if "owner" in user.roles:
        raise ScimError(403, "an owner cannot be changed through SCIM; use the admin API")
    return user


# --- users ------------------------------------------------------------------------------------


def _integer(params: Any, name: str, default: int, *, shown: str | None = None) -> int:
    """A paging parameter: a query-string numeral or a JSON integer (orjson reads an integer
    beyond 64 bits as a float, so an integral float counts as one). Absent or null is the
    default (RFC 7643 section 2.5: null means unassigned); anything else is a 400, naming
    it as `shown` (its spelling in the RFC)."""
    raw = params.get(name)
    if raw is None:
        return default
    if isinstance(raw, float) and raw.is_integer():
        return int(raw)
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, str):
        try:
            return int(raw)
        except ValueError:
            pass
    raise ScimError(400, f"{shown or name} must be an integer", "invalidValue")


def _paging(params: Any) -> tuple[int, int]:
    """startIndex and count, clamped, never refused for their size: RFC 7644 section 3.4.2.4
    reads a startIndex below 1 as 1 and a negative count as 0, and lets the server return fewer
    results than count, so clients expect leniency. A startIndex past the end (up to
    MAX_START_INDEX) is an empty page with the true totalResults; count is at most MAX_COUNT.
    Both bounds keep OFFSET and LIMIT within PostgreSQL's bigint."""
    params = _message_keys(params)
    start = _integer(params, "startindex", 1, shown="startIndex")
    count = _integer(params, "count", DEFAULT_COUNT)
    return min(MAX_START_INDEX, max(1, start)), min(MAX_COUNT, max(0, count))


async def _filtered(
    ident: Identity, workspace_id: str, raw: str, start: int, count: int
) -> tuple[list[UserRow], int]:
    match = _FILTER.match(raw)
    if match is None:
        raise ScimError(400, "only 'attribute eq \"value\"' filters are supported", "invalidFilter")
    attr = _attr_name(match.group(1))
    try:
        value = json.loads(match.group(2))
    except ValueError:
        raise ScimError(
            400, "the filter's value is not a valid JSON string", "invalidFilter"
        ) from None
    if not storable(value):
        raise ScimError(
            400,
            "the filter's value holds a character no stored value can (a NUL, \\u0000, or "
            "half of a surrogate pair such as \\ud800 alone): no user matches it; remove it",
            "invalidValue",
        )
    if attr == "username":
        return await list_users(
            ident.db, workspace_id, user_name=value, offset=start - 1, limit=count
        )
    if attr in ("externalid", "id"):
        wanted = {"external_id" if attr == "externalid" else "user_id": value}
        return await list_users(ident.db, workspace_id, **wanted, offset=start - 1, limit=count)
    raise ScimError(400, f"filtering on {match.group(1)} is not supported", "invalidFilter")


async def _search(
    request: web.Request, ident: Identity, ws: str, params: Any
) -> web.StreamResponse:
    start, count = _paging(params)
    raw = str(_message_keys(params).get("filter") or "").strip()
    if raw:
        users, total = await _filtered(ident, ws, raw, start, count)
    else:
        users, total = await list_users(ident.db, ws, offset=start - 1, limit=count)
    attributes, excluded = _projection(params)
    return scim_json(
        {
            "schemas": [LIST_SCHEMA],
            "totalResults": total,
            "startIndex": start,
            "itemsPerPage": len(users),
            "Resources": [project(resource(request, u), attributes, excluded) for u in users],
        }
    )


async def list_handler(request: web.Request, ident: Identity, ws: str) -> web.StreamResponse:
    return await _search(request, ident, ws, request.query)


async def search_handler(request: web.Request, ident: Identity, ws: str) -> web.StreamResponse:
    """POST /Users/.search (RFC 7644 section 3.4.3): the query in a SearchRequest body."""
    body = await _json_object(request)
    return await _search(request, ident, ws, body)


def _full_profile(data: dict[str, Any], kept: Mapping[str, Any]) -> UserProfile:
    """The profile a POST or PUT body states in full (userName required); `kept`, the
    profile it replaces (empty for a new user)."""
    fields = _check_shown(_profile_fields(_user_body(data)), kept)
    if fields.get("user_name") is None:
        raise ScimError(400, "userName is required", "invalidValue")
    if not isinstance(fields["user_name"], str) or not fields["user_name"]:
        raise ScimError(400, "userName must be a non-empty string", "invalidValue")
    return UserProfile.model_validate(fields)


def _password(value: Any) -> str:
    """A password SCIM sets, under the admin API's rules: MIN_LENGTH to MAX_LENGTH characters
    (a NUL is already refused with the body). Checked before anything is written, so a refused
    password leaves the user as it was."""
    if not isinstance(value, str) or not MIN_LENGTH <= len(value) <= MAX_LENGTH:
        raise ScimError(
            400,
            f"password must be a string of {MIN_LENGTH} to {MAX_LENGTH} characters",
            "invalidValue",
        )
    if is_blank(value):
        raise ScimError(400, f"password {BLANK}", "invalidValue")
    return value


def _password_in(data: dict[str, Any]) -> str | None:
    raw = _lower_keys(data).get("password")
    return None if raw is None else _password(raw)


async def create_handler(request: web.Request, ident: Identity, ws: str) -> web.StreamResponse:
    data = await _json_object(request)
    profile = _full_profile(data, {})
    password = _password_in(data)
    user_id = new_id("usr_")
    await ident.ask(
        directory_key(ws),
        ProvisionUser(
            by=actor_of(request),
            command_id=new_id("scim-"),
            workspace_id=ws,
            user_id=user_id,
            profile=profile,
            source="scim",
            at=now(),
        ),
    )
    if password is not None:
        await set_password(request, ident, ws, user_id, password)
    user = await _user(ident, ws, user_id)
    body = resource(request, user)
    return scim_json(body, 201, {"Location": body["meta"]["location"]})


async def get_handler(request: web.Request, ident: Identity, ws: str) -> web.StreamResponse:
    user = await _user(ident, ws, request.match_info["id"])
    attributes, excluded = _projection(request.query)
    return scim_json(project(resource(request, user), attributes, excluded))


Change = Callable[[UserRow], Awaitable[tuple[UserProfile, str | None]]]
"""A PUT's or a PATCH's new profile (and password, if it sets one) for the user as read."""


async def _save(
    request: web.Request, ident: Identity, ws: str, change: Change
) -> web.StreamResponse:
    """Read the user, make its profile with `change` and write it: again from a fresh read
    when another change to the user landed in between (two PATCHes at once: the later one,
    written whole from its older read, undid a deactivation). Then the password, and a user
    who ends up inactive is cut off, also when it already was (a retried deactivation whose
    first try failed after its write must still revoke the user's keys)."""

    async def attempt() -> tuple[UserProfile, str | None]:
        user = await _writable_user(ident, ws, request.match_info["id"])
        profile, password = await change(user)
        await finish_cut_off_before_reactivating(request, ident, user, profile.active)
        await _write(request, ident, ws, user, profile, password)
        return profile, password

    profile, password = await retried_if_changed(ident, attempt)
    user_id = request.match_info["id"]
    if password is not None:
        await set_password(request, ident, ws, user_id, password)
        await revoke_sessions(ident, ws, user_id, "password changed", actor_of(request))
    if profile.active is False:
        await cut_off(request, ident, ws, user_id, "deactivated by SCIM")
    return scim_json(resource(request, await _user(ident, ws, user_id)))


async def _write(
    request: web.Request,
    ident: Identity,
    ws: str,
    user: UserRow,
    profile: UserProfile,
    password: str | None,
) -> None:
    """The profile first: a change refused (a name taken) must leave the password as it was.
    A new password ends the user's sessions, as the admin API's does; an account that signs
    in elsewhere (LDAP, SAML) takes none, and nothing changes. (The admin API also refuses a
    password to SCIM's own accounts while SAML is on; the IdP may still send one here.)"""
    matched = (profile.user_name, profile.external_id) != (user.user_name, user.external_id)
    if user.source in DIRECTORY_SOURCES and matched:
        # The account's sign-in finds it by these: renamed onto another entry or subject, it
        # (its sessions, its keys) would receive that one's roles (the admin API refuses the
        # same). SCIM's own accounts are the IdP's to rename.
        raise ScimError(
            400,
            f"userName and externalId of user {user.user_id} are {user.source}'s: change them "
            "there (nothing was changed)",
            "mutability",
        )
    if password is not None and user.source in SIGNS_IN_ELSEWHERE:
        raise ScimError(
            409,
            f"user {user.user_id} signs in through {user.source}, which keeps its password; "
            "change it there (nothing was changed)",
            None,
        )
    await ident.ask(
        directory_key(ws),
        UpdateUser(
            by=actor_of(request),
            command_id=new_id("scim-"),
            workspace_id=ws,
            user_id=user.user_id,
            profile=profile,
            at=now(),
            base=profile_of(user),
        ),
    )


async def put_handler(request: web.Request, ident: Identity, ws: str) -> web.StreamResponse:
    async def change(user: UserRow) -> tuple[UserProfile, str | None]:
        data = await _json_object(request)
        profile = _full_profile(data, profile_of(user).model_dump())
        if _lower_keys(data).get("active") is None:
            # Not asserted, absent or null (RFC 7643 section 2.5 makes them one; RFC 7644
            # section 3.5.1 lets the server keep it): a PUT of the other attributes must
            # not bring a deactivated user back.
            profile = profile.model_copy(update={"active": user.active})
        return profile, _password_in(data)

    return await _save(request, ident, ws, change)


def _take_password(op: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """Split a write-only password out of a PATCH operation (it goes to the vault)."""
    path, value = op.get("path"), op.get("value")
    kind = str(op.get("op", "")).lower()
    if isinstance(path, str) and _attr_name(path) == "password":
        if kind == "remove":
            # No password is never a state a user returns to here: a 200 would claim the
            # old one no longer signs in, which it still would.
            raise ScimError(
                400,
                "a password cannot be removed, only replaced; to stop the account signing "
                "in set active to false",
                "mutability",
            )
        return {}, _password(value)
    if not path and isinstance(value, dict):
        rest = {k: v for k, v in value.items() if _attr_name(k) != "password"}
        found = [v for k, v in value.items() if _attr_name(k) == "password"]
        return {**op, "value": rest}, (_password(found[0]) if found else None)
    return op, None


def _read_only(path: str) -> bool:
    """The attributes the service sets itself (RFC 7643: `id` and `meta` are readOnly)."""
    lowered = path.strip().lower()
    return lowered in ("id", "meta", "groups") or lowered.startswith("meta.")


def _apply_op(current: dict[str, Any], op: dict[str, Any]) -> dict[str, Any]:
    if not op:
        return current
    kind = str(op.get("op", "")).lower()
    path = op.get("path")
    value = op.get("value")
    if kind not in ("add", "replace", "remove"):
        raise ScimError(400, f"unsupported PATCH op {quoted(str(op.get('op')))}", "invalidSyntax")
    if isinstance(path, str) and _read_only(path):
        raise ScimError(400, f"{path} is read-only", "mutability")
    if isinstance(path, str) and _not_kept(path):
        # As a POST leaves them: an IdP's default mappings send these on every sync, and a
        # refusal failed each update of the user (title, phoneNumbers, the enterprise
        # extension's department). The User schema served shows what is kept.
        return current
    if kind != "remove" and "value" not in op:
        # RFC 7644 3.5.2.1 and 3.5.2.3: add and replace carry a value. Read as null (which
        # RFC 7643 2.5 makes unassigned, as a remove does), a replace of `active` without
        # one, a client's mistake, re-enabled a deactivated user.
        raise ScimError(400, f"a PATCH {kind} needs a value", "invalidValue")
    if isinstance(path, str) and _EMAIL_FILTER.match(path.strip()):
        return _email_filter_op(current, kind, path.strip(), value)
    if kind == "remove":
        if not isinstance(path, str) or not path:
            raise ScimError(400, "remove needs a path", "noTarget")
        fields = _profile_fields({path: None})
        if not fields:
            # No attribute of the User schema: saying 200 would claim a removal that never was.
            raise _unsupported_path(path)
        if "user_name" in fields:
            raise ScimError(400, "userName cannot be removed", "mutability")
        return {**current, **{k: ([] if k == "emails" else None) for k in fields}}
    if isinstance(path, str) and path:
        if _attr_name(path) not in _KEPT:
            raise _unsupported_path(path)
        fields = _profile_fields({path: value}, partial=True)
    elif isinstance(value, dict):
        _refuse_unkept(value)
        fields = _profile_fields(value, partial=True)
    else:
        raise ScimError(
            400, "a PATCH operation without a path needs an object value", "invalidValue"
        )
    _check_shown(fields, current)
    if kind == "add" and "emails" in fields:
        fields["emails"] = _added_emails(current.get("emails") or [], fields["emails"])
    return {**current, **fields}


_KEPT = frozenset(
    {
        "username",
        "displayname",
        "externalid",
        "active",
        "emails",
        "name",
        "name.givenname",
        "name.familyname",
    }
)
_KEPT_NAMES = "userName, displayName, externalId, active, emails, name.givenName, name.familyName"
_ECHOED = frozenset({"schemas", "id", "meta", "groups"})
"""Members a client may send back as it read them: read-only or the message's own."""


_NOT_KEPT = frozenset(
    {
        "name.formatted",
        "name.middlename",
        "name.honorificprefix",
        "name.honorificsuffix",
        "nickname",
        "profileurl",
        "title",
        "usertype",
        "preferredlanguage",
        "locale",
        "timezone",
        "phonenumbers",
        "ims",
        "photos",
        "addresses",
        "entitlements",
        "roles",
        "x509certificates",
    }
)
"""Attributes of RFC 7643's User schema this service does not keep (section 4.1)."""


def _not_kept(path: str) -> bool:
    """Whether `path` names an attribute of the User schema (or of an extension) that this
    service does not keep: `title`, `phoneNumbers[type eq "work"].value`, `name.formatted`,
    `urn:...:enterprise:2.0:User:department`."""
    name = _attr_name(path.strip())
    if name.startswith("urn:"):
        return True
    head = name.split("[", 1)[0]
    return head in _NOT_KEPT or head.split(".", 1)[0] in _NOT_KEPT


def _unsupported_path(path: str) -> ScimError:
    return ScimError(
        400,
        f"unsupported PATCH path {quoted(path)}: the paths taken are {_KEPT_NAMES}, and "
        'emails[type eq "..."] with .value, .type or .primary',
        "invalidPath",
    )


def _refuse_unkept(value: dict[str, Any]) -> None:
    """A path-less add or replace naming an attribute of no schema: a 400, as with a path,
    never a 200 that changed nothing. The User schema's attributes this service does not
    keep, and an extension's (URN-named), are left alone, as a POST leaves them."""
    for key in value:
        name = _attr_name(str(key))
        if name not in _KEPT and name not in _ECHOED and not _not_kept(name):
            raise ScimError(
                400,
                f"unsupported PATCH attribute {quoted(str(key))}: the attributes taken are "
                f"{_KEPT_NAMES}",
                "invalidPath",
            )


_EMAIL_FILTER = re.compile(
    r'^emails\[\s*(type|value|primary)\s+eq\s+("(?:[^"\\]|\\.)*"|true|false)\s*\]'
    r"(?:\.(value|type|primary|display))?$",
    re.IGNORECASE,
)
"""`emails[type eq "work"].value`: a value filter on the emails, as Azure AD and Okta send."""


def _email_filter_op(current: dict[str, Any], kind: str, path: str, value: Any) -> dict[str, Any]:
    """An operation on the emails a value filter selects (RFC 7644 section 3.5.2): remove
    drops them; add or replace sets the sub-attribute (or merges an object) on each, and
    an add or a replace that selects none adds one that matches the filter."""
    found = _EMAIL_FILTER.match(path)
    assert found is not None  # the caller matched it
    attribute, literal, sub = _email_filter(found, path)
    if sub == "display":
        return current  # RFC 7643's `display` of an email, which this service does not keep
    emails = [dict(email) for email in current.get("emails") or []]
    selected = [email for email in emails if _email_matches(email, attribute, literal)]
    if kind == "remove":
        kept = [email for email in emails if email not in selected]
        return {**current, "emails": kept}
    change = {sub: value} if sub else value
    if not isinstance(change, dict):
        raise ScimError(
            400, f"{quoted(path)} needs an object value (value, type, primary)", "invalidValue"
        )
    if not selected:
        new = {attribute: literal, **_lower_keys(change)}
        if "value" not in new:
            raise ScimError(
                400,
                f"{quoted(path)} selects no email, and none can be added without its address: "
                "send "
                f"the address too (emails[{attribute} eq ...].value)",
                "noTarget",
            )
        new.setdefault("primary", not emails)  # a user's first address is the primary one
        emails.append(new)
        selected = [new]
    changed = _lower_keys(change)
    if _as_bool(changed.get("primary"), "emails.primary"):
        # RFC 7644 section 3.5.2: making one primary makes the others not.
        for email in emails:
            email["primary"] = False
    for email in selected:
        email.update(changed)
    fields = {"emails": _emails(emails)}
    _check_shown(fields, current)
    return {**current, **fields}


def _email_filter(found: re.Match[str], path: str) -> tuple[str, str | bool, str | None]:
    """The attribute, the literal and the sub-attribute of an email value filter: a string
    for `type` and `value`, a boolean for `primary`, each one a store can hold."""
    attribute, raw, sub = found.group(1).lower(), found.group(2), found.group(3)
    bad = ScimError(
        400,
        f"the filter of {quoted(path)} compares {attribute} with no value it holds",
        "invalidFilter",
    )
    if attribute == "primary":
        # `true`, as RFC 7644 writes it, or `"true"`, as filters elsewhere take it.
        if raw.lower().strip('"') not in ("true", "false"):
            raise bad
        return attribute, raw.lower().strip('"') == "true", sub and sub.lower()
    if not raw.startswith('"'):
        raise bad
    try:
        literal = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ScimError(
            400, f"the filter of {quoted(path)} holds a malformed string", "invalidFilter"
        ) from None
    if not isinstance(literal, str) or not storable(literal):
        raise bad
    return attribute, literal, sub and sub.lower()


def _email_matches(email: dict[str, Any], attribute: str, literal: Any) -> bool:
    held = email.get(attribute)
    if isinstance(literal, str) and isinstance(held, str):
        return held.casefold() == literal.casefold()  # caseExact false (RFC 7643 4.1.2)
    return bool(held) is literal if isinstance(literal, bool) else False


def _added_emails(
    current: list[dict[str, Any]], added: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """`current` and `added`. An added primary email makes the others not primary (RFC 7644
    section 3.5.2: the server sets primary to false for any other value). An address the
    user has already is that entry, given the added type, not a second entry (RFC 7644
    section 3.5.2.1: a value already there is not added again): an IdP that sends its add
    on every sync would otherwise grow the list until every PATCH is refused."""
    demote = any(email.get("primary") for email in added)
    emails = [{**email, "primary": False} if demote else dict(email) for email in current]
    # By folded address, so that a PATCH of many operations, each adding many addresses,
    # costs one look-up per address rather than a scan of the list.
    by_address: dict[str, dict[str, Any]] = {}
    for email in emails:
        by_address.setdefault(_address_key(email), email)
    for new in added:
        same = by_address.setdefault(_address_key(new), new)
        if same is new:
            emails.append(new)
        else:
            same.update({**new, "primary": bool(new["primary"] or same.get("primary"))})
    _check_email_count(len(emails))
    return emails


def _address_key(email: dict[str, Any]) -> str:
    return str(email.get("value", "")).casefold()


async def patch_handler(request: web.Request, ident: Identity, ws: str) -> web.StreamResponse:
    async def change(user: UserRow) -> tuple[UserProfile, str | None]:
        ops = _operations(await _json_object(request))
        current = profile_of(user).model_dump(mode="json")
        password: str | None = None
        for op in ops:
            rest, new_password = _take_password(_message_keys(op))
            password = new_password or password
            current = _apply_op(current, rest)
        return UserProfile.model_validate(current), password

    return await _save(request, ident, ws, change)


def _operations(data: dict[str, Any]) -> list[dict[str, Any]]:
    """A PatchOp body's operations, each an object."""
    data = _message_keys(data)
    schemas = data.get("schemas")
    if not isinstance(schemas, list) or PATCH_SCHEMA not in schemas:
        raise ScimError(400, f"a PATCH body must use the {PATCH_SCHEMA} schema", "invalidSyntax")
    ops = data.get("operations")
    if not isinstance(ops, list) or not ops:
        raise ScimError(400, "Operations must be a non-empty array", "invalidSyntax")
    if len(ops) > MAX_PATCH_OPERATIONS:
        raise ScimError(
            400,
            f"a PATCH holds at most {MAX_PATCH_OPERATIONS:,} operations; this has "
            f"{len(ops):,}: send the change in several requests",
            "invalidValue",
        )
    if not all(isinstance(op, dict) for op in ops):
        raise ScimError(400, "each operation must be an object", "invalidSyntax")
    return ops


async def delete_handler(request: web.Request, ident: Identity, ws: str) -> web.StreamResponse:
    user = await _writable_user(ident, ws, request.match_info["id"])
    await deprovision(ident, request, ws, user.user_id, new_id("scim-"))
    return web.Response(status=204)


# --- discovery --------------------------------------------------------------------------------


def _attr(name: str, kind: str = "string", **extra: Any) -> dict[str, Any]:
    base = {
        "name": name,
        "type": kind,
        "multiValued": False,
        "required": False,
        "caseExact": False,
        "mutability": "readWrite",
        "returned": "default",
        "uniqueness": "none",
    }
    return {**base, **extra}


USER_SCHEMA_DOC: dict[str, Any] = {
    "schemas": [SCHEMA_SCHEMA],
    "id": USER_SCHEMA,
    "name": "User",
    "description": "User Account",
    "attributes": [
        _attr("userName", required=True, uniqueness="server"),
        _attr(
            "name",
            "complex",
            subAttributes=[_attr("givenName"), _attr("familyName")],
        ),
        _attr("displayName"),
        _attr("externalId", caseExact=True),
        _attr("active", "boolean"),
        _attr("password", mutability="writeOnly", returned="never"),
        _attr(
            "emails",
            "complex",
            multiValued=True,
            subAttributes=[_attr("value"), _attr("type"), _attr("primary", "boolean")],
        ),
    ],
    "meta": {"resourceType": "Schema", "location": f"{PREFIX}/Schemas/{USER_SCHEMA}"},
}

USER_RESOURCE_TYPE: dict[str, Any] = {
    "schemas": [RT_SCHEMA],
    "id": "User",
    "name": "User",
    "endpoint": "/Users",
    "description": "User Account",
    "schema": USER_SCHEMA,
    "meta": {"resourceType": "ResourceType", "location": f"{PREFIX}/ResourceTypes/User"},
}

SERVICE_PROVIDER_CONFIG: dict[str, Any] = {
    "schemas": [SPC_SCHEMA],
    "documentationUri": "https://datatracker.ietf.org/doc/html/rfc7644",
    "patch": {"supported": True},
    "bulk": {"supported": False, "maxOperations": 0, "maxPayloadSize": 0},
    "filter": {"supported": True, "maxResults": MAX_COUNT},
    "changePassword": {"supported": True},
    "sort": {"supported": False},
    "etag": {"supported": False},
    "authenticationSchemes": [
        {
            "type": "oauthbearertoken",
            "name": "SCIM bearer token",
            "description": "The workspace token from POST /v1/admin/scim/token",
            "primary": True,
        }
    ],
    "meta": {
        "resourceType": "ServiceProviderConfig",
        "location": f"{PREFIX}/ServiceProviderConfig",
    },
}


def _list_of(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "schemas": [LIST_SCHEMA],
        "totalResults": len(items),
        "startIndex": 1,
        "itemsPerPage": len(items),
        "Resources": items,
    }


async def spc_handler(request: web.Request, ident: Identity, ws: str) -> web.StreamResponse:
    return scim_json(SERVICE_PROVIDER_CONFIG)


async def resource_types_handler(
    request: web.Request, ident: Identity, ws: str
) -> web.StreamResponse:
    return scim_json(_list_of([USER_RESOURCE_TYPE]))


async def resource_type_handler(
    request: web.Request, ident: Identity, ws: str
) -> web.StreamResponse:
    if request.match_info["id"] != "User":
        raise ScimError(404, "resource type not found")
    return scim_json(USER_RESOURCE_TYPE)


async def schemas_handler(request: web.Request, ident: Identity, ws: str) -> web.StreamResponse:
    return scim_json(_list_of([USER_SCHEMA_DOC]))


async def schema_handler(request: web.Request, ident: Identity, ws: str) -> web.StreamResponse:
    if request.match_info["id"] != USER_SCHEMA:
        raise ScimError(404, "schema not found")
    return scim_json(USER_SCHEMA_DOC)


async def no_such_endpoint(request: web.Request, ident: Identity, ws: str) -> web.StreamResponse:
    tail = request.match_info.get("tail", "")
    if tail.split("/", 1)[0].lower() == "groups":
        raise ScimError(
            404,
            "SCIM Groups are not supported, only Users: turn off group push (Okta) or group "
            "provisioning (Azure AD); roles come from the admin API or from LDAP/SAML group "
            "mappings",
        )
    raise ScimError(
        404,
        "no such SCIM endpoint; there are /Users, /Schemas, /ResourceTypes and "
        "/ServiceProviderConfig",
    )


def _method_not_allowed(allowed: str) -> ScimHandler:
    """A SCIM 405 with the `Allow` header RFC 9110 section 15.5.6 requires."""

    async def refuse(request: web.Request, ident: Identity, ws: str) -> web.StreamResponse:
        response = _error(
            405, f"{request.method} is not allowed on this endpoint; use {allowed}", None
        )
        response.headers["Allow"] = allowed
        return response

    return refuse


_ROUTES: tuple[tuple[str, tuple[tuple[str, ScimHandler], ...]], ...] = (
    ("/ServiceProviderConfig", (("GET", spc_handler),)),
    ("/ResourceTypes", (("GET", resource_types_handler),)),
    ("/ResourceTypes/{id}", (("GET", resource_type_handler),)),
    ("/Schemas", (("GET", schemas_handler),)),
    ("/Schemas/{id}", (("GET", schema_handler),)),
    ("/Users", (("GET", list_handler), ("POST", create_handler))),
    ("/Users/.search", (("POST", search_handler),)),
    ("/.search", (("POST", search_handler),)),
    (
        "/Users/{id}",
        (
            ("GET", get_handler),
            ("PUT", put_handler),
            ("PATCH", patch_handler),
            ("DELETE", delete_handler),
        ),
    ),
)


def add_scim_routes(app: web.Application) -> None:
    """Every path answers in SCIM terms: a known path with another method is a SCIM 405, any
    other path under /scim/v2 (Groups included: not supported) a SCIM 404."""
    r = app.router
    for path, handlers in _ROUTES:
        for method, handler in handlers:
            r.add_route(method, PREFIX + path, scim_route(handler))
        allowed = ", ".join(method for method, _ in handlers)
        r.add_route("*", PREFIX + path, scim_route(_method_not_allowed(allowed)))
    r.add_route("*", f"{PREFIX}/{{tail:.*}}", scim_route(no_such_endpoint))
