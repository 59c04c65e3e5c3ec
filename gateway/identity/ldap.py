"""LDAP directory login with ldap3 (SVC_LDAP_*), used when a local password check fails.

Search bind: bind as SVC_LDAP_BIND_DN with the secret bind password (identity vault, scope
`ldap`, name `bind_password`; anonymous when the DN is blank), search SVC_LDAP_BASE_DN with
SVC_LDAP_USER_FILTER (`%s` replaced by the login, escaped per RFC 4515 so `*()\\` and NUL in
a login cannot change the filter), require exactly one entry, then bind as that entry's DN
with the typed password. An empty password is refused before any bind (an LDAP "unauthenticated
bind" with an empty password succeeds on many servers).

Groups come from SVC_LDAP_GROUP_ATTR (memberOf style DNs) and map to a role through
SVC_LDAP_ROLE_MAPPINGS (JSON: group DN or bare CN -> role), else SVC_LDAP_DEFAULT_ROLE.
`ldaps://` verifies the server certificate against the system CAs unless
SVC_LDAP_SKIP_TLS_VERIFY. ldap3 is synchronous: every exchange runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import warnings
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.identity.common import first_mapped_role
from gateway.settings import Settings
from schemas.errors import InvalidInput, Unavailable

with warnings.catch_warnings():
    # ldap3 2.9 imports names pyasn1 0.6 deprecates; harmless, and tests turn warnings to errors.
    warnings.simplefilter("ignore", DeprecationWarning)
    import ldap3
    from ldap3.core.exceptions import LDAPException, LDAPInvalidDnError
    from ldap3.utils.conv import escape_filter_chars
    from ldap3.utils.dn import parse_dn

log = logging.getLogger(__name__)

_DIRECTORY_FAILURES = (LDAPException, KeyError, IndexError, ValueError, OSError)
"""What a directory call may raise: ldap3's own errors, and its BER decoder's KeyError or
IndexError when the peer at the URL speaks something else (`ldap://` at an LDAPS port)."""

BIND_SECRET = ("ldap", "bind_password")
TIMEOUT_S = 5


class DirectoryUnavailable(Unavailable):
    """The directory could not say whether a password is right: unreachable, or refusing
    the service's own bind. Never told as a wrong password, and never counted as one: a
    directory outage would otherwise lock out every user who tried during it."""

    default_code = "ldap_unavailable"


def _unreachable(exc: BaseException) -> DirectoryUnavailable:
    log.warning("LDAP: the directory could not be asked (%s: %.200s)", type(exc).__name__, exc)
    return DirectoryUnavailable(
        "the sign-in directory could not be reached (the gateway's log says why), so the "
        "password was not checked (this attempt does not count against the account); try "
        "again shortly"
    )


def _service_bind_refused(description: object) -> DirectoryUnavailable:
    log.warning("LDAP: the search bind was refused (%s)", description)
    return DirectoryUnavailable(
        "the sign-in directory refused the service's own account, so the password was not "
        "checked; an administrator must correct SVC_LDAP_BIND_DN or the ldap/bind_password "
        "secret",
        code="ldap_not_configured",
    )


@dataclass(frozen=True, slots=True)
class LdapConfig:
    url: str
    base_dn: str
    bind_dn: str
    bind_password: str
    user_attr: str
    user_filter: str
    group_attr: str
    role_mappings: dict[str, str]
    default_role: str
    skip_tls_verify: bool

    def __repr__(self) -> str:
        return f"LdapConfig(url={self.url!r}, base_dn={self.base_dn!r})"


@dataclass(frozen=True, slots=True)
class LdapUser:
    dn: str
    login: str
    groups: tuple[str, ...]
    role: str | None
    display_name: str | None
    email: str | None


def config_from(settings: Settings, bind_password: str) -> LdapConfig:
    raw = settings.text("SVC_LDAP_ROLE_MAPPINGS").strip()
    try:
        mappings = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        raise InvalidInput("SVC_LDAP_ROLE_MAPPINGS is not a JSON object") from None
    if not isinstance(mappings, dict):
        raise InvalidInput("SVC_LDAP_ROLE_MAPPINGS is not a JSON object")
    user_attr = settings.text("SVC_LDAP_USER_ATTR").strip() or "uid"
    return LdapConfig(
        url=settings.text("SVC_LDAP_URL").strip(),
        base_dn=settings.text("SVC_LDAP_BASE_DN").strip(),
        bind_dn=settings.text("SVC_LDAP_BIND_DN").strip(),
        bind_password=bind_password,
        user_attr=user_attr,
        user_filter=settings.text("SVC_LDAP_USER_FILTER").strip() or f"({user_attr}=%s)",
        group_attr=settings.text("SVC_LDAP_GROUP_ATTR").strip(),
        role_mappings={str(k): str(v) for k, v in mappings.items()},
        default_role=settings.text("SVC_LDAP_DEFAULT_ROLE").strip(),
        skip_tls_verify=settings.flag("SVC_LDAP_SKIP_TLS_VERIFY"),
    )


def _server(config: LdapConfig) -> ldap3.Server:
    tls = None
    if config.url.lower().startswith("ldaps://"):
        validate = ssl.CERT_NONE if config.skip_tls_verify else ssl.CERT_REQUIRED
        tls = ldap3.Tls(validate=validate)
    return ldap3.Server(config.url, use_ssl=tls is not None, tls=tls, connect_timeout=TIMEOUT_S)


def _bare_cn(dn: str) -> str | None:
    try:
        parts = parse_dn(dn)
    except LDAPException:
        return None
    if parts and parts[0][0].lower() == "cn":
        return str(parts[0][1])
    return None


def map_role(groups: tuple[str, ...], mappings: dict[str, str], default: str) -> str | None:
    """Groups match by DN or by bare CN, either case-insensitively."""
    held = {group.lower() for group in groups}
    held |= {cn.lower() for group in groups if (cn := _bare_cn(group)) is not None}
    return first_mapped_role(mappings, held, default, str.lower)


def _first(entry: Any, attr: str) -> str | None:
    if not attr or attr not in entry:
        return None
    values = entry[attr].values
    return str(values[0]) if values else None


def _service_connection(server: ldap3.Server, config: LdapConfig) -> ldap3.Connection:
    """A connection that binds as the service account (anonymous without one)."""
    return ldap3.Connection(
        server,
        user=config.bind_dn or None,
        password=config.bind_password or None,
        receive_timeout=TIMEOUT_S,
        raise_exceptions=False,
    )


def _release(conn: ldap3.Connection) -> None:
    """Unbind, and close the socket ldap3 leaves open when it could not connect at all."""
    try:
        conn.unbind()
    finally:
        if conn.socket is not None:
            conn.socket.close()


def _find_sync(config: LdapConfig, login: str) -> LdapUser | None:
    search = _service_connection(_server(config), config)
    try:
        if not search.bind():
            raise _service_bind_refused(search.result.get("description"))
        query = config.user_filter.replace("%s", escape_filter_chars(login))
        attrs = [a for a in (config.user_attr, config.group_attr, "cn", "mail") if a]
        search.search(config.base_dn, query, attributes=attrs, size_limit=2)
        _check_search(search.result)
        entries = list(search.entries)
    finally:
        _release(search)
    if len(entries) != 1:
        return None
    entry = entries[0]
    groups: tuple[str, ...] = ()
    if config.group_attr and config.group_attr in entry:
        groups = tuple(str(g) for g in entry[config.group_attr].values)
    return LdapUser(
        dn=str(entry.entry_dn),
        login=_first(entry, config.user_attr) or login,
        groups=groups,
        role=map_role(groups, config.role_mappings, config.default_role),
        display_name=_first(entry, "cn"),
        email=_first(entry, "mail"),
    )


_FOUND = (0, 4)
"""A search's answers that list what it found: success, and the size limit of 2 met."""
_SEARCH_REFUSED = {
    32: "SVC_LDAP_BASE_DN names no entry of the sign-in directory",
    50: "the service account may not search SVC_LDAP_BASE_DN",
    1: "the directory refused the search (an anonymous search where it wants a bind?)",
}
"""Refusals of the user search that are the configuration's to correct (RFC 4511 codes)."""
ACCOUNT_REFUSED = frozenset({19, 48, 49, 50, 53})
"""User bind answers that refuse this account (RFC 4511): a wrong password (49), and what
389-DS and FreeIPA answer for a locked (19) or inactivated (53) one; counted as a failed
login. Busy (51), unavailable (52) and the rest are the directory's state."""


def _check_search(result: dict[str, Any]) -> None:
    """A search that did not answer what it found is no "no such user": the password was
    not checked, and is not counted."""
    code = result.get("result")
    if code in _FOUND:
        return
    if code in _SEARCH_REFUSED:
        log.warning("LDAP: the user search was refused (%s)", result.get("description"))
        raise DirectoryUnavailable(
            f"{_SEARCH_REFUSED[code]}, so the password was not checked; an administrator "
            "must correct it",
            code="ldap_not_configured",
        )
    raise LDAPException(f"the user search answered {result.get('description')}")


def _binds_sync(config: LdapConfig, dn: str, password: str) -> bool:
    """Whether the password binds: False when the directory refuses this account
    (`ACCOUNT_REFUSED`), LDAPException when it is busy or unavailable."""
    conn = ldap3.Connection(_server(config), user=dn, password=password, receive_timeout=TIMEOUT_S)
    try:
        if conn.bind():
            return True
        if conn.result.get("result") in ACCOUNT_REFUSED:
            return False
        raise LDAPException(f"the user bind answered {conn.result.get('description')}")
    finally:
        _release(conn)


def _entry_exists_sync(config: LdapConfig, dn: str) -> bool:
    conn = _service_connection(_server(config), config)
    try:
        if not conn.bind():
            raise LDAPException("the search bind was refused")
        found = conn.search(dn, "(objectClass=*)", search_scope=ldap3.BASE, attributes=[])
        if not found and conn.result.get("description") not in ("noSuchObject", "success"):
            raise LDAPException(str(conn.result.get("description")))
        return bool(found and conn.entries)
    finally:
        _release(conn)


async def ldap_entry_exists(config: LdapConfig, dn: str) -> bool:
    """Whether the directory still has an entry at `dn`; DirectoryUnavailable when it could
    not say (the password it had just taken is not counted as wrong)."""
    try:
        return await asyncio.to_thread(_entry_exists_sync, config, dn)
    except LDAPInvalidDnError:
        # A recorded external id that is no DN (an admin set it): no entry of the directory
        # is this account's, and none may take it over. Held as existing: refused.
        return True
    except _DIRECTORY_FAILURES as exc:
        raise _unreachable(exc) from None


async def ldap_find(config: LdapConfig, login: str) -> LdapUser | None:
    """The one directory entry `login` names (by the user filter, as the service account
    sees it); None when there is none or more than one. DirectoryUnavailable when the
    directory could not say."""
    if not login or not config.url or not config.base_dn:
        return None
    try:
        return await asyncio.to_thread(_find_sync, config, login)
    except _DIRECTORY_FAILURES as exc:
        raise _unreachable(exc) from None


async def ldap_password_binds(config: LdapConfig, entry: LdapUser, password: str) -> bool:
    """Whether `password` binds as `entry`. An empty one never does: many servers take an
    empty password as an unauthenticated bind, and let it succeed. DirectoryUnavailable
    when the directory could not say."""
    if not password:
        return False
    try:
        return await asyncio.to_thread(_binds_sync, config, entry.dn, password)
    except _DIRECTORY_FAILURES as exc:
        raise _unreachable(exc) from None


async def ldap_authenticate(config: LdapConfig, login: str, password: str) -> LdapUser | None:
    """The directory entry for `login` when `password` binds as it; None otherwise."""
    if not password:
        return None
    found = await ldap_find(config, login)
    if found is None or not await ldap_password_binds(config, found, password):
        return None
    return found
