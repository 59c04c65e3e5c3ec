# ruff: noqa: E501  (effect texts are transcribed from the spec verbatim)
"""The operator settings catalog: every key of the spec's catalog plus SVC's own operational keys.

Each key is a frozen `SettingSpec`: type, default, apply mode (R = at startup, L = live,
"" = not stated by the spec, treated as R), secret flag, validation and effect text. The spec
states a total of 138 settings but lists only some of them; this catalog holds every key the spec
shows (tables and the keys its text names), and nothing it does not show, plus the operational
keys this implementation needs (group "Operations").

`parse(spec, raw)` turns a raw string into the typed value or raises `InvalidInput` naming the
expected type or choices. Raw strings are what is stored (env, env file, settings events).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal

from schemas.errors import NOT_REPEATED, InvalidInput, NotFound, closest, echoed, secret_shaped
from schemas.setting_rules import RULE_PROBLEMS, TEXT_RULES, TextRule
from schemas.text import is_utf8

SettingType = Literal["bool", "int", "text", "enum", "duration"]
ApplyMode = Literal["R", "L", ""]
BoolMode = Literal["standard", "exactly_one", "off_disables"]
SettingValue = bool | int | float | str | None

MASK = "********"
_TRUE = frozenset({"1", "true", "on", "yes"})
_FALSE = frozenset({"0", "false", "off", "no", ""})
# ASCII digits only: `\d` also matches other scripts' digits, and float()/int() read those
# and "1_0" too, so a value no other reader of the setting understands would be stored.
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ns|us|µs|ms|s|m|h)")
_INT_TEXT = re.compile(r"[+-]?[0-9]+")
_SPACES = " \t\r\n\f\v"
"""What may surround an int or a duration (dropped, as around a choice): ASCII whitespace,
so a value from a YAML block or a printf keeps its line end harmlessly."""
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_INT_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class SettingSpec:
    key: str
    group: str
    type: SettingType
    default: str
    apply: ApplyMode
    effect: str
    secret: bool = False
    choices: tuple[str, ...] = ()
    min_value: float | None = None
    max_value: float | None = None
    bool_mode: BoolMode = "standard"
    numeric_text: bool = False
    networks: bool = False
    """Text holding a comma list of IP networks (CIDR) or addresses; blank = none."""
    rule: TextRule | None = None
    """A shape the text must have (schemas/setting_rules.py)."""
    new_rule: TextRule | None = None
    """A shape a value must have when it is given (set, or read from the environment), on
    top of `rule`. Not asked of a stored value loaded at start: one stored before the check
    existed still applies, its problems told where it is used, rather than be dropped for
    the default (for a role mapping: every directory user's roles taken away)."""
    set_rule: TextRule | None = None
    """A shape a value must have when it is set (`svc settings set`, the admin API), not
    when read from the environment: a value there that worked before the check still
    starts the service, its problems told where it is used."""
    coerce_invalid_to: str | None = None
    from_env: bool = True
    storable: bool = True
    note: str = ""

    @property
    def live(self) -> bool:
        return self.apply == "L"

    def expected(self) -> str:
        """Human description of what a valid value looks like, for error messages."""
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.type == "bool":
            return _BOOL_EXPECTED[self.bool_mode]
        if self.type == "int":
            return f"an integer from {_fmt(self.min_value)} to {_fmt(self.max_value)}"
        if self.type == "duration":
            return "a duration such as 1500ms, 30s, 5m or 6h (0 or blank = off)"
        if self.numeric_text:
            lo, hi = _fmt(self.min_value), _fmt(self.max_value)
            return f"blank or a number from {lo} to {hi}"
        if self.networks:
            return "blank or a comma list of IP addresses or CIDR networks, e.g. 10.0.0.0/8,::1"
        rule = self.set_rule or self.new_rule or self.rule
        if rule is not None:
            return TEXT_RULES[rule][1]
        return "text"


_BOOL_EXPECTED: dict[BoolMode, str] = {
    "standard": "a boolean: 1/0, true/false, on/off, yes/no",
    "exactly_one": "1 to enable (exactly 1; true or on leave it off) or 0",
    "off_disables": "off to disable; any other value enables",
}


def _fmt(bound: float | None) -> str:
    if bound is None:
        return "any"
    return str(int(bound)) if float(bound).is_integer() else str(bound)


# Possessive: a value of many slashes after a colon (`a:////...`) backtracked quadratically.
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*+:/++)?.*@", re.DOTALL)
"""A scheme if any, then everything to the last @ (a password may hold @, / or a line
break): a URL given without its `//` (`user:pw@host`, `https:/user:pw@host`) included."""


_QUOTED_CHARS = 120
"""The most of a refused value a message quotes (a 100 KB one was said back whole)."""


def _quoted_short(value: str) -> str:
    if secret_shaped(value):  # a key pasted into the wrong setting is not said back
        return NOT_REPEATED
    if len(value) <= _QUOTED_CHARS:
        return repr(value)
    return f"{value[:_QUOTED_CHARS]!r}... ({len(value):,} characters)"


def _invalid(spec: SettingSpec, raw: str) -> InvalidInput:
    # A refused URL may hold a password (refused for that very reason): never quoted back.
    masked = _USERINFO.sub(r"\1***@", raw)
    shown = "(secret value)" if spec.secret else _quoted_short(masked)
    rule = spec.set_rule or spec.new_rule or spec.rule
    said = RULE_PROBLEMS[rule](raw) if rule in RULE_PROBLEMS else None
    wrong = f"{said}; " if said else ""
    return InvalidInput(
        f"invalid value {shown} for {spec.key}: {wrong}expected {spec.expected()}",
        code="invalid_setting_value",
    )


def dialect_surprise(spec: SettingSpec, raw: str) -> str | None:
    """What a boolean of the spec's own dialect makes of a word that means the opposite in
    every other boolean (`true` leaves SVC_MCP_PUBLISH off; `false` leaves SVC_MODERATION
    on): valid, so stored, but said where it is set. None for any other value."""
    value = raw.strip().lower()
    if spec.bool_mode == "exactly_one" and value in _TRUE and value != "1":
        return f"only exactly 1 turns {spec.key} on: {raw.strip()!r} leaves it off"
    if spec.bool_mode == "off_disables" and value in _FALSE and value != "off":
        return f"only off turns {spec.key} off: {raw.strip()!r} leaves it on"
    return None


def _parse_bool(spec: SettingSpec, raw: str) -> bool:
    value = raw.strip().lower()
    if spec.bool_mode == "exactly_one":
        return value == "1"
    if spec.bool_mode == "off_disables":
        return value != "off"
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise _invalid(spec, raw)


def _parse_int(spec: SettingSpec, raw: str) -> int:
    text = raw.strip(_SPACES)
    if not _INT_TEXT.fullmatch(text):
        raise _invalid(spec, raw)
    try:
        value = int(text)
    except ValueError:  # more digits than int() converts: far past any bound anyway
        raise _invalid(spec, raw) from None
    if spec.min_value is not None and value < spec.min_value:
        raise _invalid(spec, raw)
    if spec.max_value is not None and value > spec.max_value:
        raise _invalid(spec, raw)
    return value


def parse_duration(raw: str) -> float | None:
    """Go-style duration ("1500ms", "1h30m", "0") to seconds; blank or zero means off (None)."""
    text = raw.strip(_SPACES)
    if text in ("", "0"):
        return None
    pos, total = 0, 0.0
    for match in _DURATION_PART.finditer(text):
        if match.start() != pos:
            raise ValueError(text)
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if pos != len(text):
        raise ValueError(text)
    return total or None


def _parse_numeric_text(spec: SettingSpec, raw: str) -> str:
    text = raw.strip()
    if not text:
        return ""
    try:
        value = float(text)
    except ValueError:
        raise _invalid(spec, raw) from None
    low = spec.min_value if spec.min_value is not None else value
    high = spec.max_value if spec.max_value is not None else value
    if not low <= value <= high:
        raise _invalid(spec, raw)
    return text


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@lru_cache(maxsize=16)  # read on every request that needs the client's address
def parse_networks(raw: str) -> tuple[Network, ...]:
    """`10.0.0.0/8, 192.168.1.7, ::1` -> networks (an address is its own /32 or /128);
    ValueError names the first item that is neither."""
    out: list[Network] = []
    for item in raw.split(","):
        text = item.strip()
        if text:
            out.append(ipaddress.ip_network(text, strict=False))
    return tuple(out)


MAX_STORED_CHARS = 100_000
"""The longest value `svc settings set` stores, secret or not (schemas/settings.py
SettingText). The environment has no such bound (inline IdP metadata may be longer)."""


def stored_text(spec: SettingSpec, raw: str, typed: SettingValue) -> str:
    """The text a valid `raw` is stored as: as it is read, so every reader of the stored
    value (the next start, another gateway, a listing) sees the same canonical text. A
    choice as the catalog spells it, an int as plain digits (" +007 " is "7"), a duration
    without the spaces around it; anything else exactly as given."""
    if spec.choices or spec.type == "int":
        return str(typed)
    if spec.type == "duration":
        return raw.strip(_SPACES)
    return raw


def parse(spec: SettingSpec, raw: str) -> SettingValue:
    """Validate `raw` for `spec` and return the typed value (bool, int, seconds or text)."""
    _check_storable(spec, raw)
    if spec.type == "bool":
        return _parse_bool(spec, raw)
    if spec.type == "int":
        return _parse_int(spec, raw)
    if spec.type == "duration":
        try:
            return parse_duration(raw)
        except ValueError:
            raise _invalid(spec, raw) from None
    if spec.choices:
        # Spaces around a choice and its case are forgiven, and dropped: " DEBUG" is "debug"
        # to every reader (an environment written LOG_LEVEL=DEBUG style stopped every command).
        choice = raw.strip().casefold()
        canonical = next((c for c in spec.choices if c.casefold() == choice), None)
        if canonical is None:
            raise _invalid(spec, raw)
        return canonical
    if spec.numeric_text:
        return _parse_numeric_text(spec, raw)
    if spec.networks:
        try:
            parse_networks(raw)
        except ValueError:
            raise _invalid(spec, raw) from None
    if spec.rule is not None and not TEXT_RULES[spec.rule][0](raw):
        raise _invalid(spec, raw)
    return raw


def _check_storable(spec: SettingSpec, raw: str) -> None:
    # Checked before the value goes anywhere, the secrets' vault included: PostgreSQL text
    # cannot hold a NUL.
    if "\x00" in raw:
        raise InvalidInput(
            f"invalid value for {spec.key}: a setting cannot hold a NUL character",
            code="invalid_setting_value",
        )


def check_stored_length(spec: SettingSpec, raw: str) -> None:
    """A value to store, secret or not, within MAX_STORED_CHARS (checked before the vault
    write: a secret's value never passes through SettingText's bound)."""
    if len(raw) > MAX_STORED_CHARS:
        raise InvalidInput(
            f"invalid value for {spec.key}: at most {MAX_STORED_CHARS:,} characters",
            code="invalid_setting_value",
        )


def check_given(spec: SettingSpec, raw: str) -> None:
    """`raw`, a value being given (set, or read from the environment), has the shape of
    `spec.new_rule` too, or InvalidInput saying what is expected; and no control character
    but line breaks and tabs (a prompt has lines), which no setting means and every listing
    would show (`en\x01US` for a locale). A value stored before the check still loads."""
    if spec.new_rule is not None and not TEXT_RULES[spec.new_rule][0](raw):
        raise _invalid(spec, raw)
    if any(_is_control(ch) for ch in raw):
        shown = "(secret value)" if spec.secret else "the value"
        raise InvalidInput(
            f"{shown} for {spec.key} holds a control character (other than a line break or a "
            "tab): remove it",
            code="invalid_setting_value",
        )


def check_set(spec: SettingSpec, raw: str) -> None:
    """`raw`, a value being set, has the shape of `spec.set_rule` too."""
    if spec.set_rule is not None and not TEXT_RULES[spec.set_rule][0](raw):
        raise _invalid(spec, raw)


def _is_control(ch: str) -> bool:
    code = ord(ch)
    return (code < 0x20 and ch not in "\t\n\r") or 0x7F <= code < 0xA0


def parse_or_coerce(spec: SettingSpec, raw: str) -> SettingValue:
    """Like `parse`, but a key whose spec says invalid values are coerced gets its fallback."""
    try:
        return parse(spec, raw)
    except InvalidInput:
        if spec.coerce_invalid_to is None:
            raise
        return parse(spec, spec.coerce_invalid_to)


def _s(key: str, group: str, type_: str, default: str, apply: str, effect: str) -> SettingSpec:
    kind: SettingType = "text" if type_ not in ("bool", "int", "enum", "duration") else type_  # type: ignore[assignment]
    mode: ApplyMode = apply if apply in ("R", "L") else ""  # type: ignore[assignment]
    bounds = (0.0, float(_INT_MAX)) if kind == "int" else (None, None)
    return SettingSpec(
        key, group, kind, default, mode, effect, min_value=bounds[0], max_value=bounds[1]
    )


# The spec's tables, transcribed key by key (brand words already neutralised by the spec;
# where its text put "the service" for the cloud speech recognizer's name, the CLOUDSTT
# keys' own name is used: "the cloud speech recognizer", engine cloudstt).
_SPEC_TABLES: tuple[SettingSpec, ...] = (
    _s(
        "SVC_PERSONAL_API_KEYS",
        "API",
        "bool",
        "1",
        "R",
        "value off disables personal-key authentication on the compatible endpoint; any other value enables",
    ),
    _s(
        "SVC_APPROVAL_TOOLS",
        "Agent",
        "text",
        "",
        "R",
        "comma list of tools whose calls need manual operator approval; empty = none",
    ),
    _s(
        "SVC_SUBAGENT_MAX_DEPTH",
        "Agent",
        "int",
        "2",
        "R",
        "max nesting depth of sub-agents (guards against infinite recursion)",
    ),
    _s("SVC_SUBAGENT_TIMEOUT_SEC", "Agent", "int", "180", "R", "max seconds for one sub-agent run"),
    _s(
        "SVC_TOOL_SEARCH",
        "Agent",
        "bool",
        "false",
        "",
        "advertise only core tools plus a search meta-tool; reveal the rest on demand",
    ),
    _s(
        "SVC_TOOL_SEARCH_CORE",
        "Agent",
        "text",
        "",
        "",
        "comma list of tool names always advertised in lazy mode",
    ),
    _s(
        "SVC_TOOL_SEARCH_THRESHOLD",
        "Agent",
        "int",
        "12",
        "",
        "defer only when more than this many tools pass the agent profile filter",
    ),
    _s(
        "SVC_AGENT_BEST_OF_N",
        "Agent - Reasoning",
        "int",
        "0",
        "",
        "0/1 off; 2 or more samples N candidates and a judge picks the best; costs N times generation",
    ),
    _s(
        "SVC_AGENT_JUDGE_PROMPT",
        "Agent - Reasoning",
        "text",
        "",
        "R",
        "override of the best-of-N judge prompt; blank = built-in",
    ),
    _s(
        "SVC_AGENT_DEBATE_N",
        "Agent - Reasoning",
        "int",
        "0",
        "",
        "0/1 off; 2 or more runs a debate panel of N candidates plus a judge",
    ),
    _s(
        "SVC_AGENT_DEBATE_PROMPT",
        "Agent - Reasoning",
        "text",
        "",
        "R",
        "override of the debate candidate prompt",
    ),
    _s(
        "SVC_AGENT_DEBATE_JUDGE_PROMPT",
        "Agent - Reasoning",
        "text",
        "",
        "R",
        "override of the debate judge prompt",
    ),
    _s("SVC_AGENT_DEBATE_ROUNDS", "Agent - Reasoning", "int", "1", "R", "number of debate rounds"),
    _s(
        "SVC_AGENT_PLAN_STEPS",
        "Agent - Reasoning",
        "int",
        "0",
        "",
        "above 0 = max steps of a separate planner, executor, synthesis pass; 0 disables; typical 4 to 8",
    ),
    _s(
        "SVC_AGENT_PLAN_STEP_ITERS",
        "Agent - Reasoning",
        "int",
        "0",
        "",
        "cap of tool-calling iterations per plan step; 0 = built-in default 4",
    ),
    _s(
        "SVC_AGENT_PLAN_PROMPT",
        "Agent - Reasoning",
        "text",
        "",
        "R",
        "override of the planner prompt",
    ),
    _s(
        "SVC_AGENT_REFLECT",
        "Agent - Reasoning",
        "bool",
        "0",
        "",
        "add a self-critique pass before the final answer",
    ),
    _s(
        "SVC_AGENT_REFLECT_PROMPT",
        "Agent - Reasoning",
        "text",
        "",
        "R",
        "override of the self-critique prompt",
    ),
    _s(
        "SVC_AGENT_SELF_HEAL",
        "Agent - Reasoning",
        "int",
        "0",
        "",
        "above 0 = retry failed tool calls with a corrective hint up to this bound",
    ),
    _s(
        "SVC_LOCALE",
        "Agent - System prompt",
        "text",
        "ru-RU",
        "",
        "default reply language/locale hint; persona/operator instructions override",
    ),
    _s(
        "SVC_TIMEZONE",
        "Agent - System prompt",
        "text",
        "UTC",
        "",
        "IANA timezone for date injection",
    ),
    _s(
        "SVC_CONFIDENTIAL_PERSONA",
        "Channels",
        "bool",
        "0",
        "R",
        "web-chat agent does not disclose or persist persona/identity details",
    ),
    _s(
        "SVC_INBOUND_REQUIRE_BINDING",
        "Channels",
        "text",
        "true",
        "",
        "true = the bot ignores channel senders that are not provisioned users (users with a role binding); false = reply to everyone. The description also calls false the default while the default column says true; both statements are given",
    ),
    _s(
        "SVC_A2A_PUBLISH",
        "Integrations",
        "bool",
        "0",
        "R",
        "publish the agent as an A2A server (agent card + POST /a2a/message)",
    ),
    _s(
        "SVC_MCP_PUBLISH",
        "Integrations",
        "bool",
        "0",
        "R",
        "publish tools as an MCP server at POST /v1/mcp; accepts exactly 1",
    ),
    _s(
        "SVC_MCP_EXPORT_TOOLS",
        "Integrations",
        "text",
        "",
        "R",
        "comma list of exact tool names allowed to external MCP clients; empty = none; dangerous host-level tool classes are refused even if listed",
    ),
    _s(
        "SVC_KB_SYNC_INTERVAL",
        "Integrations",
        "text",
        "",
        "R",
        "duration (e.g. 6h, 30m) of background re-sync of every configured knowledge connector in all workspaces; blank or 0 = off; re-sync replaces by source without duplicates; the slack-export connector is excluded",
    ),
    _s(
        "SVC_CASCADE_MIN_CHARS",
        "LLM",
        "int",
        "0",
        "R",
        "request length in characters at which the stronger cascade model is used; 0 = default",
    ),
    _s(
        "SVC_CASCADE_STRONG_MODEL",
        "LLM",
        "text",
        "",
        "R",
        "model used for long/complex requests; blank = off",
    ),
    _s(
        "SVC_SUBSCRIPTION_BASE_URL",
        "LLM",
        "text",
        "",
        "R",
        "base of the subscription-based transport",
    ),
    _s(
        "SVC_SUBSCRIPTION_MAX_OUTPUT_TOKENS",
        "LLM",
        "int",
        "0",
        "L",
        "max_output_tokens cap of a chat turn; 0 = no cap; reasoning tokens count against it, so too small a value yields an empty incomplete reply",
    ),
    _s(
        "SVC_SUBSCRIPTION_MODEL",
        "LLM",
        "text",
        "a vendor reasoning-model id (brand-named, omitted)",
        "R",
        "model id of the primary subscription transport",
    ),
    _s(
        "SVC_SUBSCRIPTION_REASONING_EFFORT",
        "LLM",
        "enum",
        "low",
        "L",
        "none, low, medium, high, xhigh; used when agent parameters do not set it; the value minimal is rejected upstream with HTTP 400; an invalid value is coerced to low",
    ),
    _s(
        "SVC_LLM_CALL_TIMEOUT_S",
        "LLM",
        "int",
        "120",
        "L",
        "time budget of a single model call; on expiry the call fails with ErrCallTimeout and is not retried; 0 = no limit",
    ),
    _s(
        "SVC_LLM_GATEWAY_URL",
        "LLM",
        "text",
        "",
        "",
        "base URL of the compatible model endpoint the agent calls; blank = provider default",
    ),
    _s(
        "SVC_LLM_MODEL",
        "LLM",
        "text",
        "",
        "",
        "model name sent on every turn; must be served by the endpoint",
    ),
    _s(
        "SVC_LLM_PROVIDER",
        "LLM",
        "text",
        "",
        "",
        "model backend: a compatible endpoint or the subscription transport",
    ),
    _s("SVC_LLM_RETRIES", "LLM", "int", "3", "R", "retries on a transient error"),
    _s(
        "SVC_LLM_TEMPERATURE",
        "LLM",
        "text",
        "",
        "L",
        "sampling temperature 0..2 when agent parameters do not set it; blank = not sent; reasoning models reject it",
    ),
    _s(
        "SVC_LLM_TOP_P",
        "LLM",
        "text",
        "",
        "L",
        "nucleus threshold 0..1; blank = not sent; reasoning models reject it",
    ),
    _s(
        "SVC_NATIVE_API",
        "LLM",
        "enum",
        "",
        "R",
        "blank, chat (chat-completions path) or responses (responses path); blank = auto",
    ),
    _s(
        "SVC_NATIVE_API_KEY",
        "LLM",
        "text",
        "",
        "R",
        "account key for the native provider loop; distinct from per-workspace bring-your-own keys",
    ),
    _s("SVC_NATIVE_BASE_URL", "LLM", "text", "", "R", "base of the native provider API"),
    _s(
        "SVC_NATIVE_MODEL",
        "LLM",
        "text",
        "",
        "R",
        "model of the native loop (when SVC_NATIVE_API_KEY is set)",
    ),
    _s(
        "SVC_ROUTER_SIMPLE_MODEL",
        "LLM",
        "text",
        "",
        "R",
        "model for simple turns; blank = band disabled",
    ),
    _s(
        "SVC_ROUTER_STANDARD_MODEL",
        "LLM",
        "text",
        "",
        "R",
        "model for standard turns; blank = band disabled",
    ),
    _s(
        "SVC_ROUTER_COMPLEX_MODEL",
        "LLM",
        "text",
        "",
        "R",
        "model for complex turns; blank = band disabled",
    ),
    _s(
        "SVC_CLOUDSTT_API_KEY",
        "Media",
        "text",
        "",
        "R",
        "key of the cloud speech recognizer (engine cloudstt); may also come from SVC_STT_API_KEY",
    ),
    _s(
        "SVC_CLOUDSTT_MODEL",
        "Media",
        "text",
        "a vendor model id (omitted)",
        "R",
        "model of the cloud speech recognizer (engine cloudstt); depends on the key's access",
    ),
    _s(
        "SVC_CLOUDSTT_URL",
        "Media",
        "text",
        "",
        "R",
        "base of the cloud speech recognizer's API (engine cloudstt); blank = its vendor default",
    ),
    _s(
        "SVC_IMAGE_BASE_URL",
        "Media",
        "text",
        "",
        "R",
        "base of the images API when working through a native provider key",
    ),
    _s("SVC_IMAGE_MODEL", "Media", "text", "", "R", "model of the image_generate tool"),
    _s(
        "SVC_MEDIA_MAX_UPLOAD_MB",
        "Media",
        "int",
        "256",
        "R",
        "max size in megabytes of one media upload (PUT /v1/media/{id}/content)",
    ),
    _s(
        "SVC_STT_API_KEY",
        "Media",
        "text",
        "",
        "R",
        "optional bearer if the speech-to-text sidecar requires one",
    ),
    _s(
        "SVC_STT_SUBSCRIPTION_URL",
        "Media",
        "text",
        "",
        "R",
        "base of the compatible /v1/audio/transcriptions for the subscription engine; blank = subscription base; bearer from SVC_STT_API_KEY or the subscription access token",
    ),
    _s(
        "SVC_STT_ENGINE",
        "Media",
        "enum",
        "local",
        "R",
        "local (free local sidecar at SVC_STT_URL), cloudstt (the cloud speech recognizer, key SVC_CLOUDSTT_API_KEY), off; the subscription transport does not support audio transcription",
    ),
    _s(
        "SVC_STT_LANGUAGE",
        "Media",
        "text",
        "",
        "R",
        "BCP-47 language (e.g. ru, en), used by the cloudstt engine; blank = auto",
    ),
    _s(
        "SVC_STT_MODEL",
        "Media",
        "text",
        "a small local speech model id",
        "R",
        "model of the local engine",
    ),
    _s(
        "SVC_STT_URL",
        "Media",
        "text",
        "",
        "R",
        "URL of the local sidecar (compatible /v1/audio/transcriptions); blank = loopback port 8001",
    ),
    _s(
        "SVC_TTS_API_KEY",
        "Media",
        "text",
        "",
        "R",
        "bearer between the gateway and the speech-synthesis sidecar",
    ),
    _s(
        "SVC_TTS_ENABLED",
        "Media",
        "bool",
        "1",
        "R",
        "enables speech synthesis (tts tool and voice mode)",
    ),
    _s("SVC_TTS_MODEL", "Media", "text", "", "R", "model name for the synthesis service"),
    _s(
        "SVC_TTS_URL",
        "Media",
        "text",
        "",
        "R",
        "URL of the synthesis sidecar (compatible /v1/audio/speech); blank = loopback port 8002",
    ),
    _s(
        "SVC_TTS_VOICE",
        "Media",
        "text",
        "a multilingual voice id (omitted)",
        "R",
        "default synthesis voice",
    ),
    _s("SVC_VIDEO_API_KEY", "Media", "text", "", "R", "access key of the video-analysis sidecar"),
    _s("SVC_VIDEO_URL", "Media", "text", "", "R", "URL of the video-analysis sidecar; blank = off"),
    _s("SVC_VOICE_AEC", "Media - Voice", "bool", "1", "", "require echoCancellation on capture"),
    _s("SVC_VOICE_AGC", "Media - Voice", "bool", "1", "", "require autoGainControl in voice mode"),
    _s(
        "SVC_VOICE_BARGEIN_FRAMES",
        "Media - Voice",
        "int",
        "5",
        "",
        "consecutive voiced frames (about 20 ms each) that interrupt bot playback",
    ),
    _s(
        "SVC_VOICE_DUPLEX",
        "Media - Voice",
        "bool",
        "0",
        "R",
        "live full-duplex mode (streaming, VAD, barge-in)",
    ),
    _s(
        "SVC_VOICE_NOISE_SUPPRESSION",
        "Media - Voice",
        "bool",
        "1",
        "",
        "require noiseSuppression in voice mode",
    ),
    _s(
        "SVC_VOICE_VAD_THRESHOLD",
        "Media - Voice",
        "text",
        "0.02",
        "",
        "speech-energy threshold 0..1; lower = more sensitive",
    ),
    _s(
        "SVC_EMBEDDER_DIM",
        "Memory",
        "int",
        "768",
        "",
        "vector dimension; must match the embedder model",
    ),
    _s(
        "SVC_EMBEDDER_KEEPALIVE",
        "Memory",
        "text",
        "5m",
        "R",
        "keep-alive of the embedder (used when retrieval is embedding); -1 (forever) not recommended",
    ),
    _s(
        "SVC_EMBEDDER_MODEL",
        "Memory",
        "text",
        "a multilingual 768-dimension embedding model",
        "",
        "must match SVC_EMBEDDER_DIM",
    ),
    _s(
        "SVC_EMBEDDER_PASSAGE_PREFIX",
        "Memory",
        "text",
        "",
        "",
        "override of the stored-document prefix; blank = auto-detect by model name",
    ),
    _s(
        "SVC_EMBEDDER_QUERY_PREFIX",
        "Memory",
        "text",
        "",
        "",
        "override of the retrieval-query prefix; blank = auto-detect",
    ),
    _s(
        "SVC_EMBEDDER_URL",
        "Memory",
        "text",
        "",
        "",
        "embedder URL; unset = hash embedder (lexical only)",
    ),
    _s(
        "SVC_MEMORY_CAPTURE",
        "Memory",
        "enum",
        "auto",
        "",
        "auto = remember and recall automatically; review = remember as candidates needing manual approval; off = no capture",
    ),
    _s(
        "SVC_MEMORY_CONTEXT_TIMEOUT",
        "Memory",
        "text",
        "3s",
        "R",
        "max wait for memory hydration at the start of a reply, Go duration format (e.g. 2s, 1500ms); 0 = no limit; on a miss the reply proceeds without the memory block",
    ),
    _s(
        "SVC_MEMORY_DREAM_INTERVAL",
        "Memory",
        "text",
        "1h",
        "",
        "how often the maintenance pass scans reviewed claims for contradictions; 0 disables",
    ),
    _s(
        "SVC_MEMORY_EXTRACT",
        "Memory",
        "bool",
        "1",
        "",
        "extract normalized subject/predicate/object facts via the LLM (one extra LLM call per captured message)",
    ),
    _s(
        "SVC_MEMORY_RETRIEVAL",
        "Memory",
        "enum",
        "fulltext",
        "R",
        "fulltext = database full-text search over fact text; embedding = semantic vector search through an embedder",
    ),
    _s(
        "SVC_MEMORY_TOKEN",
        "Memory",
        "text",
        "",
        "",
        "bearer token for the remote memory service; needed only when SVC_MEMORY_URL is set",
    ),
    _s(
        "SVC_MEMORY_URL",
        "Memory",
        "text",
        "",
        "R",
        "URL of the standalone memory plugin (contract svc.memory.v1); blank = in-process module; turn-context hydration uses its /context and /retrieval over HTTP and falls back softly to the built-in module on error",
    ),
    _s(
        "SVC_VECTORDB_API_KEY",
        "Memory",
        "text",
        "",
        "R",
        "key of the vector store, only with its URL",
    ),
    _s(
        "SVC_VECTORDB_URL",
        "Memory",
        "text",
        "",
        "",
        "unset = in-memory store (vectors lost on restart)",
    ),
    _s(
        "SVC_RERANKER_URL",
        "Memory",
        "text",
        "",
        "R",
        "URL of the cross-encoder reranker sidecar; blank = off",
    ),
    _s(
        "SVC_MODERATION",
        "Moderation",
        "bool",
        "1",
        "R",
        "value off disables the built-in jailbreak/prompt-injection guard",
    ),
    _s(
        "SVC_MODERATION_REFUSAL",
        "Moderation",
        "text",
        "",
        "R",
        "refusal text when a request is blocked; blank = built-in",
    ),
    _s(
        "SVC_PUBLIC_URL",
        "Public access",
        "text",
        "",
        "",
        "public URL proxied to the gateway port; used by the web UI and clients",
    ),
    _s(
        "REMOTE_AGENT_GATEWAY_BASE_URL",
        "Public access",
        "text",
        "",
        "",
        "public URL proxied to the remote-agent gateway port (REMOTE_AGENT_PORT, default 8080); the remote agent dials it with a one-time ticket",
    ),
    _s(
        "CHATBOT_PUBLIC_URL",
        "Public access",
        "text",
        "",
        "",
        "webhook mode only: proxy to the chat-bot connector port (default 8091); blank = polling",
    ),
    _s(
        "SVC_LDAP_ENABLED",
        "SSO (LDAP)",
        "bool",
        "0",
        "",
        "when on, admin logins fall back to the directory; the bind password is a secret (scope ldap, name bind_password)",
    ),
    _s("SVC_LDAP_URL", "SSO (LDAP)", "text", "", "", "ldaps:// (TLS) or ldap:// directory URL"),
    _s("SVC_LDAP_BASE_DN", "SSO (LDAP)", "text", "", "", "user search base DN"),
    _s(
        "SVC_LDAP_BIND_DN",
        "SSO (LDAP)",
        "text",
        "",
        "",
        "service account for the initial search bind; blank = anonymous",
    ),
    _s(
        "SVC_LDAP_USER_ATTR",
        "SSO (LDAP)",
        "text",
        "",
        "",
        "attribute matched against the typed login (sAMAccountName, uid or userPrincipalName style)",
    ),
    _s(
        "SVC_LDAP_USER_FILTER",
        "SSO (LDAP)",
        "text",
        "",
        "",
        "user search filter; must contain %s for the login",
    ),
    _s(
        "SVC_LDAP_GROUP_ATTR",
        "SSO (LDAP)",
        "text",
        "",
        "",
        "user attribute listing group DNs (memberOf style); blank disables group to role mapping",
    ),
    _s(
        "SVC_LDAP_ROLE_MAPPINGS",
        "SSO (LDAP)",
        "text",
        "",
        "",
        "JSON object: group DN or bare CN to role",
    ),
    _s(
        "SVC_LDAP_DEFAULT_ROLE",
        "SSO (LDAP)",
        "text",
        "",
        "",
        "role when no group matches; blank = no role",
    ),
    _s(
        "SVC_LDAP_SKIP_TLS_VERIFY",
        "SSO (LDAP)",
        "bool",
        "0",
        "",
        "disables certificate verification; lab only",
    ),
    _s(
        "SVC_OIDC_ISSUER",
        "SSO (OIDC)",
        "text",
        "",
        "",
        "issuer URL; enables OIDC JWT authentication when set",
    ),
    _s(
        "SVC_OIDC_JWKS_URL",
        "SSO (OIDC)",
        "text",
        "",
        "",
        "JSON Web Key Set endpoint for signature verification",
    ),
    _s(
        "SVC_OIDC_AUDIENCE",
        "SSO (OIDC)",
        "text",
        "",
        "",
        "expected aud claim; an aud claim is required on every token (a token without aud is rejected) and, when set, must contain this value",
    ),
    _s(
        "SVC_OIDC_TENANT_CLAIM", "SSO (OIDC)", "text", "", "", "JWT claim carrying the workspace id"
    ),
    _s(
        "SVC_SAML_ENABLED",
        "SSO (SAML)",
        "bool",
        "0",
        "",
        "exposes /saml/metadata, /saml/acs, /saml/login; SP private key is a secret (scope saml, name sp_key)",
    ),
    _s(
        "SVC_SAML_ENTITY_ID",
        "SSO (SAML)",
        "text",
        "",
        "",
        "SP entity id; blank = <root>/saml/metadata",
    ),
    _s(
        "SVC_SAML_ROOT_URL",
        "SSO (SAML)",
        "text",
        "",
        "",
        "externally reachable base URL; ACS = <root>/saml/acs",
    ),
    _s("SVC_SAML_IDP_METADATA", "SSO (SAML)", "text", "", "", "IdP metadata XML"),
    _s("SVC_SAML_SP_CERT", "SSO (SAML)", "text", "", "", "public SP signing certificate (PEM)"),
    _s(
        "SVC_SAML_ROLE_ATTRIBUTE",
        "SSO (SAML)",
        "text",
        "",
        "",
        "assertion attribute carrying group/role values (default groups)",
    ),
    _s(
        "SVC_SAML_ROLE_MAPPINGS",
        "SSO (SAML)",
        "text",
        "",
        "",
        "JSON object: asserted value to role",
    ),
    _s(
        "SVC_SAML_DEFAULT_ROLE",
        "SSO (SAML)",
        "text",
        "",
        "",
        "role when no asserted value maps; blank = no role",
    ),
    _s(
        "SVC_AIRGAPPED",
        "Security",
        "bool",
        "0",
        "R",
        "blocks model-driven egress to the public internet (internal or allowlisted hosts only)",
    ),
    _s(
        "SVC_AUDIT_RETENTION_DAYS",
        "Security",
        "int",
        "0",
        "R",
        "days to keep the audit log; older entries deleted daily; 0 = forever",
    ),
    _s(
        "SVC_CODE_EXEC_ALLOW_HOST",
        "Security",
        "bool",
        "0",
        "R",
        "allow code execution on the host with no sandbox; trusted labs only",
    ),
    _s(
        "SVC_CORS_ORIGINS",
        "Security",
        "text",
        "",
        "R",
        "comma list of allowed origins; blank = same-origin only",
    ),
    _s(
        "SVC_CSP",
        "Security",
        "text",
        "",
        "R",
        "override of the Content-Security-Policy header; blank = safe default",
    ),
    _s(
        "SVC_INBOUND_SECRET",
        "Security",
        "text",
        "",
        "R",
        "shared secret authenticating the connector to gateway hop; blank = the inbound endpoint is unauthenticated",
    ),
    _s(
        "SVC_NATIVE_COMPAT_KEY",
        "Security",
        "text",
        "",
        "R",
        "static key compatible clients use on the built-in /v1 endpoint; blank = static auth disabled (personal keys remain)",
    ),
    _s(
        "SVC_NATIVE_COMPAT_WORKSPACE",
        "Security",
        "text",
        "",
        "R",
        "workspace id that static authentication maps to; blank = SVC_DEFAULT_WORKSPACE_ID",
    ),
    _s(
        "SVC_REQUIRE_2FA",
        "Security",
        "bool",
        "0",
        "L",
        "require TOTP/passkey for operators; operators without it are prompted at login without being blocked",
    ),
    _s(
        "SVC_REQUIRE_SECURE",
        "Security",
        "bool",
        "0",
        "R",
        "plain HTTP is redirected to HTTPS (GET/HEAD) or rejected with 403; localhost is always allowed; honors X-Forwarded-Proto",
    ),
    _s(
        "SVC_TRUSTED_PROXIES",
        "Security",
        "text",
        "",
        "L",
        "comma list of proxy CIDRs or IPs; only requests from them use X-Forwarded-For for the client IP; blank = peer address only",
    ),
    _s("SVC_CODE_EXEC", "Tools", "bool", "0", "R", "enables the code_exec tool"),
    _s(
        "SVC_CODE_EXEC_INTERPRETERS",
        "Tools",
        "text",
        "",
        "R",
        "JSON object language to binary path; blank = auto-detect",
    ),
    _s(
        "SVC_CODE_EXEC_SANDBOX_IMAGE",
        "Tools",
        "text",
        "",
        "R",
        "container image isolating code_exec (no network, read-only rootfs, limits); blank = host execution",
    ),
    _s(
        "SVC_DB_QUERY_DSN",
        "Tools",
        "text",
        "",
        "R",
        "read-only DSN of the db_query tool; use a least-privilege non-owner role; queries run scoped to the acting workspace; empty = tool off",
    ),
    _s(
        "SVC_FS_ROOT",
        "Tools",
        "text",
        "",
        "R",
        "root directory confining file read/write tools; empty = file tools off",
    ),
    _s(
        "SVC_HTTP_ALLOWLIST",
        "Tools",
        "text",
        "",
        "R",
        "comma list of hosts http_request may call; empty = all except internal/private",
    ),
    _s(
        "SVC_HTTP_AUTH_JSON",
        "Tools",
        "text",
        "",
        "R",
        "JSON map host to authorization headers for http_request; empty = none",
    ),
    _s(
        "SVC_MCP_SERVERS",
        "Tools",
        "text",
        "",
        "R",
        "JSON description of external MCP servers whose tools attach to the agent; empty = none",
    ),
    _s(
        "SVC_WEBFETCH_ALLOWLIST",
        "Tools",
        "text",
        "",
        "R",
        "comma list of domains web_fetch may call; empty = all except internal/private",
    ),
    _s(
        "SVC_WEBUI_ENABLED",
        "Web UI (separate port)",
        "bool",
        "1",
        "",
        "serve the admin SPA at the root of a separate listener (SVC_WEBUI_ADDR); 0 disables it",
    ),
    _s(
        "SVC_WEBUI_API_BASE",
        "Web UI (separate port)",
        "text",
        "",
        "",
        "absolute origin the separately hosted SPA calls for /v1/admin/*; blank = gateway public URL, then local gateway address",
    ),
    _s(
        "SVC_WEBUI_ORIGIN",
        "Web UI (separate port)",
        "text",
        "",
        "",
        "browser origin of the web UI, auto-added to the API CORS allowlist with credentials; blank = derived from SVC_WEBUI_ADDR",
    ),
    _s(
        "SVC_OTEL_ENDPOINT",
        "Telemetry",
        "text",
        "",
        "R",
        "when set, the gateway pushes telemetry over OTLP to this collector endpoint (environment file variable); otherwise only /metrics is available",
    ),
    _s("SVC_BLOB_DIR", "Telemetry", "text", "", "R", "enables the media/file service"),
    _s(
        "SVC_MEDIA_TOKEN_SECRET",
        "Telemetry",
        "text",
        "",
        "R",
        "keeps signed download URLs valid across restarts",
    ),
    _s(
        "SVC_ERRORTRACKER_DSN",
        "Telemetry",
        "text",
        "",
        "R",
        "reports panics and errors to an error tracker when a DSN is set (off until set)",
    ),
    _s(
        "SVC_ERRORTRACKER_ENVIRONMENT",
        "Telemetry",
        "text",
        "production",
        "R",
        "environment name reported to the error tracker",
    ),
)

_OPS = "Operations"

# SVC's own operational keys (not in the spec's catalog).
_OPERATIONAL: tuple[SettingSpec, ...] = (
    _s(
        "SVC_DATABASE_URL",
        _OPS,
        "text",
        "",
        "R",
        "PostgreSQL URL of the event store; blank = embedded PostgreSQL under SVC_DATA_DIR",
    ),
    _s(
        "SVC_DATA_DIR",
        _OPS,
        "text",
        "./.svc",
        "R",
        "data directory: embedded database, env file, local state",
    ),
    _s(
        "SVC_ENV_FILE",
        _OPS,
        "text",
        "",
        "R",
        "env file read at startup (KEY=VALUE lines); blank = <SVC_DATA_DIR>/svc.env when present",
    ),
    _s(
        "SVC_ACTOR_IDLE_SEC",
        _OPS,
        "int",
        "300",
        "R",
        "seconds an idle logical actor stays active before it is passivated",
    ),
    _s(
        "SVC_ACTOR_MAX_ACTIVE",
        _OPS,
        "int",
        "10000",
        "R",
        "most logical actors active at once per host; the least recently used are passivated",
    ),
    _s(
        "SVC_ACTOR_RUNTIME",
        _OPS,
        "enum",
        "local",
        "R",
        "actor runtime: local (inside the gateway process) or ray (detached Ray host actors)",
    ),
    _s(
        "SVC_RAY_ADDRESS",
        _OPS,
        "text",
        "",
        "R",
        "Ray cluster address for the ray runtime; blank = start a local Ray inside svc serve; "
        "auto or host:port = join that cluster",
    ),
    _s(
        "SVC_RAY_CLUSTER",
        _OPS,
        "text",
        "svc",
        "R",
        "name of this deployment's host group and shard map on the Ray cluster; two SVC "
        "deployments sharing one Ray cluster need different names",
    ),
    _s(
        "SVC_ACTOR_HOSTS",
        _OPS,
        "int",
        "0",
        "R",
        "number of Ray host actors the ray runtime spreads logical actors over; "
        "0 = one per CPU the Ray cluster reports (at least 1)",
    ),
    _s(
        "SVC_ACTOR_HOST_POOL_SIZE",
        _OPS,
        "int",
        "10",
        "R",
        "most database connections each Ray actor host holds (its appends and snapshots); "
        "hosts keep the size they started with, Ray's restarts of them included: restart the "
        "gateways, then the Ray pods",
    ),
    _s(
        "SVC_DB_POOL_SIZE",
        _OPS,
        "int",
        "20",
        "R",
        "most database connections this gateway process holds (with the local runtime, its "
        "actors' appends too); PostgreSQL's max_connections must cover every process's pool",
    ),
    _s(
        "SVC_DEFAULT_WORKSPACE_ID",
        _OPS,
        "text",
        "default",
        "R",
        "workspace created at first start and used when nothing else names one",
    ),
    _s(
        "SVC_GATEWAY_ADDR",
        _OPS,
        "text",
        ":8780",
        "R",
        "listen address [host]:port of the gateway; ':8780' = all interfaces, port 8780; port 0 = "
        "a free port, named in the 'svc listening on' log line",
    ),
    _s(
        "SVC_WEBUI_ADDR",
        _OPS,
        "text",
        "",
        "R",
        "listen address of the separate web UI listener (named by the spec's text, not its tables)",
    ),
    _s("SVC_LOG_LEVEL", _OPS, "enum", "info", "L", "log level: debug, info, warning, error"),
    _s(
        "SVC_LOG_FORMAT",
        _OPS,
        "enum",
        "text",
        "R",
        "log lines on standard error: text (time LEVEL logger: message) or json (one object a "
        "line: time, level, logger, message, and exc with a traceback), for log collectors",
    ),
    _s(
        "SVC_SHUTDOWN_GRACE_SEC",
        _OPS,
        "int",
        "10",
        "R",
        "seconds in-flight turns get to finish on shutdown before they are failed",
    ),
    _s(
        "SVC_METRICS_TOKEN",
        _OPS,
        "text",
        "",
        "L",
        "bearer token /metrics then requires (Prometheus: authorization credentials); blank = "
        "/metrics answers whoever reaches it",
    ),
    _s(
        "SVC_FEEDS_PER_OWNER",
        _OPS,
        "int",
        "32",
        "L",
        "most SSE event feeds one owner (a user, else a key) holds open at once on one gateway "
        "process; the next gets 429 too_many_feeds; 0 = no bound (a backend that opens one "
        "feed per client under a single key)",
    ),
    _s(
        "SVC_MAX_BODY_BYTES",
        _OPS,
        "int",
        "4194304",
        "R",
        "largest accepted request body in bytes; larger bodies get 413",
    ),
)

_BEARER_KEYS = (
    "SVC_NATIVE_API_KEY",
    "SVC_CLOUDSTT_API_KEY",
    "SVC_STT_API_KEY",
    "SVC_TTS_API_KEY",
    "SVC_VIDEO_API_KEY",
    "SVC_MEMORY_TOKEN",
    "SVC_VECTORDB_API_KEY",
    "SVC_NATIVE_COMPAT_KEY",
    "SVC_METRICS_TOKEN",
)
"""Secrets sent as a bearer token (or, like the compatible key, compared with one)."""

_SECRET_KEYS = frozenset(
    {
        *_BEARER_KEYS,
        "SVC_INBOUND_SECRET",
        "SVC_DB_QUERY_DSN",
        "SVC_HTTP_AUTH_JSON",
        "SVC_MCP_SERVERS",
        "SVC_MEDIA_TOKEN_SECRET",
        "SVC_ERRORTRACKER_DSN",
        "SVC_DATABASE_URL",
    }
)

_NOT_STORABLE = "read before the settings stream can be: set it in the environment or env file"
_BUILD_TIME = "read when the server is built, before the settings stream is open: set it in the environment or env file"
_VENDOR_DEFAULT = (
    "the spec names a vendor default without giving it; blank = the provider's default"
)

_HTTP_URL_KEYS = (
    "SVC_PUBLIC_URL",
    "SVC_LLM_GATEWAY_URL",
    "SVC_NATIVE_BASE_URL",
    "SVC_SUBSCRIPTION_BASE_URL",
    "SVC_CLOUDSTT_URL",
    "SVC_IMAGE_BASE_URL",
    "SVC_STT_SUBSCRIPTION_URL",
    "SVC_STT_URL",
    "SVC_TTS_URL",
    "SVC_VIDEO_URL",
    "SVC_EMBEDDER_URL",
    "SVC_MEMORY_URL",
    "SVC_RERANKER_URL",
    "CHATBOT_PUBLIC_URL",
    "SVC_OIDC_ISSUER",
    "SVC_OIDC_JWKS_URL",
    "SVC_SAML_ROOT_URL",
)
"""Settings holding the HTTP(S) URL of a server or of this service."""
_COMPARED_CLAIM_KEYS = ("SVC_OIDC_AUDIENCE", "SVC_OIDC_TENANT_CLAIM", "SVC_SAML_ENTITY_ID")
"""Values a token's or an assertion's claims are compared with, as given."""

_OWN_URL_KEYS = ("SVC_PUBLIC_URL", "CHATBOT_PUBLIC_URL", "SVC_SAML_ROOT_URL")
"""Of these, the addresses of this service, which it hands to clients."""

# Refinements the tables state in prose: choices, bounds, bool dialects, notes on ambiguities.
_REFINEMENTS: dict[str, dict[str, object]] = {
    "SVC_PERSONAL_API_KEYS": {"bool_mode": "off_disables"},
    "SVC_MODERATION": {"bool_mode": "off_disables"},
    "SVC_MCP_PUBLISH": {
        "bool_mode": "exactly_one",
        "from_env": False,
        "note": "accepts exactly 1; true or on leave it closed; set with `svc settings set`, "
        "not in the environment file (environment values are ignored with a warning)",
    },
    "SVC_MCP_EXPORT_TOOLS": {
        "from_env": False,
        "note": "exact names only; set with `svc settings set`, not in the environment file",
    },
    "SVC_REQUIRE_2FA": {"note": "the spec says 'applied immediately': catalogued as L"},
    "SVC_LLM_PROVIDER": {
        "rule": "llm_provider",
        "note": "this build has blank or auto, offline, and openai (also openai-compat, "
        "compatible); any other value is refused",
    },
    # A stored CSP over the bound is dropped at start, with a warning: the default it falls
    # back to is safe, and the long one made every answer unreadable to common clients.
    "SVC_CSP": {"rule": "header_sized"},
    # Sent as a bearer token, or compared with one: a line break (a key file's last one)
    # would fail every request that carries it, told as a broken model server.
    **{key: {"rule": "header_value", "new_rule": "header_sized"} for key in _BEARER_KEYS},
    # Compared with what a caller sends: a value stored before this rule keeps loading.
    **{
        key: {"rule": "header_value", "new_rule": "compared_token"}
        for key in ("SVC_METRICS_TOKEN", "SVC_NATIVE_COMPAT_KEY")
    },
    "SVC_CORS_ORIGINS": {"rule": "origins"},
    "SVC_WEBUI_ORIGIN": {"rule": "origin"},
    "SVC_RAY_ADDRESS": {"rule": "ray_address"},
    **{key: {"rule": "http_url"} for key in _HTTP_URL_KEYS},
    **{key: {"rule": "own_url"} for key in _OWN_URL_KEYS},
    "SVC_LDAP_ROLE_MAPPINGS": {"rule": "string_map", "new_rule": "role_map"},
    "SVC_SAML_ROLE_MAPPINGS": {"rule": "string_map", "new_rule": "role_map"},
    "SVC_LDAP_DEFAULT_ROLE": {"new_rule": "role_name"},
    "SVC_SAML_DEFAULT_ROLE": {"new_rule": "role_name"},
    "SVC_LDAP_USER_FILTER": {"rule": "ldap_user_filter"},
    # Read by pysaml2 only at the first SAML request: a malformed one failed there (a 500).
    "SVC_SAML_SP_CERT": {"set_rule": "pem_certificate"},
    "SVC_SAML_IDP_METADATA": {"set_rule": "saml_idp_metadata"},
    # Compared with a token's claims: " " read as blank, which turns the audience check off.
    **{key: {"set_rule": "trimmed"} for key in _COMPARED_CLAIM_KEYS},
    "SVC_TIMEZONE": {"rule": "timezone"},
    "SVC_DEFAULT_WORKSPACE_ID": {"rule": "workspace_id"},
    "SVC_NATIVE_COMPAT_WORKSPACE": {"rule": "workspace_id"},
    "SVC_OTEL_ENDPOINT": {"storable": False, "note": _BUILD_TIME, "rule": "http_url"},
    "SVC_TOOL_SEARCH": {"default": "0", "note": "the spec's default column says false"},
    "SVC_SUBSCRIPTION_REASONING_EFFORT": {
        "choices": ("none", "low", "medium", "high", "xhigh"),
        "coerce_invalid_to": "low",
        "note": "`settings set` rejects an invalid value; an invalid environment value is coerced "
        "to low as the spec says; minimal is rejected upstream",
    },
    "SVC_NATIVE_API": {"choices": ("", "chat", "responses"), "note": "blank = auto"},
    "SVC_STT_ENGINE": {
        "choices": ("local", "cloudstt", "off"),
        "note": "the spec's text garbles the cloud engine's name ('the service'); it is spelled "
        "cloudstt here, after its keys (SVC_CLOUDSTT_*), as the spec names the recognizer",
    },
    "SVC_MEMORY_CAPTURE": {"choices": ("auto", "review", "off")},
    "SVC_MEMORY_RETRIEVAL": {"choices": ("fulltext", "embedding")},
    "SVC_INBOUND_REQUIRE_BINDING": {
        "choices": ("true", "false"),
        "note": "ambiguous in the spec: its default column says true while its description calls "
        "false the default; this catalog follows the default column (true)",
    },
    "SVC_ERRORTRACKER_DSN": {
        "note": "the spec conflicts: one statement reports errors to a tracker when a DSN is set, "
        "another says no error data leaves the perimeter; SVC sends nothing unless it is set",
    },
    "SVC_KB_SYNC_INTERVAL": {"type": "duration"},
    "SVC_MEMORY_CONTEXT_TIMEOUT": {"type": "duration"},
    "SVC_MEMORY_DREAM_INTERVAL": {"type": "duration", "note": "the spec types it string"},
    "SVC_LLM_TEMPERATURE": {"numeric_text": True, "min_value": 0.0, "max_value": 2.0},
    "SVC_LLM_TOP_P": {"numeric_text": True, "min_value": 0.0, "max_value": 1.0},
    "SVC_VOICE_VAD_THRESHOLD": {"numeric_text": True, "min_value": 0.0, "max_value": 1.0},
    "SVC_SUBAGENT_TIMEOUT_SEC": {"min_value": 1.0},
    "SVC_AGENT_DEBATE_ROUNDS": {"min_value": 1.0},
    "SVC_EMBEDDER_DIM": {"min_value": 1.0, "max_value": 65536.0},
    "SVC_MEDIA_MAX_UPLOAD_MB": {"min_value": 1.0},
    "SVC_SUBSCRIPTION_MODEL": {"default": "", "note": _VENDOR_DEFAULT},
    "SVC_CLOUDSTT_MODEL": {"default": "", "note": _VENDOR_DEFAULT},
    "SVC_STT_MODEL": {"default": "", "note": _VENDOR_DEFAULT},
    "SVC_TTS_VOICE": {"default": "", "note": _VENDOR_DEFAULT},
    "SVC_EMBEDDER_MODEL": {"default": "", "note": _VENDOR_DEFAULT},
    "SVC_ACTOR_RUNTIME": {"choices": ("local", "ray")},
    "SVC_TRUSTED_PROXIES": {"networks": True},
    "SVC_LOG_LEVEL": {"choices": ("debug", "info", "warning", "error")},
    "SVC_LOG_FORMAT": {
        "choices": ("text", "json"),
        "storable": False,
        "note": "chosen as the process starts, before the database is open: set it in the "
        "environment or env file",
    },
    "SVC_ACTOR_IDLE_SEC": {"min_value": 1.0},
    "SVC_ACTOR_MAX_ACTIVE": {"min_value": 1.0},
    "SVC_ACTOR_HOSTS": {"min_value": 0.0, "max_value": 1024.0},
    # The commit listener and the log tailer hold one connection each for good; below 6 the
    # projections' parallel catch-up and the appends would wait on each other past the
    # pool's acquire timeout for the rest.
    "SVC_DB_POOL_SIZE": {
        "min_value": 6.0,
        "max_value": 1000.0,
        "storable": False,
        "note": "sizes the pool the stored settings are read through: set it in the "
        "environment or env file",
    },
    # A host's commit listener holds one connection for good; its shard map, appends and
    # snapshots need the others.
    "SVC_ACTOR_HOST_POOL_SIZE": {"min_value": 3.0, "max_value": 1000.0},
    # A century: further back than that is before any timestamp PostgreSQL computes from it.
    "SVC_AUDIT_RETENTION_DAYS": {"min_value": 0.0, "max_value": 36500.0},
    "SVC_MAX_BODY_BYTES": {"min_value": 1024.0, "storable": False, "note": _BUILD_TIME},
    "SVC_FEEDS_PER_OWNER": {"min_value": 0.0, "max_value": 1_000_000.0},
    "SVC_SHUTDOWN_GRACE_SEC": {"storable": False, "note": _BUILD_TIME},
    "SVC_DATABASE_URL": {"storable": False, "note": _NOT_STORABLE, "rule": "postgres_url"},
    "SVC_GATEWAY_ADDR": {
        "storable": False,
        "note": "where this process listens, which only its environment can know: a stored "
        "address would apply to every gateway and, if unusable, keep each from starting",
    },
    "SVC_DATA_DIR": {"storable": False, "note": _NOT_STORABLE},
    "SVC_ENV_FILE": {"storable": False, "note": _NOT_STORABLE},
}


def _refine(spec: SettingSpec) -> SettingSpec:
    changes = dict(_REFINEMENTS.get(spec.key, {}))
    if spec.key in _SECRET_KEYS:
        changes["secret"] = True
    return replace(spec, **changes) if changes else spec  # type: ignore[arg-type]


def _index(specs: Iterable[SettingSpec]) -> dict[str, SettingSpec]:
    out: dict[str, SettingSpec] = {}
    for spec in specs:
        if spec.key in out:
            raise ValueError(f"setting {spec.key} catalogued twice")
        out[spec.key] = _refine(spec)
    return out


CATALOG: Mapping[str, SettingSpec] = _index(_SPEC_TABLES + _OPERATIONAL)
"""Every known setting by key, in catalog order."""

SPEC_TOTAL = 138
"""The total the spec states for its catalog; it lists fewer (see module docstring)."""


class UnknownSetting(NotFound):
    """No such key in the catalog: 404 on /v1/admin/settings/{key}, whatever the method (the
    catalog is fixed, so PUT creates nothing new either); exit 2 in the CLI."""

    default_code = "unknown_setting"


def get_spec(key: str) -> SettingSpec:
    try:
        return CATALOG[key]
    except KeyError:
        raise UnknownSetting(
            f"unknown setting {echoed(key)}{_meant(key)}; see `svc settings list`"
        ) from None


def _meant(key: str) -> str:
    """The setting a mistyped `key` most likely meant, compared without the prefix every
    name shares (with it, `SVC_NOPE` was taken for `SVC_LOCALE`)."""
    named = key.upper()
    if named in CATALOG:
        return f" (names are upper case: {named})"
    bare = {name.removeprefix(_SHARED): name for name in CATALOG}
    near = closest(named.removeprefix(_SHARED), bare)
    return f" (did you mean {bare[near]}?)" if near else ""


_SHARED = "SVC_"


def display_value(spec: SettingSpec, raw: str | None) -> str:
    """What a listing may show: secrets become MASK or "unset", never the value; a URL's
    user and password (a model server reached with Basic authentication) are masked too."""
    if spec.secret or (raw and secret_shaped(raw)):
        # A key pasted into a setting that is no secret (a certificate's), from the
        # environment, which refuses nothing for it.
        return MASK if raw else "unset"
    shown = _USERINFO.sub(r"\1***@", raw) if raw and _holds_userinfo(raw) else raw or ""
    return shown if is_utf8(shown) else _bytes_escaped(shown)


def _holds_userinfo(raw: str) -> bool:
    """A URL, or what reads as one without its `//` (`user:pw@host`, `https:/user:pw@host`:
    text settings such as SVC_VECTORDB_URL take it as it is, a password with a space
    included); an address (`ops@example.com`) is not one. Text that only looks like one
    (`a: b@c`) is masked too: a listing that hides too much costs less than a password."""
    if "://" in raw:
        return True
    before, at, _ = raw.rpartition("@")
    return bool(at) and ":" in before


def _bytes_escaped(text: str) -> str:
    """`text` from the environment holding bytes the locale could not decode (Python keeps
    them as lone surrogates, which no JSON answer can carry): each shown as `\\xNN`."""
    try:
        data = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate that stands for no byte
        data = text.encode("utf-8", "backslashreplace")
    return data.decode("utf-8", "backslashreplace")
