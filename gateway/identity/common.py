"""Small helpers shared by the identity handlers: ids, clocks, command ids, JSON views, forms.

This module imports no other identity handler module (oauth.py and authn.py use it), so it
must stay free of import cycles: who is calling (`acting`) lives in authn.py.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.web_protocol import RequestPayloadError
from multidict import MultiDictProxy

from gateway.auth import PRINCIPAL
from gateway.errors import body_deadline, read_header_id, undecodable_body
from gateway.settings import Settings
from gateway.state import STORE, Principal
from projections.identity_queries import UserRow
from schemas.admin import shown_name, shown_text
from schemas.commands import client_command_id
from schemas.errors import Conflict, InvalidInput, PayloadTooLarge
from schemas.identity import SIGNS_IN_ELSEWHERE, USER_CHANGED, UserProfile
from schemas.text import is_utf8

if TYPE_CHECKING:
    from gateway.identity.service import Identity

SCIM_ACTOR: web.RequestKey[str] = web.RequestKey("svc_scim_actor", str)
T = TypeVar("T")


def describe(principal: Principal) -> str:
    """Who a principal is, for the audit log (never a secret): the key, for a key of a
    user too (the key's own list names its user)."""
    if principal.key_id:
        return f"key:{principal.key_id}"
    if principal.user_id:
        return f"user:{principal.user_id}"
    client = principal.attributes.get("client_id")
    if client:
        return f"oauth:{client}"
    return principal.attributes.get("auth", "system")


SIGNED_IN = frozenset({"session", "oidc"})


def signs_in_elsewhere(user: UserRow, settings: Settings) -> bool:
    """Whether the account's password is its directory's, not this service's: LDAP, SAML and
    OIDC accounts, and with SAML on, the SCIM-provisioned ones (the IdP's users, who sign in
    through it). A local password on such an account would outlive what the directory says
    (an attacker setting one before the IdP grants the account admin, say)."""
    return user.source in SIGNS_IN_ELSEWHERE or (
        user.source == "scim" and settings.flag("SVC_SAML_ENABLED")
    )


DIRECTORY_MATCHED = frozenset({"user_name", "external_id"})
"""What a sign-in through a directory (LDAP, SAML) matches an account by."""
DIRECTORY_SOURCES = frozenset({"ldap", "saml"})
"""The accounts whose DIRECTORY_MATCHED fields are their directory's: no API renames them
(a SAML sign-in also claims SCIM's accounts, which SCIM itself, the IdP, may rename)."""


def signed_in_user(principal: Principal) -> str | None:
    """The user who signed in themselves (a session, an OIDC token): None for a key, even
    one of a user. What a user may always do to their own account (edit the profile, change
    the password, enrol TOTP) needs the person, not a credential that acts for them: a key
    with read rights must not be a way to a new password and a full session."""
    if principal.attributes.get("auth") in SIGNED_IN:
        return principal.user_id
    return None


def actor_of(request: web.Request) -> str:
    if SCIM_ACTOR in request:
        return request[SCIM_ACTOR]
    if PRINCIPAL in request:
        return describe(request[PRINCIPAL])
    return "system"


def now() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(10)


def command_id(request: web.Request) -> str:
    """The command id of an admin or identity write: from its `Idempotency-Key`, so a
    retried request is answered from the ledger instead of running twice."""
    return client_command_id(idempotency_key(request) or "")


def idempotency_key(request: web.Request) -> str | None:
    """The request's `Idempotency-Key`, stripped; None when it sent none. Refused as chat
    refuses it (`read_header_id`): one key works on every endpoint or on none."""
    return read_header_id(request, "Idempotency-Key")


async def first_attempt_ran(request: web.Request, workspace_id: str, command_id: str) -> bool:
    """Whether this request's Idempotency-Key already ran (the ledger holds its command):
    its retry is answered with the first result, so the checks of a new request (a name
    free, a model served) must not refuse it for what changed since."""
    if idempotency_key(request) is None:
        return False  # the command id was drawn at random: no first attempt
    store = request.app.get(STORE)
    if store is None:
        return False
    return await store.processed(command_id, workspace_id) is not None


def json(body: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status,
        body=orjson.dumps(body),
        content_type="application/json",
        headers=headers,
    )


def user_view(user: UserRow) -> dict[str, Any]:
    return {
        "id": user.user_id,
        "workspace_id": user.workspace_id,
        "user_name": user.user_name,
        "display_name": user.display_name,
        "given_name": user.given_name,
        "family_name": user.family_name,
        "emails": user.emails,
        "external_id": user.external_id,
        "active": user.active,
        "source": user.source,
        "roles": user.roles,
        "has_password": user.has_password,
        "totp_enrolled": user.totp_enrolled,
        "created_at": user.created_at.isoformat(),
        "updated_at": user.updated_at.isoformat(),
    }


def storable(text: str) -> bool:
    """Whether PostgreSQL text can hold `text`: no NUL, and valid Unicode (a lone surrogate,
    which a JSON `\\ud800` escape or a lenient decoder can produce, has no UTF-8 form)."""
    return "\x00" not in text and is_utf8(text)


Form = MultiDictProxy[str | bytes | bytearray | web.FileField]

_MALFORMED_FORM = (
    ValueError,  # undecodable bytes (UnicodeDecodeError), no or bad multipart boundary, ...
    LookupError,  # a charset Python does not know, or one that is not a text encoding
    BadHttpMessage,  # broken header lines in a multipart part
    RuntimeError,  # aiohttp's multipart reader: an unknown Content-Transfer-Encoding
)


async def read_form(request: web.Request) -> Form:
    """The request's form (urlencoded or multipart). Whatever the client sends, the outcome
    is the form or a client error: undecodable or malformed bodies are InvalidInput (400),
    oversized ones PayloadTooLarge (413), never an exception that would become a 500. Every
    text name and value of the form is valid Unicode; NUL is left to the caller."""
    try:
        async with body_deadline():
            form = await request.post()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge("form body too large, or with too many fields") from None
    except RequestPayloadError as exc:  # not in its Content-Encoding, or broken chunks
        raise undecodable_body(exc) from None
    except _MALFORMED_FORM as exc:
        raise InvalidInput(f"malformed form body: {_form_problem(exc)}") from None
    for name, value in form.items():
        if not is_utf8(name) or (isinstance(value, str) and not is_utf8(value)):
            raise InvalidInput("malformed form body: a name or value is not valid UTF-8")
    return form


def _form_problem(exc: Exception) -> str:
    """What was wrong, without echoing the body (it may carry a secret)."""
    if isinstance(exc, UnicodeDecodeError):
        return f"not valid {exc.encoding}"
    if isinstance(exc, LookupError):
        return "unknown or unusable charset"
    if isinstance(exc, BadHttpMessage):
        return "invalid multipart part headers"
    return "invalid encoding or multipart structure"


def first_mapped_role(
    mappings: dict[str, str], held: set[str], default: str, fold: Callable[[str], str] = str
) -> str | None:
    """The role of the first entry of `mappings` (in the order the setting lists them) whose
    name, folded by `fold`, is `held`; else `default`, blank meaning none. A directory or an
    IdP sends a user's groups in no set order, and the role must not change with that order
    from one sign-in to the next."""
    for name, role in mappings.items():
        if role and fold(name) in held:
            return role
    return default or None


def profile_of(user: UserRow) -> UserProfile:
    """The user's profile as the read model shows it: the `base` of an UpdateUser made from
    it."""
    return UserProfile.model_validate(
        {
            "user_name": user.user_name,
            "display_name": user.display_name,
            "given_name": user.given_name,
            "family_name": user.family_name,
            "emails": user.emails,
            "external_id": user.external_id,
            "active": user.active,
        }
    )


SHOWN_FIELDS = ("user_name", "display_name", "given_name", "family_name", "external_id")
"""A user's names, shown in the user list, the audit log and SCIM reads as given."""


@dataclass(frozen=True, slots=True)
class Unshown:
    """A name or address a listing could not show as the person typed it."""

    field: str
    index: int | None
    """The address's place in `emails`; None for a name."""
    reason: str


def first_unshown(changes: Mapping[str, Any], kept: Mapping[str, Any]) -> Unshown | None:
    """The first name or address of `changes` (profile fields) holding a control character or
    a direction override, or a user name of white space only. A value `kept` (the profile it
    changes) already holds is no new one: a form or an IdP that resends every field restates
    a name stored before the check, a deactivation included, and is not refused for it."""
    for field in SHOWN_FIELDS:
        value = changes.get(field)
        if isinstance(value, str) and value != kept.get(field):
            try:
                (shown_name if field == "user_name" else shown_text)(value)
            except ValueError as exc:
                return Unshown(field, None, str(exc))
    held = {email.get("value") for email in kept.get("emails") or ()}
    for n, email in enumerate(changes.get("emails") or ()):
        if email["value"] not in held:
            try:
                shown_text(email["value"])
            except ValueError as exc:
                return Unshown("emails", n, str(exc))
    return None


USER_UPDATE_PAUSES_S = (0.05, 0.2, 0.5)
"""The pauses before a change to a user is made again from a fresh read, when another change
landed between its read and its write (UpdateUser.base); after the last try, 409
`user_changed`. The read models show that change once they pass the log's head, which a
transaction that took its id before the change's commit holds back (a projection batch, for
tens of milliseconds): the pauses outlast that, where tries back to back read the same row."""


async def retried_if_changed(ident: Identity, attempt: Callable[[], Awaitable[T]]) -> T:
    """`attempt` (read the user, decide, UpdateUser with its base), made again from the read
    models once they show the change that refused it."""
    for pause_s in (*USER_UPDATE_PAUSES_S, None):
        try:
            return await attempt()
        except Conflict as exc:
            if exc.code != USER_CHANGED or pause_s is None:
                raise
        await asyncio.sleep(pause_s)
        await ident.caught_up()
    raise AssertionError("unreachable: the last try returns or raises")
