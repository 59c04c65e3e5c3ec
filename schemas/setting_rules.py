"""Shapes a text setting must have beyond "text": each rule is checked when a value is set
(`svc settings set`, the admin endpoint) and when a stored value is loaded, so a value that
would stop the service, break a header or fail only at the next sign-in is refused up front.
"""

from __future__ import annotations

import re
import zoneinfo
from collections.abc import Callable
from typing import Literal
from urllib.parse import parse_qs, urlsplit

import orjson
from cryptography import x509
from defusedxml import DefusedXmlException, ElementTree  # type: ignore[import-untyped]
from yarl import URL

from schemas.errors import PEM_PRIVATE_KEY
from schemas.identity import MAX_ROLE_NAME, ROLE_NAME_PATTERN
from schemas.workspace import RESERVED_WORKSPACE_ID

TextRule = Literal[
    "header_value",
    "header_sized",
    "compared_token",
    "string_map",
    "role_map",
    "role_name",
    "ldap_user_filter",
    "timezone",
    "workspace_id",
    "llm_provider",
    "http_url",
    "own_url",
    "origin",
    "origins",
    "ray_address",
    "pem_certificate",
    "saml_idp_metadata",
    "trimmed",
    "postgres_url",
]

OFFLINE_PROVIDERS = frozenset({"offline", "svc-offline"})
"""SVC_LLM_PROVIDER names of the built-in offline model."""
UPSTREAM_PROVIDERS = frozenset({"openai", "openai-compat", "openai_compat", "compatible"})
"""SVC_LLM_PROVIDER names of the OpenAI-compatible upstream."""
AUTO_PROVIDERS = frozenset({"", "auto"})
"""Blank or auto: the upstream when SVC_LLM_GATEWAY_URL is set, else the offline model."""

MAX_WORKSPACE_ID = 200


MAX_HEADER_VALUE_BYTES = 4096
"""The longest header a setting may become. Common clients refuse a longer response header
line outright (aiohttp at 8,190 bytes, Python's http.client at 65,536), so a longer
SVC_CSP, sent on every answer, would make the whole API unreadable to them."""


def _header_value(raw: str) -> bool:
    # A control character (CR and LF above all) would end or split the header line.
    return not any((ord(ch) < 0x20 and ch != "\t") or ord(ch) == 0x7F for ch in raw)


def _header_sized(raw: str) -> bool:
    # A new value only (`new_rule`): one stored before the bound keeps loading, since
    # dropping a stored SVC_METRICS_TOKEN would leave /metrics open.
    return _header_value(raw) and len(raw.encode()) <= MAX_HEADER_VALUE_BYTES


def _compared_token(raw: str) -> bool:
    # A caller's token arrives stripped (header values are): one kept with a space at either
    # end, or made of spaces only, would never match and lock every caller out.
    return _header_sized(raw) and raw == raw.strip()


def _role_name(raw: str) -> bool:
    return len(raw) <= MAX_ROLE_NAME and re.fullmatch(ROLE_NAME_PATTERN, raw) is not None


def _string_map(raw: str) -> bool:
    if not raw.strip():
        return True
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


def _role_map(raw: str) -> bool:
    """A map to role names, or to "" (an entry that maps to nothing): a name no role can
    have would fail every sign-in it maps."""
    if not _string_map(raw):
        return False
    roles = orjson.loads(raw).values() if raw.strip() else ()
    return all(not role or _role_name(role) for role in roles)


def _ldap_user_filter(raw: str) -> bool:
    text = raw.strip()
    return not text or ("%s" in text and text.startswith("(") and text.endswith(")"))


def _timezone(raw: str) -> bool:
    text = raw.strip()
    if text.upper() in ("", "UTC"):
        return True
    try:
        zoneinfo.ZoneInfo(text)
    # Not found, a malformed key, or a directory of the zone database ("Europe" is one).
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        return False
    return True


def _workspace_id(raw: str) -> bool:
    # What CreateWorkspace takes (schemas/workspace.py): printable, spaces inside allowed, not
    # the service's own id.
    text = raw.strip()
    return len(text) <= MAX_WORKSPACE_ID and text.isprintable() and text != RESERVED_WORKSPACE_ID


def _http_url(raw: str) -> bool:
    # Refused here, not where it is used: a URL that does not parse failed only at its first
    # use (a redirect answered 500, a model call reported as a broken stream).
    text = raw.strip()
    if not text:
        return True
    if any(ch.isspace() or not ch.isprintable() for ch in text):
        return False
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
        # The service reads these with yarl, which is stricter than urlsplit (a backslash in
        # the authority, an empty IDNA label, junk after an IPv6 literal): a value only
        # urlsplit took failed on every response once applied (SVC_CORS_ORIGINS is read by
        # the security headers of each one).
        parsed = URL(text)
        parsed.host  # noqa: B018 - decoded lazily: an IDNA label yarl cannot decode raises
    except ValueError:  # UnicodeError, an IDNA label yarl cannot encode, is one
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _own_url(raw: str) -> bool:
    """An address of this service: clients are sent to it (redirects, SAML metadata), so a
    user and password in it would be handed to anyone who asks."""
    text = raw.strip()
    return _http_url(text) and (not text or urlsplit(text).netloc.rpartition("@")[1] == "")


def _origin(text: str) -> bool:
    """`https://app.example.com[:port]`: what a browser sends as Origin. Not `*` (which
    would allow every site with credentials) nor `null` (sent by sandboxed frames and
    `file:` pages of any site)."""
    if not _http_url(text):
        return False
    parts = urlsplit(text)
    return parts.path in ("", "/") and not (parts.query or parts.fragment or "@" in parts.netloc)


def _origins(raw: str) -> bool:
    return all(_origin(item.strip()) for item in raw.split(",") if item.strip())


def port_number(text: str) -> int | None:
    """The number a port is written as, if it is written in ASCII digits and short enough
    to be one (the range is the caller's); None otherwise. `"²".isdigit()` is true and
    `int("²")` raises; so does `int()` of over 4,300 digits."""
    if not (text.isascii() and text.isdigit() and len(text) <= 5):
        return None
    return int(text)


def _ray_address(raw: str) -> bool:
    """Blank, `auto`, or `host:port` of a cluster's head to join as a node. Not a Ray Client
    URL (`ray://`): Ray Client has no streaming generators, so every streamed chat would
    fail; nor any other scheme."""
    text = raw.strip()
    if not text or text == "auto":
        return True
    host, sep, port_text = text.rpartition(":")
    port = port_number(port_text)
    return bool(sep and host and "://" not in text and port is not None and 0 < port < 65536)


POSTGRES_SCHEMES = ("postgresql", "postgres")
SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
"""libpq's sslmode values (the driver takes verify_ca and verify_full too)."""


def postgres_url_problem(raw: str) -> str | None:
    """What is wrong with a PostgreSQL URL's form, or None (blank: the embedded database).
    Said without quoting the URL, which may hold a password: the driver's own refusal of a
    malformed one came only once a command ran, as an unreachable database (exit 1)."""
    text = raw.strip()
    if not text:
        return None
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() not in POSTGRES_SCHEMES:
        return "it does not start with postgresql:// (or postgres://)"
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" not in authority and "@" in rest:  # the authority cut short inside the password
        return "its user name or password holds a / ? or # that is not percent-encoded"
    hosts = authority.rpartition("@")[2]  # the user name and password before it
    if any(not _a_port(host) for host in hosts.split(",")):  # a list of hosts: libpq's too
        return "its port is not a number from 1 to 65535"
    query = text.partition("?")[2].partition("#")[0]
    modes = parse_qs(query, keep_blank_values=True).get("sslmode", [])
    if any(mode.replace("_", "-") not in SSL_MODES for mode in modes):
        return f"its sslmode is none of {', '.join(SSL_MODES)}"
    return None


def _a_port(host: str) -> bool:
    """Whether `host` (`name`, `name:port`, `[v6]:port`) has no port or a valid one."""
    after_address = host.rpartition("]")[2] if host.startswith("[") else host
    _, sep, port_text = after_address.rpartition(":")
    if not sep:
        return True
    port = port_number(port_text)
    return port is not None and 0 < port < 65536


def pem_certificate_problem(text: str) -> str | None:
    """Why `text` is not one PEM X.509 certificate, or None."""
    if PEM_PRIVATE_KEY.search(text):
        return "it holds a private key, which goes in the saml/sp_key secret, never a setting"
    if text.count("-----BEGIN CERTIFICATE-----") > 1:
        return "it holds more than one certificate: give the SP's own"
    try:
        x509.load_pem_x509_certificate(text.strip().encode())
    except ValueError:
        return "it is not a PEM certificate (-----BEGIN CERTIFICATE----- ...)"
    return None


SAML_METADATA = "urn:oasis:names:tc:SAML:2.0:metadata"


def saml_idp_metadata_problem(text: str) -> str | None:
    """Why `text` is not an identity provider's SAML metadata, or None: XML whose root is an
    EntityDescriptor (or EntitiesDescriptor) that holds an IDPSSODescriptor."""
    try:
        root = ElementTree.fromstring(text.strip())
    except ElementTree.ParseError as exc:
        return f"it is not well-formed XML ({exc})"
    except DefusedXmlException:
        return "it declares entities or a DTD, which metadata never needs"
    roots = (f"{{{SAML_METADATA}}}EntityDescriptor", f"{{{SAML_METADATA}}}EntitiesDescriptor")
    if root.tag not in roots:
        return f"its root element is {root.tag}, not a SAML metadata EntityDescriptor"
    if root.find(f".//{{{SAML_METADATA}}}IDPSSODescriptor") is None:
        return "it describes no identity provider (no IDPSSODescriptor)"
    return None


def _llm_provider(raw: str) -> bool:
    return raw.strip().lower() in AUTO_PROVIDERS | OFFLINE_PROVIDERS | UPSTREAM_PROVIDERS


TEXT_RULES: dict[TextRule, tuple[Callable[[str], bool], str]] = {
    "header_value": (_header_value, "text without control characters (no line breaks)"),
    "header_sized": (
        _header_sized,
        f"text without control characters (no line breaks), at most "
        f"{MAX_HEADER_VALUE_BYTES:,} bytes (it is sent as a header)",
    ),
    "compared_token": (
        _compared_token,
        "a token without control characters or spaces at either end (a caller's is compared "
        f"without them), at most {MAX_HEADER_VALUE_BYTES:,} bytes",
    ),
    "string_map": (_string_map, 'blank or a JSON object of strings, e.g. {"ops": "admin"}'),
    "role_map": (
        _role_map,
        'blank or a JSON object of role names (lower case: a-z, 0-9, _ . -; "" maps nothing), '
        'e.g. {"ops": "admin"}',
    ),
    "role_name": (
        lambda raw: not raw.strip() or _role_name(raw.strip()),
        "blank or a role name (lower case: a-z, 0-9, _ . -), e.g. member",
    ),
    "ldap_user_filter": (
        _ldap_user_filter,
        "blank or a parenthesised LDAP filter containing %s for the login, e.g. (uid=%s)",
    ),
    "timezone": (_timezone, "an IANA time zone such as UTC or Europe/Paris"),
    "workspace_id": (
        _workspace_id,
        f"a workspace id of at most {MAX_WORKSPACE_ID} printable characters, not _instance "
        "(the service's own)",
    ),
    "llm_provider": (
        _llm_provider,
        "blank or auto, offline, or openai (also openai-compat, compatible)",
    ),
    "http_url": (
        _http_url,
        "blank or an absolute http:// or https:// URL with a host, e.g. https://svc.example.com",
    ),
    "own_url": (
        _own_url,
        "blank or an absolute http:// or https:// URL with a host and no user or password, "
        "e.g. https://svc.example.com",
    ),
    "origin": (
        lambda raw: not raw.strip() or _origin(raw.strip()),
        "blank or a browser origin, scheme://host[:port] with no path, e.g. "
        "https://app.example.com",
    ),
    "pem_certificate": (
        lambda raw: not raw.strip() or pem_certificate_problem(raw) is None,
        "blank or one PEM X.509 certificate (-----BEGIN CERTIFICATE----- ...)",
    ),
    "saml_idp_metadata": (
        lambda raw: not raw.strip() or saml_idp_metadata_problem(raw) is None,
        "blank or the identity provider's SAML metadata XML (an EntityDescriptor with an "
        "IDPSSODescriptor), as the IdP publishes it",
    ),
    "trimmed": (
        lambda raw: raw == raw.strip(),
        "text without spaces at either end (a value of spaces alone reads as blank, which "
        "turns the check off; `svc settings unset` stores no value)",
    ),
    "ray_address": (
        _ray_address,
        "blank (a local Ray), auto, or the host:port of a Ray head to join as a node (its GCS "
        "port, 6379 by default); not ray:// (Ray Client cannot stream)",
    ),
    "postgres_url": (
        lambda raw: postgres_url_problem(raw) is None,
        "blank (the embedded PostgreSQL) or postgresql://user:password@host:port/database"
        "?options, with / ? # @ : in the user name and password percent-encoded (%2F %3F %23 "
        "%40 %3A)",
    ),
    "origins": (
        _origins,
        "blank or a comma list of browser origins, scheme://host[:port] with no path, e.g. "
        "https://app.example.com,http://localhost:5173 (not * nor null)",
    ),
}
"""Each rule's check, and what a valid value looks like (for the error message)."""

RULE_PROBLEMS: dict[TextRule, Callable[[str], str | None]] = {
    "postgres_url": postgres_url_problem,
}
"""Rules that can say what is wrong with a value, besides what a valid one looks like."""
