"""SAML 2.0 service provider with pysaml2 (SVC_SAML_*): /saml/metadata, /saml/login, /saml/acs.

- `GET /saml/login?next=/path`: an AuthnRequest over the HTTP-Redirect binding, RelayState
  carrying `next` (a same-site path only, so the login cannot be turned into an open
  redirect). The request id is recorded (table `identity_saml_state`, 10 minutes), and the
  browser gets a cookie named after it (`svc_saml_<hash of the id>`, 10 minutes, path of the
  ACS URL, HttpOnly, Secure, SameSite=None so the IdP's cross-site POST carries it).
- `POST /saml/acs` (HTTP-POST binding): the response must answer an outstanding request of
  ours (unsolicited responses are refused), be signed (the response or its assertions, by a
  key of the IdP metadata in SVC_SAML_IDP_METADATA), name our ACS URL as recipient, carry an
  AudienceRestriction naming our entity id, and be inside its validity window (pysaml2 checks
  NotBefore/NotOnOrAfter with `ACCEPTED_SKEW_S`). Each assertion id is accepted once: a
  replayed response is refused even within its window. With an https ACS URL the response
  must also arrive with the cookie of its request: a response obtained by one person cannot
  be posted from another's browser to sign them in (login CSRF). Over plain http browsers
  refuse SameSite=None cookies, so there the binding is not enforced (docs/identity.md).
- Roles come from the assertion attribute SVC_SAML_ROLE_ATTRIBUTE (default `groups`) through
  SVC_SAML_ROLE_MAPPINGS, else SVC_SAML_DEFAULT_ROLE. The NameID is the user name in the
  default workspace; a user first seen is provisioned (`source: saml`), one provisioned by
  SCIM or an earlier SAML login is updated, a local or LDAP user of that name is refused.
  Success starts the same admin session as a password login and redirects to RelayState.

The SP signing key is a secret (scope `saml`, name `sp_key`, identity vault); pysaml2 and
xmlsec1 want files, so it is written to a private temporary directory (mode 0700, named after
the process) for the life of the process; the directories of processes that were killed
before removing theirs are removed when the next one is made. pysaml2 is synchronous and
shells out to xmlsec1: parsing runs in a thread.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import hashlib
import logging
import os
import shutil
import string
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import orjson
from aiohttp import web
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from defusedxml import ElementTree  # type: ignore[import-untyped]
from pydantic import BaseModel, Field

from gateway.identity.common import first_mapped_role, read_form
from gateway.identity.login import (
    ExternalUser,
    record_refused_assertion,
    start_session,
    sync_external_user,
)
from gateway.identity.service import Identity, identity
from gateway.identity.sessions import set_session_cookies
from gateway.identity.vault import INSTANCE
from projections.identity_queries import UserRow, find_user_by_name
from schemas.errors import (
    PEM_PRIVATE_KEY,
    FeatureDisabled,
    InvalidInput,
    SvcError,
    Unauthorized,
    Unavailable,
)
from schemas.setting_rules import pem_certificate_problem, saml_idp_metadata_problem


@functools.cache
def _pysaml2() -> SimpleNamespace:
    """pysaml2, imported when SAML is first used rather than with this module: loading its
    XML schemas takes most of a second, which every `svc` command and every start would
    otherwise pay for a feature most instances leave off. `_build` imports it, in the worker
    thread `service_provider` runs it in, so that the event loop does not stall for it; every
    other use comes after a build. The warnings filter below is process-wide, and mutes other
    threads' warnings for the length of that one import."""
    with warnings.catch_warnings():
        # pysaml2 7.5 imports cipher modes cryptography deprecates; harmless here (we never
        # use them), and tests turn warnings into errors.
        warnings.simplefilter("ignore")
        import saml2
        import saml2.client
        import saml2.config
        import saml2.metadata
        import saml2.saml
    return SimpleNamespace(
        BINDING_HTTP_POST=saml2.BINDING_HTTP_POST,
        BINDING_HTTP_REDIRECT=saml2.BINDING_HTTP_REDIRECT,
        SCM_BEARER=saml2.saml.SCM_BEARER,
        Saml2Client=saml2.client.Saml2Client,
        SPConfig=saml2.config.SPConfig,
        create_metadata_string=saml2.metadata.create_metadata_string,
    )


METADATA_CONTENT_TYPE = "application/samlmetadata+xml"

log = logging.getLogger(__name__)

SP_KEY_SECRET = ("saml", "sp_key")
REQUEST_TTL_S = 600
ACCEPTED_SKEW_S = 60
ASSERTION_KEEP_S = 24 * 3600
REFUSED = "SAML response refused"
BINDING_COOKIE_PREFIX = "svc_saml_"

_CONSUME_REQUEST = """
DELETE FROM identity_saml_state WHERE kind = 'request' AND id = $1 AND expires_at > now()
RETURNING id
"""
_REMEMBER = """
INSERT INTO identity_saml_state (kind, id, expires_at)
VALUES ($1, $2, now() + make_interval(secs => $3))
ON CONFLICT (kind, id) DO NOTHING
"""
_PRUNE = "DELETE FROM identity_saml_state WHERE expires_at < now()"


@dataclass(frozen=True, slots=True)
class SamlSettings:
    entity_id: str
    acs_url: str
    idp_metadata: str
    sp_cert: str
    role_attribute: str
    role_mappings: dict[str, str]
    default_role: str

    @property
    def binds_browser(self) -> bool:
        """Browsers send a SameSite=None cookie with the IdP's POST only over https."""
        return self.acs_url.startswith("https://")

    def fingerprint(self, sp_key: str) -> str:
        parts = (self.entity_id, self.acs_url, self.idp_metadata, self.sp_cert, sp_key)
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()


@dataclass
class ServiceProvider:
    settings: SamlSettings
    client: Any  # saml2.client.Saml2Client
    fingerprint: str
    files: tempfile.TemporaryDirectory[str]


def read_settings(ident: Identity) -> SamlSettings:
    s = ident.settings
    if not s.flag("SVC_SAML_ENABLED"):
        raise FeatureDisabled("SAML is not enabled (SVC_SAML_ENABLED)")
    root = s.text("SVC_SAML_ROOT_URL").strip().rstrip("/")
    metadata = s.text("SVC_SAML_IDP_METADATA").strip()
    cert = s.text("SVC_SAML_SP_CERT").strip()
    if not root or not metadata or not cert:
        raise Unavailable(
            "SAML needs SVC_SAML_ROOT_URL, SVC_SAML_IDP_METADATA and SVC_SAML_SP_CERT",
            code="saml_not_configured",
        )
    raw = s.text("SVC_SAML_ROLE_MAPPINGS").strip()
    try:
        mappings = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        mappings = None
    if not isinstance(mappings, dict):
        raise Unavailable("SVC_SAML_ROLE_MAPPINGS is not a JSON object", code="saml_not_configured")
    return SamlSettings(
        entity_id=s.text("SVC_SAML_ENTITY_ID").strip() or f"{root}/saml/metadata",
        acs_url=f"{root}/saml/acs",
        idp_metadata=metadata,
        sp_cert=cert,
        role_attribute=s.text("SVC_SAML_ROLE_ATTRIBUTE").strip() or "groups",
        role_mappings={str(k): str(v) for k, v in mappings.items()},
        default_role=s.text("SVC_SAML_DEFAULT_ROLE").strip(),
    )


_KEY_DIR_PREFIX = "svc-saml-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_orphaned_key_dirs() -> None:
    """Remove the key directories of processes of this user that ended without removing
    theirs (killed, or crashed before the interpreter's exit hooks ran). Each directory is
    named after the process that made it, so a live one is never touched."""
    root = Path(tempfile.gettempdir())
    for path in root.glob(f"{_KEY_DIR_PREFIX}*-*"):
        pid_text = path.name[len(_KEY_DIR_PREFIX) :].partition("-")[0]
        try:
            owner, pid = path.lstat().st_uid, int(pid_text)
        except (OSError, ValueError):
            continue
        if owner != os.getuid() or pid == os.getpid() or _alive(pid):
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed the SAML key directory of ended process %d", pid)


def _xmlsec1() -> str:
    """pysaml2 checks every signature by running xmlsec1; without it each sign-in would fail
    deep inside pysaml2, so its absence is said up front, as configuration to fix."""
    found = shutil.which("xmlsec1")
    if found is None:
        raise Unavailable(
            "SAML needs the xmlsec1 program, which is not on the gateway's PATH; install it"
            " (Debian and Ubuntu: apt-get install xmlsec1) and try again",
            code="saml_not_configured",
        )
    return found


def sp_key_problem(text: str) -> str | None:
    """Why `text` is not a usable SP signing key, or None. Never quotes the key."""
    if len(PEM_PRIVATE_KEY.findall(text)) > 1:
        return "it holds more than one private key: give the SP's own"
    try:
        key = serialization.load_pem_private_key(text.strip().encode(), password=None)
    except TypeError:
        return "it is encrypted: give the key without a passphrase"
    except (ValueError, UnsupportedAlgorithm):
        return "it is not a PEM private key (-----BEGIN PRIVATE KEY----- ...)"
    if not isinstance(key, rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey):
        return "it is neither an RSA nor an EC key, which SAML signatures use"
    return None


def _unusable(what: str, problem: str, fix: str) -> Unavailable:
    return Unavailable(f"SAML cannot start: {what}: {problem}; {fix}", code="saml_not_configured")


def _check_configuration(settings: SamlSettings, sp_key: str) -> None:
    """What pysaml2 would fail on deep inside (a 500 on every SAML route), said as the
    setting to fix. The values may predate the checks made when they are set."""
    try:
        x509.load_pem_x509_certificate(settings.sp_cert.strip().encode())
    except ValueError:
        raise _unusable(
            "SVC_SAML_SP_CERT",
            "it is not a PEM certificate (-----BEGIN CERTIFICATE----- ...)",
            "set the SP's certificate",
        ) from None
    problem = pem_certificate_problem(settings.sp_cert)
    if problem:
        # A chain, or a key beside the certificate: refused when set, and read here as
        # pysaml2 reads it (its first certificate), as before the check existed.
        log.warning("SAML: SVC_SAML_SP_CERT: %s; its first certificate is used", problem)
    fix_key = "set it again with PUT /v1/admin/identity/secrets/saml/sp_key"
    problem = sp_key_problem(sp_key)
    if problem:
        raise _unusable("the SP key secret (saml/sp_key)", problem, fix_key)
    if not _key_fits_certificate(sp_key, settings.sp_cert):
        # Warned, not refused: the key only decrypts assertions (requests go unsigned), so
        # a certificate renewed without its key still signs in with an IdP that does not
        # encrypt, as it did.
        log.warning(
            "SAML: the SP key secret (saml/sp_key) is not the private key of "
            "SVC_SAML_SP_CERT: an IdP that encrypts assertions to that certificate will "
            "fail every sign-in; set the key and the certificate of one pair"
        )
    problem = saml_idp_metadata_problem(settings.idp_metadata)
    if problem:
        raise _unusable("SVC_SAML_IDP_METADATA", problem, "paste the metadata the IdP publishes")


def _key_fits_certificate(sp_key: str, sp_cert: str) -> bool:
    key = serialization.load_pem_private_key(sp_key.strip().encode(), password=None)
    cert = x509.load_pem_x509_certificate(sp_cert.strip().encode())
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return key.public_key().public_bytes(*spki) == cert.public_key().public_bytes(*spki)


def _build(settings: SamlSettings, sp_key: str, fingerprint: str) -> ServiceProvider:
    xmlsec_binary = _xmlsec1()
    _check_configuration(settings, sp_key)
    pysaml2 = _pysaml2()
    _sweep_orphaned_key_dirs()
    files = tempfile.TemporaryDirectory(prefix=f"{_KEY_DIR_PREFIX}{os.getpid()}-")
    os.chmod(files.name, 0o700)
    key_path, cert_path = Path(files.name, "sp.key"), Path(files.name, "sp.crt")
    key_path.touch(mode=0o600)
    key_path.write_text(sp_key)
    cert_path.write_text(settings.sp_cert)
    try:
        return _client(pysaml2, settings, xmlsec_binary, files, fingerprint)
    except Exception as exc:
        # What the checks above do not foresee in pysaml2's reading of the metadata.
        files.cleanup()
        log.warning("SAML: pysaml2 could not be set up (%s)", type(exc).__name__)
        raise _unusable(
            "SVC_SAML_IDP_METADATA or SVC_SAML_SP_CERT",
            f"pysaml2 could not read them ({type(exc).__name__})",
            "check both against what the IdP publishes",
        ) from None


def _client(
    pysaml2: SimpleNamespace,
    settings: SamlSettings,
    xmlsec_binary: str,
    files: tempfile.TemporaryDirectory[str],
    fingerprint: str,
) -> ServiceProvider:
    key_path, cert_path = Path(files.name, "sp.key"), Path(files.name, "sp.crt")
    config = pysaml2.SPConfig()
    config.load(
        {
            "entityid": settings.entity_id,
            "xmlsec_binary": xmlsec_binary,
            "key_file": str(key_path),
            "cert_file": str(cert_path),
            "metadata": {"inline": [settings.idp_metadata]},
            "accepted_time_diff": ACCEPTED_SKEW_S,
            "allow_unknown_attributes": True,
            "service": {
                "sp": {
                    "endpoints": {
                        "assertion_consumer_service": [
                            (settings.acs_url, pysaml2.BINDING_HTTP_POST)
                        ]
                    },
                    "want_response_signed": False,
                    "want_assertions_signed": False,
                    "want_assertions_or_response_signed": True,
                    "authn_requests_signed": False,
                    "allow_unsolicited": False,
                }
            },
        }
    )
    return ServiceProvider(settings, pysaml2.Saml2Client(config=config), fingerprint, files)


async def service_provider(ident: Identity) -> ServiceProvider:
    settings = read_settings(ident)
    sp_key = await ident.vault.get(INSTANCE, *SP_KEY_SECRET)
    if not sp_key:
        raise Unavailable(
            "SAML needs the SP key secret (saml/sp_key): set it with "
            "PUT /v1/admin/identity/secrets/saml/sp_key",
            code="saml_not_configured",
        )
    fingerprint = settings.fingerprint(sp_key)
    current = ident.extras.get("saml")
    if isinstance(current, ServiceProvider) and current.fingerprint == fingerprint:
        return current
    sp = await asyncio.to_thread(_build, settings, sp_key, fingerprint)
    ident.extras["saml"] = sp
    return sp


def safe_next(raw: str | None) -> str:
    r"""A same-site absolute path, else `/` (no scheme, no host, no `//`, no backslash, and only
    printable ASCII: browsers drop tabs and newlines, so `/\t/evil.example` would become
    `//evil.example`, and a CR/LF must never reach the Location header)."""
    if not raw or len(raw) > 2048 or not all(" " < ch < "\x7f" for ch in raw):
        return "/"
    if not raw.startswith("/") or raw.startswith("//") or "\\" in raw:
        return "/"
    parts = urlsplit(raw)
    if parts.scheme or parts.netloc:
        return "/"
    return raw


async def metadata(request: web.Request) -> web.Response:
    sp = await service_provider(identity(request))
    xml = await asyncio.to_thread(_pysaml2().create_metadata_string, None, sp.client.config)
    return web.Response(body=xml, content_type=METADATA_CONTENT_TYPE)


class SamlLoginQuery(BaseModel):
    """The query of `GET /saml/login`, for the OpenAPI document. A browser's query may carry
    anything else as well, which is ignored."""

    next: str | None = Field(
        default=None,
        description="where to send the browser once signed in: a path of this service; "
        "anything else (another site, a malformed path) reads as /",
    )


async def login(request: web.Request) -> web.Response:
    ident = identity(request)
    sp = await service_provider(ident)
    relay = safe_next(request.query.get("next"))
    request_id, info = await asyncio.to_thread(
        sp.client.prepare_for_authenticate,
        relay_state=relay,
        binding=_pysaml2().BINDING_HTTP_REDIRECT,
    )
    async with ident.db.acquire() as conn:
        await conn.execute(_PRUNE)
        await conn.execute(_REMEMBER, "request", str(request_id), float(REQUEST_TTL_S))
    location = dict(info["headers"])["Location"]
    redirect = web.Response(status=302, headers={"Location": location, "Cache-Control": "no-store"})
    if sp.settings.binds_browser:
        redirect.set_cookie(
            binding_cookie(str(request_id)),
            "1",
            max_age=REQUEST_TTL_S,
            **_binding_cookie_scope(sp.settings),
        )
    return redirect


def binding_cookie(request_id: str) -> str:
    """The cookie that says this browser started the request: one per request, so logins
    started in two tabs do not undo each other."""
    return BINDING_COOKIE_PREFIX + hashlib.sha256(request_id.encode()).hexdigest()[:16]


def _binding_cookie_scope(settings: SamlSettings) -> dict[str, Any]:
    """Sent only to the ACS, never to scripts, and with the IdP's cross-site POST."""
    path = urlsplit(settings.acs_url).path
    return {"path": path, "secure": True, "httponly": True, "samesite": "None"}


def _in_response_to(saml_response: str) -> str:
    """The id of the request the response answers; Unauthorized saying what it lacks."""
    try:
        root = ElementTree.fromstring(base64.b64decode(saml_response, validate=False))
    except (binascii.Error, ElementTree.ParseError, ValueError):
        raise Unauthorized(
            f"{REFUSED}: SAMLResponse is not a base64-encoded SAML response"
        ) from None
    if root.tag != f"{{{_SAML_PROTOCOL}}}Response":
        raise Unauthorized(f"{REFUSED}: SAMLResponse is not a base64-encoded SAML response")
    value = root.get("InResponseTo")
    if not value:
        raise Unauthorized(f"{REFUSED}: it answers no request of ours (no InResponseTo)")
    return str(value)


_OUTSIDE_WINDOW = (
    "it is outside its validity window (check the clocks of the IdP and of this gateway; "
    f"{ACCEPTED_SKEW_S} s of difference is allowed)"
)
_SAML_ASSERTION = "{urn:oasis:names:tc:SAML:2.0:assertion}"
_SAML_PROTOCOL = "urn:oasis:names:tc:SAML:2.0:protocol"


def _refusal(exc: Exception, settings: SamlSettings, saml_response: str) -> str:
    """What pysaml2's refusal of a response means, for the person setting the IdP up: its
    exceptions are named, not worded (an audience mismatch is a bare Exception, an expiry
    "Condition not OK")."""
    names = {kind.__name__ for kind in type(exc).__mro__}
    text = str(exc)
    if names & {"ResponseLifetimeExceed", "ToEarly"}:
        return _OUTSIDE_WINDOW
    if names & {"SignatureError", "IncorrectlySigned", "SigverError"} or "signed" in text:
        return "it is unsigned, or its signature does not verify against SVC_SAML_IDP_METADATA"
    if "AudienceRestrictions" in text or "Condition not OK" in text:
        return _failed_condition(saml_response, settings.entity_id)
    if "StatusError" in names:
        return f"the IdP answered with a failure status ({type(exc).__name__})"
    return "it could not be verified (the gateway's log says why)"


def _failed_condition(saml_response: str, entity_id: str) -> str:
    """Which of the assertion's conditions fails, read for the message only: pysaml2 has
    refused the response, and checks the conditions before it asks for a signature, so
    what is read here may be anyone's."""
    root = ElementTree.fromstring(base64.b64decode(saml_response, validate=False))
    audiences = {a.text.strip() for a in root.iter(f"{_SAML_ASSERTION}Audience") if a.text}
    if audiences and entity_id not in audiences:
        return f"its audience is not {entity_id}, this service's entity id"
    # The bounds move, not the instants read: an instant at either end of the calendar
    # (9999-12-31) plus or minus the skew overflows.
    skew = timedelta(seconds=ACCEPTED_SKEW_S)
    earliest, latest = datetime.now(UTC) - skew, datetime.now(UTC) + skew
    for conditions in root.iter(f"{_SAML_ASSERTION}Conditions"):
        after, before = conditions.get("NotOnOrAfter"), conditions.get("NotBefore")
        if (after and _instant(after) <= earliest) or (before and _instant(before) > latest):
            return _OUTSIDE_WINDOW
    return "its conditions do not hold (the gateway's log says which)"


def _instant(text: str) -> datetime:
    """A SAML instant (UTC, RFC 3339); the earliest instant when it is no such thing."""
    try:
        found = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        return datetime.min.replace(tzinfo=UTC)
    return found if found.tzinfo else found.replace(tzinfo=UTC)


def _parse(sp: ServiceProvider, saml_response: str, request_id: str) -> Any:
    return sp.client.parse_authn_request_response(
        saml_response, _pysaml2().BINDING_HTTP_POST, outstanding={request_id: "/"}
    )


def _audience_ok(assertion: Any, entity_id: str) -> bool:
    conditions = getattr(assertion, "conditions", None)
    restrictions = getattr(conditions, "audience_restriction", None) or []
    audiences = [a.text.strip() for r in restrictions for a in (r.audience or []) if a.text]
    return entity_id in audiences


def _recipient_ok(assertion: Any, acs_url: str) -> bool:
    """Every bearer confirmation names our ACS as its Recipient (SAML profiles 4.1.4.2), and
    there is one. pysaml2 checks the Recipient only when handed conversation details, and
    the response's Destination only when present: an assertion an IdP issued to another
    service provider, wrapped in a response without one, passed both."""
    subject = getattr(assertion, "subject", None)
    bearers = [
        c
        for c in getattr(subject, "subject_confirmation", None) or []
        if getattr(c, "method", None) == _pysaml2().SCM_BEARER
    ]
    recipients = [getattr(c.subject_confirmation_data, "recipient", None) for c in bearers]
    return bool(recipients) and all(r == acs_url for r in recipients)


def map_role(values: list[str], mappings: dict[str, str], default: str) -> str | None:
    return first_mapped_role(mappings, set(values), default)


async def _verified(
    ident: Identity, sp: ServiceProvider, saml_response: str, cookies: Mapping[str, str]
) -> tuple[Any, str]:
    """The verified response, and the id of the request it answers."""
    request_id = _in_response_to(saml_response)
    if sp.settings.binds_browser and binding_cookie(request_id) not in cookies:
        raise Unauthorized(
            f"{REFUSED}: this browser did not start the sign-in it answers; "
            "start again at /saml/login"
        )
    async with ident.db.acquire() as conn:
        consumed = await conn.fetchval(_CONSUME_REQUEST, request_id)
    if consumed is None:
        raise Unauthorized(f"{REFUSED}: it answers no outstanding request (replayed or stale)")
    try:
        response = await asyncio.to_thread(_parse, sp, saml_response, request_id)
    except Exception as exc:
        try:
            why = _refusal(exc, sp.settings, saml_response)
        except Exception:  # only the wording failed: the refusal stands
            why = "it could not be verified (the gateway's log says why)"
        log.warning("SAML: response refused: %s (%s: %.200s)", why, type(exc).__name__, exc)
        raise Unauthorized(f"{REFUSED}: {why}") from None
    if response is None or response.assertion is None:
        raise Unauthorized(REFUSED)
    if not _audience_ok(response.assertion, sp.settings.entity_id):
        raise Unauthorized(f"{REFUSED}: wrong or missing audience")
    if not _recipient_ok(response.assertion, sp.settings.acs_url):
        raise Unauthorized(f"{REFUSED}: the assertion is for another recipient than our ACS")
    async with ident.db.acquire() as conn:
        fresh = await conn.fetchval(
            _REMEMBER + " RETURNING id",
            "assertion",
            str(response.assertion.id),
            float(ASSERTION_KEEP_S),
        )
    if fresh is None:
        raise Unauthorized(f"{REFUSED}: assertion already used")
    return response, request_id


def _external(sp: ServiceProvider, response: Any) -> ExternalUser:
    name_id = getattr(response.name_id, "text", None)
    if not isinstance(name_id, str) or not name_id.strip():
        raise Unauthorized(f"{REFUSED}: no NameID")
    ava: dict[str, list[str]] = response.ava or {}
    values = [str(v) for v in ava.get(sp.settings.role_attribute, [])]
    mails = ava.get("mail") or ava.get("email") or []
    names = ava.get("displayName") or ava.get("cn") or []
    return ExternalUser(
        source="saml",
        login=name_id.strip(),
        external_id=name_id.strip(),
        display_name=str(names[0]) if names else None,
        email=str(mails[0]) if mails else None,
        role=map_role(values, sp.settings.role_mappings, sp.settings.default_role),
    )


_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def _as_the_idp_compares(name: str) -> str:
    """ASCII case only: the user lookup folds Unicode compatibility forms and case, so a
    full-width `sam` (U+FF53...) or one spelt with a long s (U+017F) would reach `sam`'s
    account, though the IdP holds it for another subject."""
    return name.translate(_ASCII_LOWER)


def _same_subject(existing: UserRow, found: ExternalUser) -> bool:
    """Whether the account the (folded) name lookup found is this subject's: its name as
    the IdP writes it, and for an account SAML made, the NameID it recorded (an account
    renamed onto this subject's name is still its first subject's)."""
    if _as_the_idp_compares(existing.user_name) != _as_the_idp_compares(found.login):
        return False
    recorded = existing.external_id
    if existing.source != "saml" or recorded is None:
        return True
    return _as_the_idp_compares(recorded) == _as_the_idp_compares(found.external_id)


async def _account_of(ident: Identity, workspace_id: str, found: ExternalUser) -> UserRow:
    """The account a verified assertion signs in to, synced with what the IdP said."""
    existing = await find_user_by_name(ident.db, workspace_id, found.login)
    if existing is not None and (existing.source not in ("saml", "scim") or not existing.usable):
        raise Unauthorized(f"{REFUSED}: the user cannot sign in with SAML")
    if existing is not None and not _same_subject(existing, found):
        raise Unauthorized(f"{REFUSED}: the account belongs to another subject of the IdP")
    user = await sync_external_user(ident, workspace_id, found, existing)
    if not user.usable:
        raise Unauthorized(REFUSED)
    return user


async def acs(request: web.Request) -> web.StreamResponse:
    ident = identity(request)
    sp = await service_provider(ident)
    form = await read_form(request)
    saml_response = form.get("SAMLResponse")
    if not isinstance(saml_response, str) or not saml_response:
        raise InvalidInput("SAMLResponse is required (HTTP-POST binding)")
    relay = form.get("RelayState")
    response, request_id = await _verified(ident, sp, saml_response, request.cookies)
    found = _external(sp, response)
    workspace_id = ident.settings.default_workspace_id
    try:
        user = await _account_of(ident, workspace_id, found)
    except SvcError as exc:
        await record_refused_assertion(request, ident, workspace_id, found.login, exc)
        raise
    session, _ = await start_session(request, ident, user, "saml", False)
    target = safe_next(relay if isinstance(relay, str) else None)
    redirect = web.Response(status=303, headers={"Location": target, "Cache-Control": "no-store"})
    set_session_cookies(request, redirect, session)
    if sp.settings.binds_browser:
        redirect.del_cookie(binding_cookie(request_id), **_binding_cookie_scope(sp.settings))
    return redirect


def add_saml_routes(app: web.Application) -> None:
    app.router.add_get("/saml/metadata", metadata)
    app.router.add_get("/saml/login", login)
    app.router.add_post("/saml/acs", acs)
