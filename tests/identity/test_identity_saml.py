"""SAML: pysaml2 acting as the identity provider in the test (signing with xmlsec1), against the
service's /saml/metadata, /saml/login (redirect binding, RelayState) and /saml/acs (POST).
Tampered, unsigned, wrongly signed, expired, wrong-audience, unsolicited and replayed responses
are refused; a good one starts the admin session with the mapped role."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from http.cookies import Morsel
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
import orjson
import pytest
from identity_support import WHOAMI, Running, running, settings_for
from multidict import CIMultiDict
from saml2 import s_utils
from self_signed import key_and_cert

from gateway.identity import saml
from gateway.identity.saml import binding_cookie

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # pysaml2's import-time deprecation warnings
    from saml2 import BINDING_HTTP_REDIRECT
    from saml2.config import IdPConfig
    from saml2.metadata import create_metadata_string
    from saml2.saml import NAMEID_FORMAT_UNSPECIFIED, NameID
    from saml2.server import Server

pytestmark = [
    pytest.mark.filterwarnings("ignore::asyncpg.InterfaceWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:saml2.*"),
    pytest.mark.skipif(shutil.which("xmlsec1") is None, reason="xmlsec1 is not installed"),
]

ROOT = "https://svc.example.test"
SP_ENTITY = f"{ROOT}/saml/metadata"
ACS = f"{ROOT}/saml/acs"
IDP_ENTITY = "https://idp.example.test/idp"
SSO = "https://idp.example.test/sso"
AUTHN = {"class_ref": "urn:oasis:names:tc:SAML:2.0:ac:classes:PasswordProtectedTransport"}


@dataclass
class Keys:
    dir: Path
    sp_key: str
    sp_cert: str
    idp_key: Path
    idp_cert: Path
    rogue_key: Path
    rogue_cert: Path


@pytest.fixture(scope="module")
def keys() -> Iterator[Keys]:
    with tempfile.TemporaryDirectory(prefix="svc-saml-test-") as tmp:
        root = Path(tmp)
        sp_key, sp_cert = key_and_cert("svc sp")
        paths = []
        for label in ("idp", "rogue"):
            k, c = key_and_cert(label)
            (root / f"{label}.key").write_text(k)
            (root / f"{label}.crt").write_text(c)
            paths += [root / f"{label}.key", root / f"{label}.crt"]
        yield Keys(root, sp_key, sp_cert, *paths)


def idp_server(
    keys: Keys,
    sp_metadata: str | None,
    *,
    rogue: bool = False,
    lifetime_min: int = 15,
    also_trust: str | None = None,
) -> Server:
    """The test's IdP. `also_trust`: a second SP entity id known to the IdP, with our SP's
    metadata but that id (to mint a response whose audience is someone else)."""
    inline = [sp_metadata] if sp_metadata else []
    if sp_metadata and also_trust:
        inline.append(sp_metadata.replace(SP_ENTITY, also_trust))
    config = IdPConfig()
    config.load(
        {
            "entityid": IDP_ENTITY,
            "xmlsec_binary": shutil.which("xmlsec1"),
            "key_file": str(keys.rogue_key if rogue else keys.idp_key),
            "cert_file": str(keys.rogue_cert if rogue else keys.idp_cert),
            "metadata": {"inline": inline} if inline else {},
            "service": {
                "idp": {
                    "endpoints": {"single_sign_on_service": [(SSO, BINDING_HTTP_REDIRECT)]},
                    "name_id_format": [NAMEID_FORMAT_UNSPECIFIED],
                    "policy": {"default": {"lifetime": {"minutes": lifetime_min}}},
                }
            },
        }
    )
    return Server(config=config)


def idp_metadata(keys: Keys) -> str:
    server = idp_server(keys, None)
    return str(create_metadata_string(None, server.config).decode())


class Flow:
    """A browser's round: /saml/login, the IdP's answer, the POST to /saml/acs. The binding
    cookie of each login started is sent with every POST, as the browser that started them
    would (the test talks plain http to the service, so no cookie jar would send a Secure
    cookie by itself)."""

    def __init__(self, svc: Running, idp: Server) -> None:
        self.svc = svc
        self.idp = idp
        self.bindings: dict[str, Morsel[str]] = {}
        """Per request id, the cookie /saml/login set for it."""

    async def start(self, next_path: str = "/dashboard") -> tuple[str, str]:
        async with self.svc.http.get(
            self.svc.url(f"/saml/login?next={next_path}"), allow_redirects=False
        ) as resp:
            assert resp.status == 302, await resp.text()
            location = resp.headers["Location"]
            (binding,) = resp.cookies.values()
        assert location.startswith(SSO)
        query = parse_qs(urlsplit(location).query)
        request = self.idp.parse_authn_request(query["SAMLRequest"][0], BINDING_HTTP_REDIRECT)
        request_id = str(request.message.id)
        self.bindings[request_id] = binding
        return request_id, query["RelayState"][0]

    def response(
        self,
        request_id: str,
        *,
        user: str = "alice",
        groups: tuple[str, ...] = ("svc-admins",),
        sign: bool = True,
        audience: str = SP_ENTITY,
        idp: Server | None = None,
    ) -> str:
        server = idp or self.idp
        resp = server.create_authn_response(
            identity={"groups": list(groups), "mail": [f"{user}@example.test"]},
            in_response_to=request_id,
            destination=ACS,
            sp_entity_id=audience,
            name_id=NameID(format=NAMEID_FORMAT_UNSPECIFIED, text=user),
            authn=AUTHN,
            sign_response=sign,
            sign_assertion=sign,
        )
        return str(resp)

    async def post(
        self,
        xml: str,
        relay: str,
        session: aiohttp.ClientSession | None = None,
        *,
        bindings: Sequence[str] | None = None,
    ) -> tuple[int, Any, CIMultiDict[str]]:
        """POST a response with the binding cookies of `bindings` (request ids; all started
        logins by default)."""
        form = {"SAMLResponse": base64.b64encode(xml.encode()).decode(), "RelayState": relay}
        chosen = self.bindings if bindings is None else {r: self.bindings[r] for r in bindings}
        cookie = "; ".join(f"{m.key}={m.value}" for m in chosen.values())
        client = session or self.svc.http
        async with client.post(
            self.svc.url("/saml/acs"),
            data=form,
            headers={"Cookie": cookie} if cookie else {},
            allow_redirects=False,
        ) as r:
            body = await r.text()
            return r.status, body, r.headers.copy()


async def configured(svc: Running) -> tuple[str, Server]:
    key = await svc.issue_key()
    status, _, _ = await svc.request(
        "PUT", "/v1/admin/identity/secrets/saml/sp_key", key, json={"value": svc_sp_key[0]}
    )
    assert status == 204
    async with svc.http.get(svc.url("/saml/metadata")) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("application/samlmetadata+xml")
        metadata = await resp.text()
    assert SP_ENTITY in metadata and ACS in metadata
    return key, metadata


svc_sp_key: list[str] = []


def saml_settings(database_url: str, keys: Keys) -> dict[str, str]:
    svc_sp_key[:] = [keys.sp_key]
    return {
        "SVC_SAML_ENABLED": "1",
        "SVC_SAML_ROOT_URL": ROOT,
        "SVC_SAML_IDP_METADATA": idp_metadata(keys),
        "SVC_SAML_SP_CERT": keys.sp_cert,
        "SVC_SAML_ROLE_MAPPINGS": orjson.dumps({"svc-admins": "admin", "ops": "operator"}).decode(),
        "SVC_SAML_DEFAULT_ROLE": "member",
    }


async def test_saml_login_and_hostile_responses(
    database_url: str, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running(settings_for(database_url, **saml_settings(database_url, keys))) as svc:
        api_key, sp_metadata = await configured(svc)
        flow = Flow(svc, idp_server(keys, sp_metadata))

        request_id, relay = await flow.start("/dashboard")
        assert relay == "/dashboard"
        good = flow.response(request_id)
        jar = aiohttp.CookieJar(unsafe=True)
        async with aiohttp.ClientSession(cookie_jar=jar) as browser:
            status, body, headers = await flow.post(good, relay, browser)
            assert status == 303, body
            assert headers["Location"] == "/dashboard"
            status, who, _ = await svc.request("GET", WHOAMI, session=browser)
            assert status == 200 and who["auth"] == "session"
            assert "admin:write" in who["scopes"]

        # The same response again: refused (its request is consumed, its assertion used).
        status, body, _ = await flow.post(good, relay)
        assert status == 401 and "no outstanding request" in body

        hostile: dict[str, Any] = {}
        rid, _ = await flow.start()
        hostile["unsigned"] = (flow.response(rid, sign=False), rid)
        rid, _ = await flow.start()
        tampered = flow.response(rid, user="bob").replace(">bob<", ">root<")
        assert ">root<" in tampered
        hostile["tampered"] = (tampered, rid)
        rid, _ = await flow.start()
        rogue = idp_server(keys, sp_metadata, rogue=True)
        hostile["signed by another key"] = (flow.response(rid, idp=rogue), rid)
        rid, _ = await flow.start()
        expired = idp_server(keys, sp_metadata, lifetime_min=-10)
        hostile["expired"] = (flow.response(rid, idp=expired), rid)
        rid, _ = await flow.start()
        other = idp_server(keys, sp_metadata, also_trust="https://other.example")
        wrong = flow.response(rid, audience="https://other.example", idp=other)
        assert "https://other.example" in wrong
        hostile["wrong audience"] = (wrong, rid)
        rid, _ = await flow.start()
        elsewhere = flow.idp.create_authn_response(
            identity={"groups": ["svc-admins"]},
            in_response_to=rid,
            destination="https://other-sp.example/saml/acs",
            sp_entity_id=SP_ENTITY,
            name_id=NameID(format=NAMEID_FORMAT_UNSPECIFIED, text="mallory"),
            authn=AUTHN,
            sign_response=False,
            sign_assertion=True,
        )
        # The assertion names another ACS; the unsigned response around it drops its
        # Destination, which pysaml2 checks only when present.
        elsewhere = re.sub(r'(<ns\d:Response[^>]*?) Destination="[^"]+"', r"\1", str(elsewhere))
        assert 'Recipient="https://other-sp.example/saml/acs"' in elsewhere
        hostile["assertion for another recipient"] = (elsewhere, rid)
        hostile["unsolicited"] = (flow.response("id-nobody-asked-for"), "x")
        # Even with a binding cookie for it: the service never issued that request.
        forged: Morsel[str] = Morsel()
        forged.set(binding_cookie("id-nobody-asked-for"), "1", "1")
        flow.bindings["id-nobody-asked-for"] = forged
        # Each refusal says why, for the person setting the IdP up (QA finding: "SAML
        # response refused" alone, and a bare exception class in the log).
        said = {
            "signed by another key": "signature does not verify",
            "expired": "outside its validity window",
            "wrong audience": f"its audience is not {SP_ENTITY}",
            "unsolicited": "no outstanding request",
        }
        for case, (xml, _) in hostile.items():
            status, body, _ = await flow.post(xml, "/")
            assert status == 401, (case, body)
            assert '"unauthorized"' in body, case
            assert said.get(case, "SAML response refused") in body, (case, body)
            # Each is refused for its own fault, not for a missing binding cookie.
            assert "did not start the sign-in" not in body, case
        for garbage in (
            base64.b64encode(b"<not xml").decode(),
            "%%%",
            base64.b64encode(b'<foo InResponseTo="x"/>').decode(),  # XML, but no Response
        ):
            status, body, _ = await flow.post(garbage, "/")
            assert status == 401 and "not a base64-encoded SAML response" in body, body

        # Only the good login provisioned a user; groups mapped to the admin role.
        status, users, _ = await svc.request("GET", "/v1/admin/users", api_key)
        assert [(u["user_name"], u["roles"], u["source"]) for u in users["items"]] == [
            ("alice", ["admin"], "saml")
        ]

        # An assertion an IdP hands out twice, each time in answer to a request of ours:
        # its second use is refused, though its request is outstanding.
        first, _ = await flow.start()
        second, _ = await flow.start()
        monkeypatch.setattr(s_utils, "sid", lambda: "_one-assertion-id")
        twice = [flow.response(first), flow.response(second)]
        monkeypatch.undo()
        assert all('ID="_one-assertion-id"' in xml for xml in twice)
        assert (await flow.post(twice[0], "/"))[0] == 303
        status, body, _ = await flow.post(twice[1], "/")
        assert status == 401 and "assertion already used" in body, body


async def test_saml_response_is_bound_to_the_browser_that_started_it(
    database_url: str, keys: Keys
) -> None:
    """Login CSRF: a response obtained by one person, posted from another's browser, must
    not sign that browser in."""
    async with running(settings_for(database_url, **saml_settings(database_url, keys))) as svc:
        _, sp_metadata = await configured(svc)
        flow = Flow(svc, idp_server(keys, sp_metadata))
        other_id, _ = await flow.start()
        request_id, relay = await flow.start()
        binding = flow.bindings[request_id]
        assert binding.key.startswith("svc_saml_") and binding["max-age"] == "600"
        assert binding["path"] == "/saml/acs" and binding["samesite"] == "None"
        assert binding["secure"] and binding["httponly"]

        attackers = flow.response(request_id, user="mallory")
        for bindings in ([], [other_id]):  # no cookie, or the cookie of another sign-in
            status, body, _ = await flow.post(attackers, relay, bindings=bindings)
            assert status == 401, body
            assert "did not start the sign-in" in body and '"unauthorized"' in body
        # The browser that started it signs in, and its binding cookie is cleared.
        status, body, headers = await flow.post(attackers, relay, bindings=[request_id])
        assert status == 303, body
        cleared = [c for c in headers.getall("Set-Cookie") if c.startswith(binding.key + "=")]
        assert cleared and "Max-Age=0" in cleared[0]


async def test_saml_role_mapping_default_and_safe_relay_state(
    database_url: str, keys: Keys
) -> None:
    async with running(settings_for(database_url, **saml_settings(database_url, keys))) as svc:
        _, sp_metadata = await configured(svc)
        flow = Flow(svc, idp_server(keys, sp_metadata))
        rid, relay = await flow.start("//evil.example/steal")
        assert relay == "/"
        status, _, headers = await flow.post(
            flow.response(rid, user="olga", groups=("ops",)), relay
        )
        assert status == 303 and headers["Location"] == "/"
        rid, relay = await flow.start()
        status, _, _ = await flow.post(flow.response(rid, user="max", groups=("misc",)), relay)
        assert status == 303
        key = await svc.issue_key()
        status, users, _ = await svc.request("GET", "/v1/admin/users", key)
        roles = {u["user_name"]: u["roles"] for u in users["items"]}
        assert roles == {"olga": ["operator"], "max": ["member"]}


async def test_an_account_is_not_renamed_onto_another_subject(
    database_url: str, keys: Keys
) -> None:
    async with running(settings_for(database_url, **saml_settings(database_url, keys))) as svc:
        key, sp_metadata = await configured(svc)
        flow = Flow(svc, idp_server(keys, sp_metadata))
        rid, relay = await flow.start()
        status, _, _ = await flow.post(flow.response(rid, user="olga", groups=("misc",)), relay)
        assert status == 303
        status, users, _ = await svc.request("GET", "/v1/admin/users", key)
        (olga,) = users["items"]
        # Renamed onto max's subject, olga's account (her sessions, her keys) would receive
        # max's roles at max's next sign-in: a user with write on users could rename herself.
        for change in ({"user_name": "max"}, {"external_id": "max"}):
            status, body, _ = await svc.request(
                "PATCH", f"/v1/admin/users/{olga['id']}", key, json=change
            )
            assert (status, body["error"]["code"]) == (409, "external_account"), body
        rid, relay = await flow.start()
        status, body, _ = await flow.post(flow.response(rid, user="max"), relay)
        assert status == 303, body  # max's own account
        status, after, _ = await svc.request("GET", f"/v1/admin/users/{olga['id']}", key)
        assert after["user_name"] == "olga" and after["roles"] == ["member"]


async def test_a_saml_sign_in_keeps_what_scim_provisioned(database_url: str, keys: Keys) -> None:
    """SCIM owns the profile of the users it provisioned: a SAML sign-in (whose assertion
    carries only a NameID, a mail and groups) brings roles, and leaves the externalId, by
    which the SCIM client finds the user again, and the names as SCIM set them."""
    async with running(settings_for(database_url, **saml_settings(database_url, keys))) as svc:
        key, sp_metadata = await configured(svc)
        flow = Flow(svc, idp_server(keys, sp_metadata))
        status, body, _ = await svc.request(
            "POST", "/v1/admin/scim/token", key, json={"action": "issue"}
        )
        token = body["token"]
        provisioned = {
            "schemas": ["urn:ietf:params:scim:schemas:core:2.0:User"],
            "userName": "sam",
            "externalId": "00u-okta-123",
            "name": {"givenName": "Sam", "familyName": "Smith"},
            "displayName": "Sam Smith",
            "emails": [{"value": "sam@corp.test", "primary": True, "type": "work"}],
        }
        status, created, _ = await svc.request("POST", "/scim/v2/Users", token, json=provisioned)
        assert status == 201, created

        # Names the user lookup folds together, which the IdP holds for other subjects
        # (review finding: they signed in to sam's account).
        for look_alike in ("\uff53\uff41\uff4d", "\u017fam"):  # full-width; long s
            rid, relay = await flow.start()
            status, body, _ = await flow.post(flow.response(rid, user=look_alike), relay)
            assert status == 401, (look_alike, body)
        # Refused after the IdP vouched for them: on record, as a refused password login is.
        status, audit, _ = await svc.request(
            "GET", "/v1/admin/audit?action=identity.login_failed", key
        )
        assert status == 200
        refused = sorted((i["user_name"], i["detail"]["reason"]) for i in audit["items"])
        assert refused == sorted(
            (name, "sign_in_failed: unauthorized") for name in ("\uff53\uff41\uff4d", "\u017fam")
        ), refused
        rid, relay = await flow.start()
        status, body, _ = await flow.post(flow.response(rid, user="sam"), relay)
        assert status == 303, body

        status, after, _ = await svc.request("GET", f"/scim/v2/Users/{created['id']}", token)
        assert status == 200
        for field in ("externalId", "name", "displayName", "emails"):
            assert after[field] == created[field], field
        status, users, _ = await svc.request("GET", "/v1/admin/users", key)
        assert [(u["user_name"], u["roles"]) for u in users["items"]] == [("sam", ["admin"])]

        # With SAML on, an IdP's user signs in through it: a password set here (by whoever
        # may manage the account while it has no roles yet) would outlive what the IdP says.
        path = f"/v1/admin/users/{created['id']}/password"
        status, body, _ = await svc.request("PUT", path, key, json={"password": "set-here-12345"})
        assert (status, body["error"]["code"]) == (409, "external_account"), body
        patch = {
            "schemas": ["urn:ietf:params:scim:api:messages:2.0:PatchOp"],
            "Operations": [{"op": "replace", "path": "password", "value": "from-the-idp-1"}],
        }
        status, body, _ = await svc.request(
            "PATCH", f"/scim/v2/Users/{created['id']}", token, json=patch
        )
        assert status == 200, body  # the IdP's to set; never a way in while SAML is on
        status, body, browser = await svc.login("sam", "from-the-idp-1")
        await browser.close()
        assert status == 401, body


async def test_saml_disabled_is_501(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        status, body, _ = await svc.request("GET", "/saml/metadata")
        assert status == 501 and body["error"]["code"] == "feature_disabled"


async def test_saml_without_xmlsec1_is_503_saying_what_to_install(
    database_url: str, keys: Keys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pysaml2 checks signatures with the xmlsec1 program; a gateway without it says so on
    every SAML route, as configuration to fix, instead of failing inside pysaml2 (a 500)."""
    async with running(settings_for(database_url, **saml_settings(database_url, keys))) as svc:
        key = await svc.issue_key()
        status, _, _ = await svc.request(
            "PUT", "/v1/admin/identity/secrets/saml/sp_key", key, json={"value": keys.sp_key}
        )
        assert status == 204
        monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no xmlsec1 on it
        for method, path, form in (
            ("GET", "/saml/metadata", None),
            ("GET", "/saml/login?next=/", None),
            ("POST", "/saml/acs", {"SAMLResponse": "PHNhbWw+", "RelayState": "/"}),
        ):
            status, body, _ = await svc.request(method, path, data=form)
            assert status == 503, (path, body)
            assert body["error"]["code"] == "saml_not_configured", path
            assert "apt-get install xmlsec1" in body["error"]["message"], path


def _part(headers: bytes, value: bytes = b"PHNhbWw+") -> bytes:
    return b"--b\r\n" + headers + b"\r\n\r\n" + value + b"\r\n--b--\r\n"


NAMED = b'Content-Disposition: form-data; name="SAMLResponse"'
UNREADABLE_ACS_BODIES = {
    "invalid UTF-8": ("application/x-www-form-urlencoded", b"SAMLResponse=\xff\xfe&RelayState=/"),
    "unknown charset": ("application/x-www-form-urlencoded; charset=bogus", b"SAMLResponse=x"),
    "multipart without boundary": ("multipart/form-data", _part(NAMED)),
    "broken part header": ("multipart/form-data; boundary=b", _part(b"no colon here")),
    "no starting boundary": ("multipart/form-data; boundary=b", b"SAMLResponse=x"),
    "unknown part charset": (
        "multipart/form-data; boundary=b",
        _part(NAMED + b"\r\nContent-Type: text/plain; charset=bogus"),
    ),
    "unknown transfer encoding": (
        "multipart/form-data; boundary=b",
        _part(NAMED + b"\r\nContent-Transfer-Encoding: bogus"),
    ),
}


async def test_unreadable_acs_forms_are_400(database_url: str, keys: Keys) -> None:
    """A body that is no readable form is the client's mistake: a 400 in the envelope."""
    async with running(settings_for(database_url, **saml_settings(database_url, keys))) as svc:
        await configured(svc)
        for case, (content_type, body) in UNREADABLE_ACS_BODIES.items():
            async with svc.http.post(
                svc.url("/saml/acs"),
                data=body,
                headers={"Content-Type": content_type},
                allow_redirects=False,
            ) as resp:
                status, err = resp.status, await resp.json(content_type=None)
            assert status == 400, (case, err)
            assert set(err["error"]) == {"message", "type", "code"}, case
            assert err["error"]["code"] == "invalid_request", case
            assert err["error"]["message"].startswith("malformed form body"), case


def test_key_directories_of_ended_processes_are_swept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process killed while it held the SP key leaves its directory behind; the next one to
    write the key removes it, and never a directory of a process still running."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, check=True, text=True)  # fmt: skip
    ended_pid = int(ended.stdout)
    dirs = {pid: tmp_path / f"svc-saml-{pid}-abc" for pid in (ended_pid, os.getpid(), os.getppid())}
    for path in dirs.values():
        path.mkdir()
        (path / "sp.key").write_text("secret")
    unrelated = tmp_path / "svc-saml-notapid-x"
    unrelated.mkdir()

    saml._sweep_orphaned_key_dirs()

    assert not dirs[ended_pid].exists()
    assert dirs[os.getpid()].exists() and dirs[os.getppid()].exists()
    assert unrelated.exists()


async def test_unusable_saml_keys_and_settings_are_refused_when_set(
    database_url: str, keys: Keys
) -> None:
    """QA finding: a key secret that was no PEM key, and a certificate or metadata that did
    not parse, were taken when set; every SAML route then answered 500."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        secret = "/v1/admin/identity/secrets/saml/sp_key"
        for value in ("not a pem", keys.sp_cert):
            status, body, _ = await svc.request("PUT", secret, key, json={"value": value})
            assert status == 400 and body["error"]["code"] == "invalid_secret", body
            assert "not a PEM private key" in body["error"]["message"], body
            assert value not in body["error"]["message"], body  # a secret is never quoted
        status, body, _ = await svc.request(
            "PUT", "/v1/admin/identity/secrets/saml/nope", key, json={"value": "x"}
        )
        assert status == 404 and "the secrets are ldap/bind_password, saml/sp_key" in str(body)
        refused = {
            "SVC_SAML_SP_CERT": keys.sp_key,  # a key where the certificate goes
            "SVC_SAML_IDP_METADATA": "<not xml",
            "SVC_OIDC_AUDIENCE": " ",  # read as blank, which turned the audience check off
        }
        for name, value in refused.items():
            status, body, _ = await svc.request(
                "PUT", f"/v1/admin/settings/{name}", key, json={"value": value}
            )
            assert status == 400 and body["error"]["code"] == "invalid_setting_value", body
        for name, value in (
            ("SVC_SAML_SP_CERT", keys.sp_cert),
            ("SVC_SAML_IDP_METADATA", idp_metadata(keys)),
        ):
            status, body, _ = await svc.request(
                "PUT", f"/v1/admin/settings/{name}", key, json={"value": value}
            )
            assert status == 200, body


async def test_a_key_of_another_pair_is_warned_of_not_refused(
    database_url: str, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    """The SP key only decrypts assertions (requests go unsigned): a certificate renewed
    without its key still serves an IdP that does not encrypt, and the log says what an
    encrypting one will meet (review finding: refusing it broke working setups)."""
    async with running(settings_for(database_url, **saml_settings(database_url, keys))) as svc:
        key = await svc.issue_key()
        other_pair = keys.rogue_key.read_text()
        status, body, _ = await svc.request(
            "PUT", "/v1/admin/identity/secrets/saml/sp_key", key, json={"value": other_pair}
        )
        assert status == 204, body
        status, _, _ = await svc.request("GET", "/saml/metadata")
        assert status == 200
        assert any("not the private key of SVC_SAML_SP_CERT" in r.message for r in caplog.records)
        for bundle in (other_pair + keys.sp_key, keys.sp_cert + keys.sp_cert):
            path = "/v1/admin/identity/secrets/saml/sp_key"
            if "CERTIFICATE" in bundle:
                path = "/v1/admin/settings/SVC_SAML_SP_CERT"
            status, body, _ = await svc.request("PUT", path, key, json={"value": bundle})
            assert status == 400, (path, body)  # one of each, as the QA walk found
            assert "PRIVATE KEY" not in json.dumps(body), body


@pytest.mark.parametrize(
    ("not_before", "not_on_or_after", "said"),
    [
        # Review finding: the end of the calendar plus the skew overflowed (a 500).
        ("9999-12-31T23:59:59Z", "9999-12-31T23:59:30Z", "outside its validity window"),
        ("0001-01-01T00:00:00Z", "0001-01-01T00:00:10Z", "outside its validity window"),
        ("2020-01-01T00:00:00Z", "2020-01-01T00:05:00Z", "outside its validity window"),
        ("not a time", "2999-01-01T00:00:00Z", "its conditions do not hold"),
        ("2020-01-01T00:00:00Z", "2999-01-01T00:00:00Z", "its conditions do not hold"),
    ],
)
def test_a_failed_condition_is_named_whatever_its_times(
    not_before: str, not_on_or_after: str, said: str
) -> None:
    xml = (
        '<samlp:Response xmlns:samlp="urn:oasis:names:tc:SAML:2.0:protocol" '
        'xmlns:saml="urn:oasis:names:tc:SAML:2.0:assertion"><saml:Assertion>'
        f'<saml:Conditions NotBefore="{not_before}" NotOnOrAfter="{not_on_or_after}">'
        f"<saml:AudienceRestriction><saml:Audience>{SP_ENTITY}</saml:Audience>"
        "</saml:AudienceRestriction></saml:Conditions></saml:Assertion></samlp:Response>"
    )
    encoded = base64.b64encode(xml.encode()).decode()
    assert said in saml._failed_condition(encoded, SP_ENTITY)


async def test_a_certificate_chain_from_the_environment_still_serves(
    database_url: str, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    """Review finding: the set-time rule (one certificate) also ran where SAML is set up, so
    a chain in the environment, which pysaml2 reads by its first certificate, made every
    SAML route 503 where it had worked."""
    env = saml_settings(database_url, keys)
    env["SVC_SAML_SP_CERT"] = keys.sp_cert + keys.rogue_cert.read_text()
    async with running(settings_for(database_url, **env)) as svc:
        await configured(svc)
        status, _, _ = await svc.request("GET", "/saml/metadata")
        assert status == 200
        assert any("its first certificate is used" in r.message for r in caplog.records)
