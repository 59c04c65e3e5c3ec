"""POST /v1/chat/completions: the OpenAI-compatible chat endpoint.

The handler authenticates, validates the body (`schemas.chat`), builds one `RunTurn` and asks
the conversation actor (`conversation:<id>`) through the runtime; it never calls a model or
appends an event itself. The actor records the turn's input (what the client said since the
history's last answer) and `TurnStarted` before calling the model and the outcome after, so
the turn is durable whatever happens to this connection.

Headers (see docs/chat.md):
- `Idempotency-Key` (request): makes the RunTurn's command id, with the principal that sent
  it (`_keyed_command_id`). A retry with the same key by the same principal returns the
  recorded result of the first attempt without a second model call. Without one, a fresh id
  is generated, so plain retries run a new turn.
- `X-SVC-Conversation-Id` (request and response): the conversation to continue; a new one
  when absent (derived from the Idempotency-Key when one is given, so a retry lands on the
  same conversation). Every response, errors included, carries the id used.
- `X-SVC-Cursor` (response): the cursor of the turn's last event, for read-your-writes on the
  feeds and read models. A stream sends it as the SSE `id:` of its finishing chunk instead,
  since headers leave before the turn ends.

Agents as models: when `model` is the name of an active agent of the caller's workspace (the
`agents` read model, gateway/admin_agents.py), the turn runs on the agent's model, the agent's
system prompt goes first in the messages (before any the client sent), and the agent's
parameters are defaults that the request's own values override. An agent name wins over a
model of the same name. The turn records the agent id (RunTurn.agent, TurnStarted.agent);
the response echoes the name the client sent. The active agents of a workspace are read once
per `AGENT_CACHE_TTL_S` (`AgentDirectory`), not per request: a change made through another
process shows within that time; `forget_agents` drops a workspace's entry at once (the admin
agent writes of this process call it).

Responses are encoded straight to JSON bytes (orjson) in the exact shapes of the
`schemas.chat` records, which document them (and the OpenAPI page); building a pydantic record
per streamed token cost more than the rest of relaying it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import Counter, Histogram
from pydantic import ValidationError

from actors.behaviour import ActorKey
from actors.conversation import TurnResult, conversation_key
from actors.errors import (
    AnswerAbandoned,
    MailboxFull,
    RuntimeNotStarted,
    RuntimeStopping,
    TurnInProgress,
)
from actors.models.port import ModelProvider, TextDelta
from actors.models.registry import ProviderSet, select
from actors.runtime import ActorRuntime
from eventstore.db import Database
from eventstore.tasks import cancel_unless_done
from gateway.auth import (
    CHAT_PATH,
    CHAT_SCOPE,
    MODELS_PATH,
    PRINCIPAL,
    authenticate,
    require_scope,
)
from gateway.cursor_seal import CursorSeal
from gateway.errors import (
    client_gone,
    error_body,
    internal_failure,
    read_header_id,
    read_json,
)
from gateway.identity.common import first_attempt_ran
from gateway.openapi import document
from gateway.sse import open_sse, send_comment, send_event
from gateway.state import CURSORS, DATABASE, MODEL_PROVIDERS, RUNTIME, Principal
from gateway.telemetry import current_traceparent, record_failure, record_turn, turn_span
from gateway.ttl_cache import TtlCache
from projections import agent_queries
from projections.agent_queries import Agent
from schemas.chat import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ModelCard,
    ModelList,
)
from schemas.commands import check_client_key, service_command_id
from schemas.conversation import MAX_MESSAGES, Message, RunTurn, TurnParams
from schemas.errors import InvalidInput, NotFound, RateLimited, SvcError, Unavailable

log = logging.getLogger(__name__)

CONVERSATION_HEADER = "X-SVC-Conversation-Id"
CURSOR_HEADER = "X-SVC-Cursor"
IDEMPOTENCY_HEADER = "Idempotency-Key"

_CONVERSATION_KEY: web.RequestKey[str] = web.RequestKey("svc_conversation_id", str)
_FAILURE_CURSOR_KEY: web.RequestKey[str] = web.RequestKey("svc_failure_cursor", str)
_KEY_NAMESPACE = uuid.UUID("7f6b2f8e-4c1e-4f0e-9a51-2b1f3c1d5e00")
AGENT_CACHE_TTL_S = 1.0

TURN_DURATION = Histogram(
    "svc_turn_duration_seconds",
    "Wall time of chat turns (requests that reached the conversation actor), request to last byte.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
TURN_ERRORS = Counter(
    "svc_turn_errors_total",
    "Chat answers that were errors, by error code, of the requests that reached the "
    "conversation actor (as svc_turn_duration_seconds counts them); a retry answered from a "
    "recorded failure counts again.",
    ["code"],
)
TURN_ERROR_CODES = (
    *("invalid_request", "context_length_exceeded", "string_above_max_length"),
    *("content_policy_violation", "invalid_prompt", "model_not_found"),
    *("conversation_not_found", "concurrency_conflict", "idempotency_key_reused"),
    *("idempotency_key_expired", "turn_in_progress", "turn_abandoned", "internal_error"),
    *("upstream_rejected", "upstream_auth_failed", "upstream_model_not_found"),
    *("upstream_quota_exceeded", "upstream_unavailable", "upstream_interrupted"),
    *("upstream_bad_stream", "upstream_bad_response", "upstream_misconfigured"),
    *("upstream_error", "stream_interrupted", "actor_busy", "runtime_stopping"),
    *("answer_abandoned", "interrupted", "ErrCallTimeout", "store_unavailable"),
)
"""The codes a turn's request that reached the actor can be answered with (docs/chat.md),
exported at 0 from the start: `rate()` needs two samples of a series, so a code whose series
first appeared with a burst in it kept that burst from the error-rate alerts."""
for _code in TURN_ERROR_CODES:
    TURN_ERRORS.labels(_code)


SERVING_SINCE: web.AppKey[int] = web.AppKey("svc_models_serving_since", int)
"""A served model's `created` in GET /v1/models: when this gateway started, also for a
model a live setting added since (a model server tells no creation time of its models, and
0 showed as 1970 in clients)."""


def add_routes(app: web.Application) -> None:
    app[AGENTS] = AgentDirectory()
    app[SERVING_SINCE] = int(time.time())
    app.router.add_post(CHAT_PATH, chat_completions)
    app.router.add_get(MODELS_PATH, list_models)
    # `.+`: a model name may hold '/' (`meta-llama/Llama-3-8B`), which clients that do not
    # percent-encode it send as is; the default pattern stops at the first '/'.
    app.router.add_get(MODELS_PATH + "/{model_id:.+}", get_model)
    app.on_response_prepare.append(_conversation_header)
    document(
        "POST",
        CHAT_PATH,
        summary="Chat completion (OpenAI-compatible); stream=true answers text/event-stream "
        "of chat.completion.chunk objects ending with data: [DONE]",
        tag="Chat (compatible)",
        request=ChatCompletionRequest,
        response=ChatCompletionResponse,
        extra_statuses=(409, 413, 502, 503, 504),
        other_content_types=("text/event-stream",),
        request_headers=(
            (
                IDEMPOTENCY_HEADER,
                "a retry with the same key returns the first result (docs/chat.md)",
            ),
            (CONVERSATION_HEADER, "continue this conversation; absent = a new one"),
        ),
        response_headers=(
            (CONVERSATION_HEADER, "the conversation the turn belongs to"),
            (CURSOR_HEADER, "JSON mode: cursor of the turn's last event, for ?min_cursor="),
        ),
    )
    document(
        "GET",
        MODELS_PATH,
        summary="Models this instance serves (OpenAI-compatible list); a blank "
        "SVC_LLM_MODEL with an upstream serves any name, which is not listed",
        tag="Chat (compatible)",
        response=ModelList,
    )
    document(
        "GET",
        MODELS_PATH + "/{model_id}",
        summary="One model this instance serves (OpenAI-compatible); 404 model_not_found "
        "for a name it does not serve",
        tag="Chat (compatible)",
        response=ModelCard,
        extra_statuses=(404,),
    )


def _providers(app: web.Application) -> list[ModelProvider] | None:
    models = app.get(MODEL_PROVIDERS)
    if isinstance(models, ProviderSet):
        return list(models.providers)
    if isinstance(models, list | tuple):
        return list(models)
    return None


def _check_model(app: web.Application, model: str, agent: Agent | None = None) -> None:
    """Refuse an unknown model before anything is recorded (the actor checks it again)."""
    providers = _providers(app)
    if providers is None:
        return
    if agent is None:
        select(providers, model)
        return
    try:
        select(providers, agent.model)
    except NotFound:
        raise NotFound(
            f"agent {agent.name!r} runs on model {agent.model!r}, which is not available on "
            "this instance; change the agent's model",
            code="model_not_found",
        ) from None


class AgentDirectory:
    """The active agents of each workspace by name, read from the `agents` read model at most
    once per `ttl_s` per workspace. Two active agents never share a name (names are checked
    before an agent is created or renamed); should the log ever hold two, the oldest wins, as
    in `agent_queries.find_active_agent`."""

    def __init__(self, ttl_s: float = AGENT_CACHE_TTL_S, max_workspaces: int = 2_000) -> None:
        self._cache: TtlCache[str, dict[str, Agent]] = TtlCache(ttl_s, max_workspaces)

    async def find(self, db: Database, workspace_id: str, name: str) -> Agent | None:
        return (await self._active(db, workspace_id)).get(name)

    async def names(self, db: Database, workspace_id: str) -> list[str]:
        """The names of the workspace's active agents, sorted."""
        return sorted(await self._active(db, workspace_id))

    async def _active(self, db: Database, workspace_id: str) -> dict[str, Agent]:
        async def load() -> dict[str, Agent]:
            return _by_name(await agent_queries.list_agents(db, workspace_id))

        return await self._cache.get(workspace_id, load)

    def forget(self, workspace_id: str | None = None) -> None:
        """Drop one workspace's entry (every entry without one): its next lookup reads."""
        if workspace_id is None:
            self._cache.clear()
        else:
            self._cache.forget(workspace_id)


AGENTS: web.AppKey[AgentDirectory] = web.AppKey("svc_chat_agents", AgentDirectory)


def _by_name(agents: list[Agent]) -> dict[str, Agent]:
    oldest_first = sorted(agents, key=lambda a: (a.created_at, a.agent_id), reverse=True)
    return {agent.name: agent for agent in oldest_first}


def forget_agents(app: web.Application, workspace_id: str) -> None:
    """Call after writing an agent of `workspace_id`, so this process serves the change at once."""
    directory = app.get(AGENTS)
    if directory is not None:
        directory.forget(workspace_id)


async def _agent_named(request: web.Request, principal: Principal, model: str) -> Agent | None:
    """The caller's active agent called `model`, if any."""
    db = request.app.get(DATABASE)
    directory = request.app.get(AGENTS)
    if db is None or directory is None:
        return None
    return await directory.find(db, principal.workspace_id, model)


async def list_models(request: web.Request) -> web.Response:
    principal = await authenticate(request)
    require_scope(principal, CHAT_SCOPE)
    body = ModelList(data=await _model_cards(request, principal)).model_dump_json().encode()
    return web.Response(body=body, content_type="application/json")


async def get_model(request: web.Request) -> web.Response:
    """One entry of the list (the SDKs' `models.retrieve`). A name that an upstream without
    `SVC_LLM_MODEL` would serve is not listed but is a model all the same."""
    principal = await authenticate(request)
    require_scope(principal, CHAT_SCOPE)
    model_id = request.match_info["model_id"]
    card = next((c for c in await _model_cards(request, principal) if c.id == model_id), None)
    if card is None:
        provider = select(_providers(request.app) or [], model_id)  # NotFound: model_not_found
        card = _served_card(request.app, model_id, provider)
    return web.Response(body=card.model_dump_json().encode(), content_type="application/json")


async def _model_cards(request: web.Request, principal: Principal) -> list[ModelCard]:
    cards = [
        _served_card(request.app, name, provider)
        for provider in _providers(request.app) or []
        for name in getattr(provider, "model_names", ())
    ]
    db = request.app.get(DATABASE)
    if db is not None:
        # An agent's name wins over a model of the same name (see the module docstring).
        agents = await agent_queries.list_agents(db, principal.workspace_id)
        names = {a.name for a in agents}
        cards = [card for card in cards if card.id not in names]
        cards += [
            ModelCard(id=a.name, created=int(a.created_at.timestamp()), owned_by="agent")
            for a in agents
        ]
    return cards


def _served_card(app: web.Application, name: str, provider: ModelProvider) -> ModelCard:
    return ModelCard(id=name, created=app[SERVING_SINCE], owned_by=getattr(provider, "name", "svc"))


@dataclass(frozen=True, slots=True)
class _Turn:
    key: ActorKey
    command: RunTurn
    completion_id: str
    model: str
    created: int
    keyed: bool
    """The request sent an Idempotency-Key: it can ask for this turn again."""

    def traced(self, traceparent: str | None) -> _Turn:
        """This turn, its model call carrying `traceparent` (the turn span's)."""
        command = self.command.model_copy(update={"traceparent": traceparent})
        return replace(self, command=command)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    started = time.perf_counter()
    turn: _Turn | None = None
    ids: _RequestIds | None = None
    try:
        principal = await _admitted(request)
        ids = _request_ids(request, principal)
        require_scope(principal, CHAT_SCOPE)
        body = await read_json(request, ChatCompletionRequest)
        agent = await _model_or_recorded(request, principal, ids, body.model)
        turn = _build_turn(ids, principal, body, agent)
        runtime = request.app[RUNTIME]
        with turn_span(request, body.stream) as span:
            if span is not None:
                turn = turn.traced(current_traceparent())
            if body.stream:
                return await _stream(request, runtime, turn, body.include_usage)
            return await _complete(runtime, turn, request.app[CURSORS])
    except SvcError as exc:
        _count_failed(turn, exc.code)
        if exc.code == "idempotency_key_reused" and turn and not turn.command.continue_only:
            # The conversation the key would have started was never used: name none.
            request.pop(_CONVERSATION_KEY, None)
        _unless_started(request, ids, turn)
        if exc.recorded_cursor is not None:
            # A failed turn, recorded: the answer names its conversation (whatever the
            # status: an upstream's 404 for the model comes after the turn started) and the
            # cursor that read-your-writes waits for.
            request[_FAILURE_CURSOR_KEY] = request.app[CURSORS].seal(exc.recorded_cursor)
            if ids is not None and ids.keyed:
                # The SDKs retry with the same headers, so with the same key, which can only
                # get this recorded failure back (after a Retry-After of up to two minutes):
                # said not to, and the client sends a new key when it means to try again.
                _no_retry(exc)
        elif (
            (exc.http_status < 500 or _refused_unrun(exc))
            and not isinstance(exc, TurnInProgress)
            and ids is not None
            and ids.new_conversation
        ):
            # A fresh conversation whose first turn the actor refused (no user message, say),
            # or that the runtime never ran (stopping, full): nothing was recorded under the
            # id, so the answer names none.
            request.pop(_CONVERSATION_KEY, None)
        elif _refused_unrun(exc) and ids is not None and not ids.named_by_client:
            await _forget_unstarted_keyed(request, ids)
        if isinstance(exc, AnswerAbandoned) and not (ids is not None and ids.keyed):
            # The turn runs on: an SDK's retry without a key would run it a second time.
            _no_retry(exc)
        told = exc if turn is None else _told(exc, turn)
        if told is not exc:
            raise told from None
        raise
    except ValidationError:
        _count_failed(turn, "invalid_request")  # a 400, as gateway/errors.py maps it
        _unless_started(request, ids, turn)
        raise
    except ConnectionResetError:
        raise  # the client left before its stream started; the turn goes on and is recorded
    except Exception:
        _count_failed(turn, "internal_error")
        raise
    finally:
        if turn is not None:
            TURN_DURATION.observe(time.perf_counter() - started)


def _told(exc: SvcError, turn: _Turn) -> SvcError:
    """`exc` as this turn's client is told it. Only the runtime's own retry, after losing
    the host running the turn, finds a keyless request's turn running: that client has no
    key to ask for it again, and an SDK's retry would run it again in a new conversation."""
    if isinstance(exc, TurnInProgress) and not turn.keyed:
        unkeyed = TurnInProgress(exc.unkeyed())
        _no_retry(unkeyed)
        return unkeyed
    return exc


def _no_retry(exc: SvcError) -> None:
    """`x-should-retry: false` on the answer to `exc`, without marking it final (a final
    internal error would show its cause)."""
    headers = getattr(exc, "headers", None)
    exc.headers = {**(headers if isinstance(headers, dict) else {}), "x-should-retry": "false"}  # type: ignore[attr-defined]


def _refused_unrun(exc: SvcError) -> bool:
    """A 503 by which the runtime refused the command before any actor ran it. Not its
    subclasses: a turn cut short once started (CommandInterrupted) is recorded, and one this
    process stopped waiting for (AnswerAbandoned) runs on in its Ray host."""
    return type(exc) in (RuntimeStopping, RuntimeNotStarted, MailboxFull)


async def _forget_unstarted_keyed(request: web.Request, ids: _RequestIds) -> None:
    """A keyed request's conversation id comes from its key: the conversation exists only if
    an earlier attempt ran. The runtime refused this one unrun, so name the id only then.
    When the ledger cannot say (the database away too), name none: a retry with the key
    gets the id either way."""
    principal = request.get(PRINCIPAL)
    named = False
    if principal is not None:
        with contextlib.suppress(SvcError):
            named = await first_attempt_ran(request, principal.workspace_id, ids.command_id)
    if not named:
        request.pop(_CONVERSATION_KEY, None)


def _count_failed(turn: _Turn | None, code: str) -> None:
    """Count a failed turn: one the actor was asked to run, as svc_turn_duration_seconds
    counts turns (the alert divides one by the other). A request refused before its turn
    was built (a 401, a 429, a bad body) is no failed turn; svc_http_errors_total has it."""
    if turn is not None:
        TURN_ERRORS.labels(code).inc()


async def _model_or_recorded(
    request: web.Request, principal: Principal, ids: _RequestIds, model: str
) -> Agent | None:
    """The agent `model` names, if any, after checking the model is served. A retry whose
    first attempt was recorded is answered with that record whatever the model is now (the
    agent archived or renamed since): the actor answers it without calling a model."""
    agent = None
    try:
        agent = await _agent_named(request, principal, model)
        _check_model(request.app, model, agent)
    except NotFound as exc:
        if not await first_attempt_ran(request, principal.workspace_id, ids.command_id):
            if agent is not None:  # an agent's model gone: its own message says so
                raise
            raise await _with_agent_names(request, principal, exc) from None
        return None
    return agent


async def _with_agent_names(request: web.Request, principal: Principal, exc: NotFound) -> NotFound:
    """An unknown model's 404, naming the workspace's agents too: a model may be one (the
    message named the served models only, an agent just renamed nowhere)."""
    db, directory = request.app.get(DATABASE), request.app.get(AGENTS)
    if db is None or directory is None:
        return exc
    names = await directory.names(db, principal.workspace_id)
    if not names:
        return exc
    shown = ", ".join(repr(name) for name in names[:_AGENTS_NAMED])
    more = f" and {len(names) - _AGENTS_NAMED:,} more" if len(names) > _AGENTS_NAMED else ""
    return NotFound(f"{exc.message}; agents of this workspace: {shown}{more}", code=exc.code)


_AGENTS_NAMED = 20
"""The most agent names a model_not_found message lists (GET /v1/models lists them all)."""


async def _admitted(request: web.Request) -> Principal:
    """The authenticated principal. A request refused by its key's rate limit (429) still
    names the conversation it asked to continue, so the client can retry that one."""
    try:
        return await authenticate(request)
    except RateLimited:
        with contextlib.suppress(InvalidInput):
            named = read_header_id(request, CONVERSATION_HEADER)
            if named is not None:
                request[_CONVERSATION_KEY] = named
        raise


def _unless_started(request: web.Request, ids: _RequestIds | None, turn: _Turn | None) -> None:
    """A request refused before its turn was built (validation, scope, an unknown model)
    started no conversation: its response names one only when the client did."""
    if turn is None and ids is not None and not ids.named_by_client:
        request.pop(_CONVERSATION_KEY, None)


@dataclass(frozen=True, slots=True)
class _RequestIds:
    command_id: str
    conversation_id: str
    new_conversation: bool
    """The conversation id was drawn at random here: no stream can exist for it yet."""
    named_by_client: bool
    """The client sent the conversation id: the turn continues that conversation or fails."""
    keyed: bool
    """An Idempotency-Key names the turn: a retry under it must be the same request."""


def _request_ids(request: web.Request, principal: Principal) -> _RequestIds:
    """The ids of this request; the conversation id goes out in the response header from here
    on, error responses included. A conversation id derived from an idempotency key is not
    new: a retry of the request finds the conversation its first attempt started."""
    conversation_id = read_header_id(request, CONVERSATION_HEADER)
    if conversation_id is not None:
        # Named before the key is checked: a refused key is a refusal before the turn
        # started, whose answer carries the id the request named.
        request[_CONVERSATION_KEY] = conversation_id
    idempotency_key = read_header_id(request, IDEMPOTENCY_HEADER)
    if idempotency_key is not None:
        check_client_key(IDEMPOTENCY_HEADER, idempotency_key)
    command_id = (
        _keyed_command_id(principal, idempotency_key) if idempotency_key else uuid.uuid4().hex
    )
    named_by_client = conversation_id is not None
    new_conversation = conversation_id is None and idempotency_key is None
    if conversation_id is None:
        conversation_id = (
            _stable_id(principal.workspace_id, "conversation", command_id)
            if idempotency_key
            else str(uuid.uuid4())
        )
    request[_CONVERSATION_KEY] = conversation_id
    keyed = idempotency_key is not None
    return _RequestIds(command_id, conversation_id, new_conversation, named_by_client, keyed)


def _body_digest(model: str, messages: tuple[Message, ...], params: TurnParams) -> str:
    """What a retry under an Idempotency-Key must repeat: the model as asked (an agent's
    name, not what it resolves to, which may change between attempts), the messages and the
    parameters, as the client sent them. `stream` is not part of it: a request retried as a
    stream is the same request."""
    sent = {
        "model": model,
        "messages": [m.model_dump(mode="json") for m in messages],
        "params": params.model_dump(mode="json"),
    }
    return hashlib.sha256(orjson.dumps(sent, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


def _keyed_command_id(principal: Principal, idempotency_key: str) -> str:
    """The RunTurn's command id for a client's Idempotency-Key. Keys are chosen by clients,
    so two principals of a workspace may pick the same one: the id (and the conversation,
    turn and message ids derived from it) includes the key's owner, so that neither ever
    gets the other's recorded answer or conversation, while a retry by the same owner lands
    on its first attempt. It lies in the service's namespace (`svc:`), which no client key
    of any endpoint can enter, so it cannot meet a raw key in the workspace's ledger."""
    owner = hashlib.sha256(principal.owner().encode()).hexdigest()[:24]
    return service_command_id("chat", f"{owner}:{idempotency_key}")


def _build_turn(
    ids: _RequestIds, principal: Principal, body: ChatCompletionRequest, agent: Agent | None
) -> _Turn:
    command_id, conversation_id = ids.command_id, ids.conversation_id
    turn_id = _stable_id(principal.workspace_id, "turn", f"{conversation_id}/{command_id}")
    now = datetime.now(UTC)
    messages = tuple(
        Message(role=m.model_role, content=m.text, name=m.name or None) for m in body.messages
    )
    params = TurnParams(
        temperature=body.temperature,
        top_p=body.top_p,
        max_tokens=body.token_limit,
        max_tokens_as=body.token_limit_name,
        stop=body.stop_sequences,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        reasoning_effort=body.reasoning_effort,
        verbosity=body.verbosity,
    )
    digest = _body_digest(body.model, messages, params) if ids.keyed else None
    if agent is not None:
        messages, params = _with_agent(agent, messages, params)
    command = RunTurn(
        command_id=command_id,
        workspace_id=principal.workspace_id,
        new_stream=ids.new_conversation,
        continue_only=ids.named_by_client,
        turn_id=turn_id,
        message_id=_stable_id(principal.workspace_id, "message", turn_id),
        model=body.model if agent is None else agent.model,
        messages=messages,
        params=params,
        agent=None if agent is None else agent.agent_id,
        at=now,
        body_digest=digest,
    )
    return _Turn(
        key=conversation_key(conversation_id),
        command=command,
        completion_id=f"chatcmpl-{turn_id}",
        model=body.model,
        created=int(now.timestamp()),
        keyed=ids.keyed,
    )


def _with_agent(
    agent: Agent, messages: tuple[Message, ...], params: TurnParams
) -> tuple[tuple[Message, ...], TurnParams]:
    """The agent's system prompt first, its parameters where the request set none."""
    if agent.system_prompt:
        messages = (Message(role="system", content=agent.system_prompt), *messages)
        if len(messages) > MAX_MESSAGES:
            raise InvalidInput(
                f"messages: at most {MAX_MESSAGES - 1} with agent {agent.name!r}, whose system "
                "prompt takes one place"
            )
    defaults = agent.parameters
    reasoning_effort = params.reasoning_effort or defaults.reasoning_effort
    update: dict[str, Any] = {
        "temperature": defaults.temperature if params.temperature is None else params.temperature,
        "top_p": defaults.top_p if params.top_p is None else params.top_p,
        "reasoning_effort": reasoning_effort,
    }
    if params.max_tokens is None and defaults.max_tokens is not None:
        # The agent's limit, under the name a reasoning model takes (an agent with a
        # reasoning effort is meant for one): OpenAI's refuse `max_tokens`.
        update["max_tokens"] = defaults.max_tokens
        update["max_tokens_as"] = "max_completion_tokens" if reasoning_effort else None
    return messages, params.model_copy(update=update)


def _stable_id(workspace_id: str, kind: str, seed: str) -> str:
    """Ids derived from the idempotency key stay the same on every retry of a request."""
    return str(uuid.uuid5(_KEY_NAMESPACE, f"{workspace_id}/{kind}/{seed}"))


async def _conversation_header(request: web.Request, response: web.StreamResponse) -> None:
    conversation_id = request.get(_CONVERSATION_KEY)
    if isinstance(conversation_id, str):
        response.headers[CONVERSATION_HEADER] = conversation_id
    failure_cursor = request.get(_FAILURE_CURSOR_KEY)
    if isinstance(failure_cursor, str):
        response.headers[CURSOR_HEADER] = failure_cursor


async def _complete(runtime: ActorRuntime, turn: _Turn, cursors: CursorSeal) -> web.Response:
    result = await runtime.ask(turn.key, turn.command)
    if not isinstance(result, TurnResult):
        raise TypeError(f"conversation actor answered {type(result).__name__}, not TurnResult")
    record_turn(result)
    # The `ChatCompletionResponse` shape.
    response = {
        "id": turn.completion_id,
        "object": "chat.completion",
        "created": turn.created,
        "model": _answering_model(turn, result),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.content},
                "finish_reason": result.finish_reason,
                "logprobs": None,
            }
        ],
        "usage": _usage(result),
        "system_fingerprint": None,
    }
    return web.Response(
        body=orjson.dumps(response),
        content_type="application/json",
        headers={CURSOR_HEADER: cursors.seal(result.cursor)} if result.cursor else {},
    )


def _answering_model(turn: _Turn, result: TurnResult) -> str:
    """The name the client asked for (an agent's name stays as asked), unless the answer is
    the recorded one of an earlier request with the same key that ran another model."""
    return turn.model if result.model == turn.command.model else result.model


def _usage(result: TurnResult) -> dict[str, int]:
    """The `CompletionUsage` shape."""
    usage = result.usage
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


async def _stream(
    request: web.Request, runtime: ActorRuntime, turn: _Turn, include_usage: bool
) -> web.StreamResponse:
    items = aiter(runtime.stream(turn.key, turn.command))
    first = asyncio.ensure_future(anext(items, None))
    try:
        # Failures before the first item (a foreign conversation, the upstream down before any
        # text) within FIRST_ITEM_GRACE_S still get their own HTTP status; after that, an SSE
        # error frame.
        if (await asyncio.wait({first}, timeout=FIRST_ITEM_GRACE_S))[0]:
            first.result()
        sender = _ChunkSender(request, await open_sse(request), turn, include_usage)
        keep_alive = asyncio.create_task(sender.keep_alive())
        try:
            await _relay(sender, _from_first(first, items))
        finally:
            await cancel_unless_done(keep_alive)
    finally:
        await cancel_unless_done(first)
        close = getattr(items, "aclose", None)
        if close is not None:
            await close()
    await sender.close()
    return sender.response


FIRST_ITEM_GRACE_S = 5.0
"""How long a stream waits for its first item before it answers 200: a failure within it
keeps its own HTTP status. A reasoning model may think for minutes before its first word,
and a proxy with an idle timeout (60 s is common) would answer 504 to a silent response,
which the SDKs retry as a new turn, while the first one runs on."""

STREAM_WRITE_TIMEOUT_S = 30.0
"""How long one write may wait for the client to take bytes from a full socket buffer. A
write waits only while the buffer is over its high-water mark (64 KiB, until under 16 KiB),
so a client reading 2 KB/s or more never waits that long; one that stopped reading is cut
off."""

STREAM_HEARTBEAT_S = 15.0
"""The silence after which a stream sends an SSE comment (which clients skip), as the feeds
do: while it waits for its first item, and when the model pauses mid-answer (a tool call
being composed, an upstream stall), either of which can outlast a proxy's idle timeout."""


async def _from_first(
    first: asyncio.Future[Any], rest: AsyncIterator[Any]
) -> AsyncGenerator[Any, None]:
    """The stream's items from `first` on; its failure raised here, where the relay makes it
    an error frame."""
    item = await first
    if item is not None:
        yield item
    async for item in rest:
        yield item


async def _relay(sender: _ChunkSender, items: AsyncGenerator[Any, None]) -> None:
    result: TurnResult | None = None
    try:
        async for item in items:
            if isinstance(item, TextDelta):
                await sender.delta(item.text)
                if sender.client_gone:
                    # The runtime runs the turn to its end and records it without a reader.
                    return
            elif isinstance(item, TurnResult):
                result = item
        if sender.client_gone:  # a heartbeat found it gone
            return
        if result is None:
            raise RuntimeError("conversation actor ended the stream without a TurnResult")
        record_turn(result)
        await sender.finish(result)
    except SvcError as exc:
        record_failure(exc)
        if exc.internal:
            # An internal failure: its message may carry database detail, so the client gets
            # only the id, as from gateway.errors.internal_error.
            await _internal_stream_error(sender, exc)
        else:
            TURN_ERRORS.labels(exc.code).inc()
            told = _told(exc, sender.turn)
            await sender.error(told.message, told.error_type, told.code, cursor=exc.recorded_cursor)
    except Exception as exc:
        record_failure(exc)
        await _internal_stream_error(sender, exc)
    finally:
        await items.aclose()


async def _internal_stream_error(sender: _ChunkSender, exc: BaseException) -> None:
    hidden = internal_failure("chat stream", exc, sender.request)
    TURN_ERRORS.labels(hidden.code).inc()
    cursor = exc.recorded_cursor if isinstance(exc, SvcError) else None
    await sender.error(hidden.message, hidden.error_type, hidden.code, cursor=cursor)


class _ChunkSender:
    """Writes `chat.completion.chunk` frames; notes when the client has gone away."""

    def __init__(
        self,
        request: web.Request,
        response: web.StreamResponse,
        turn: _Turn,
        include_usage: bool,
    ) -> None:
        self.request = request
        self.response = response
        self.turn = turn
        self._model = turn.model
        self._include_usage = include_usage
        self._sent_role = False
        self._streamed: list[str] = []  # the text sent, to check against the recorded answer
        self.client_gone = False
        self._last_write = asyncio.get_running_loop().time()
        self._writing = 0  # writes under way (waiting for the client to take the bytes)
        self._heartbeats_over = False

    def _chunk(
        self,
        delta: dict[str, str] | None,
        finish_reason: str | None = None,
        usage: dict[str, int] | None = None,
    ) -> bytes:
        """A `ChatCompletionChunk`; `delta` holds only the keys that carry something."""
        choices = (
            []
            if delta is None
            else [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
        )
        chunk = {
            "id": self.turn.completion_id,
            "object": "chat.completion.chunk",
            "created": self.turn.created,
            "model": self._model,
            "choices": choices,
            "usage": usage,
            "system_fingerprint": None,
        }
        return orjson.dumps(chunk)

    async def _send(self, data: bytes, *, id: str | None = None) -> None:
        if id is not None:
            # The OpenAI SDKs keep an event's id and then take every blank line for an event:
            # a heartbeat after this frame would reach them as an empty event, not JSON.
            self._heartbeats_over = True
        await self._write(send_event(self.response, data, id=id))

    async def keep_alive(self) -> None:
        """Sends a heartbeat after every STREAM_HEARTBEAT_S without a write, until the
        client goes away, the closing frames begin (the first with an `id:`), or the task is
        cancelled when the stream ends. A write still waiting for a slow client counts as
        activity: its bytes are on their way. aiohttp writes each frame whole, so a heartbeat
        cannot split a chunk written beside it."""
        loop = asyncio.get_running_loop()
        while not self.client_gone and not self._heartbeats_over:
            silent_s = loop.time() - self._last_write
            if self._writing:
                await asyncio.sleep(STREAM_HEARTBEAT_S / 4)
            elif silent_s >= STREAM_HEARTBEAT_S:
                await self._write(send_comment(self.response))
            else:
                await asyncio.sleep(STREAM_HEARTBEAT_S - silent_s)

    async def _write(self, write: Coroutine[Any, Any, None]) -> None:
        if self.client_gone:
            write.close()
            return
        loop = asyncio.get_running_loop()
        self._last_write = loop.time()
        self._writing += 1
        try:
            async with asyncio.timeout(STREAM_WRITE_TIMEOUT_S):
                await write
        except ConnectionError:
            # Reset, broken pipe, or aiohttp's "Connection lost" when the client hangs up
            # while a write waits for its buffer to drain: all the client leaving.
            self._gone()
        except TimeoutError:
            self._stalled()
        finally:
            self._writing -= 1
            self._last_write = loop.time()

    def _stalled(self) -> None:
        """The client took none of a full socket buffer for STREAM_WRITE_TIMEOUT_S: cut off,
        as the feeds cut a stalled reader, so it holds neither this handler nor the answer's
        undelivered text. The turn goes on and is recorded, as for a client that left."""
        log.info("chat client took nothing for %g s; its stream is cut off", STREAM_WRITE_TIMEOUT_S)
        transport = self.request.transport
        if transport is not None:
            transport.abort()
        self._gone()

    def _gone(self) -> None:
        self.client_gone = True
        client_gone(self.request)
        log.info("chat client went away mid-stream; the turn continues and is recorded")

    async def delta(self, text: str) -> None:
        if not text:
            return
        delta = {"content": text} if self._sent_role else {"role": "assistant", "content": text}
        self._sent_role = True
        self._streamed.append(text)
        await self._send(self._chunk(delta))

    async def finish(self, result: TurnResult) -> None:
        if not self._streamed:  # a recorded answer, replayed whole
            self._model = _answering_model(self.turn, result)
            await self.delta(result.content)
        else:
            await self._complete_text(result.content)
        if not self._sent_role:
            # An empty answer: as OpenAI, the role comes in a chunk of its own, with empty
            # content, and the finishing chunk's delta is empty whatever came before it.
            self._sent_role = True
            await self._send(self._chunk({"role": "assistant", "content": ""}))
        final = self._chunk({}, finish_reason=result.finish_reason)
        await self._send(final, id=self._public(result.cursor))
        if self._include_usage:
            await self._send(self._chunk(None, usage=_usage(result)))
        await self._send(b"[DONE]")

    async def _complete_text(self, recorded: str) -> None:
        """The deltas may stop short of the answer: a runtime that retried the turn behind
        this stream (a Ray host it lost touch with) gets the recorded result, without the
        deltas it had not passed on. Send the rest; when what was sent does not begin the
        recorded answer (another attempt's text), the client is told how to get that."""
        sent = "".join(self._streamed)
        if recorded.startswith(sent):
            await self.delta(recorded[len(sent) :])
            return
        raise Unavailable(
            "the answer's stream was interrupted and the text sent so far does not begin the "
            "recorded answer; read that from the conversation named in X-SVC-Conversation-Id, "
            "or send the request again with its Idempotency-Key, if it had one",
            code="stream_interrupted",
        )

    async def error(
        self, message: str, error_type: str, code: str | None, *, cursor: str | None = None
    ) -> None:
        """The error frame; with the cursor of the failure recorded for the turn as its SSE
        `id:`, as the finishing chunk of a completed turn carries its own."""
        body = orjson.dumps(error_body(message, error_type, code))
        await self._send(body, id=self._public(cursor))

    def _public(self, cursor: str | None) -> str | None:
        return self.request.app[CURSORS].seal(cursor) if cursor else None

    async def close(self) -> None:
        await self._write(self.response.write_eof())
