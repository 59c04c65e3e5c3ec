"""Agent administration under /v1/admin/agents: create, list, read, update, archive.

Writes are commands to the agent actor (`agent:<id>`, actors/agent.py); the handlers never
write a table. Each write waits (bounded) for the read models to apply it before answering,
so the agent is usable as a chat `model` as soon as the response arrives (gateway/chat.py
resolves names through the `agents` read model). Reads come from that read model.

Names are unique among a workspace's active agents. The agent actor only knows itself, so the
check is made here against the read model, under a per-workspace lock held until the write is
applied: two concurrent creates through one gateway process cannot both take a name. (Two
gateway processes racing on one name in the same few milliseconds could; see docs/chat.md.)

A create's agent id derives from its command id, so a retry with the same Idempotency-Key
reaches the same actor and answers with the agent the first attempt created.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from datetime import UTC, datetime

from aiohttp import web

from actors.agent import agent_key
from actors.behaviour import CommandOutcome
from actors.models.registry import select
from gateway.admin_common import (
    READ,
    WRITE,
    acting,
    ask,
    not_applied,
    ok,
    public_cursor,
    read_your_writes,
    wait_applied,
)
from gateway.chat import forget_agents
from gateway.errors import read_json, read_query, refuse_body
from gateway.identity.common import command_id, first_attempt_ran
from gateway.openapi import IDEMPOTENCY_KEY, document
from gateway.state import DATABASE, MODEL_PROVIDERS, Principal
from projections import agent_queries
from projections.agents import AgentsProjector
from schemas.admin import AdminRead, NoQuery
from schemas.agent import ArchiveAgent, CreateAgent, UpdateAgent
from schemas.agent_admin import (
    AgentCreate,
    AgentList,
    AgentListQuery,
    AgentRecord,
    AgentUpdate,
    WrittenAgent,
)
from schemas.commands import Command
from schemas.errors import Conflict, InvalidInput, NotFound, SvcError, echoed

AGENTS = "/v1/admin/agents"
AGENT = "/v1/admin/agents/{agent_id}"
ARCHIVE = "/v1/admin/agents/{agent_id}/archive"
TAG = "Agents & orchestration"
AGENT_MODELS = (AgentsProjector.name,)

_NAME_LOCKS: web.AppKey[dict[str, asyncio.Lock]] = web.AppKey("svc_agent_name_locks", dict)
_UNAPPLIED: web.AppKey[dict[str, str]] = web.AppKey("svc_agent_writes_unapplied", dict)
"""Per workspace, the cursor of the last agent write whose wait for the read model gave up:
until it is applied, a name's check against the read model could miss the name it took."""
_AGENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,199}$")
_ID_NAMESPACE = uuid.UUID("0b8c59b4-9f3e-4f4c-8a43-6f1d2f0c7a11")


def add_routes(app: web.Application) -> None:
    app[_NAME_LOCKS] = {}
    app[_UNAPPLIED] = {}
    app.router.add_post(AGENTS, create_agent)
    app.router.add_get(AGENTS, list_agents)
    app.router.add_get(AGENT, get_agent)
    app.router.add_patch(AGENT, update_agent)
    app.router.add_post(ARCHIVE, archive_agent)
    document(
        "POST",
        AGENTS,
        summary="Create an agent: a named model, system prompt and parameters, usable as "
        "`model` in chat (admin:write)",
        tag=TAG,
        request=AgentCreate,
        response=WrittenAgent,
        response_status=201,
        extra_statuses=(409, 503),
        request_headers=(IDEMPOTENCY_KEY,),
    )
    document(
        "GET",
        AGENTS,
        summary="Agents of the workspace, by name, a page at a time (admin:read)",
        tag=TAG,
        query=AgentListQuery,
        response=AgentList,
        extra_statuses=(503,),
    )
    document(
        "GET",
        AGENT,
        summary="One agent, archived or not (admin:read)",
        tag=TAG,
        query=AdminRead,
        response=AgentRecord,
        extra_statuses=(503,),
    )
    document(
        "PATCH",
        AGENT,
        summary="Change an agent's name, description, model, system prompt or parameters "
        "(admin:write)",
        tag=TAG,
        request=AgentUpdate,
        response=WrittenAgent,
        extra_statuses=(409, 503),
        request_headers=(IDEMPOTENCY_KEY,),
    )
    document(
        "POST",
        ARCHIVE,
        summary="Archive an agent: its name stops resolving in chat and is free again "
        "(admin:write)",
        tag=TAG,
        response=WrittenAgent,
        extra_statuses=(503,),
        request_headers=(IDEMPOTENCY_KEY,),
    )


# --- handlers -----------------------------------------------------------------------------------


async def create_agent(request: web.Request) -> web.Response:
    principal = await acting(request, WRITE)
    read_query(request, NoQuery)
    body = await read_json(request, AgentCreate)
    cid = command_id(request)
    retry = await first_attempt_ran(request, principal.workspace_id, cid)
    if not retry:
        _check_model(request, body.model)
    agent_id = "agt_" + uuid.uuid5(_ID_NAMESPACE, f"{principal.workspace_id}/{cid}").hex
    command = CreateAgent(
        command_id=cid,
        workspace_id=principal.workspace_id,
        name=body.name,
        description=body.description,
        model=body.model,
        system_prompt=body.system_prompt,
        parameters=body.parameters,
        at=datetime.now(UTC),
    )
    async with _names_lock(request, principal):
        if not retry:
            await _require_free_name(request, principal, body.name, agent_id)
        outcome = await _execute(request, agent_id, command)
    return ok(await _written(request, principal, agent_id, outcome), status=201)


async def list_agents(request: web.Request) -> web.Response:
    principal = await acting(request, READ)
    params = read_query(request, AgentListQuery)
    await read_your_writes(request, AGENT_MODELS)
    agents, total = await agent_queries.page_agents(
        request.app[DATABASE],
        principal.workspace_id,
        include_archived=params.include_archived,
        limit=params.limit,
        offset=params.offset,
    )
    listed = [_record(a) for a in agents]
    return ok(AgentList(agents=listed, total=total, limit=params.limit, offset=params.offset))


async def get_agent(request: web.Request) -> web.Response:
    principal = await acting(request, READ)
    read_query(request, AdminRead)
    await read_your_writes(request, AGENT_MODELS)
    return ok(_record(await _read(request, principal, _path_id(request))))


async def update_agent(request: web.Request) -> web.Response:
    principal = await acting(request, WRITE)
    agent_id = _path_id(request)
    read_query(request, NoQuery)
    body = await read_json(request, AgentUpdate)
    cid = command_id(request)
    retry = await first_attempt_ran(request, principal.workspace_id, cid)
    if body.model is not None and not retry:
        _check_model(request, body.model)
    command = UpdateAgent(
        command_id=cid,
        workspace_id=principal.workspace_id,
        name=body.name,
        description=body.description,
        model=body.model,
        system_prompt=body.system_prompt,
        parameters=body.parameters,
        at=datetime.now(UTC),
    )
    if body.name is None or retry:
        outcome = await _execute(request, agent_id, command)
    else:
        async with _names_lock(request, principal):
            await _require_free_name(request, principal, body.name, agent_id)
            outcome = await _execute(request, agent_id, command)
    return ok(await _written(request, principal, agent_id, outcome))


async def archive_agent(request: web.Request) -> web.Response:
    principal = await acting(request, WRITE)
    agent_id = _path_id(request)
    read_query(request, NoQuery)
    await refuse_body(request)
    command = ArchiveAgent(
        command_id=command_id(request), workspace_id=principal.workspace_id, at=datetime.now(UTC)
    )
    outcome = await _execute(request, agent_id, command)
    return ok(await _written(request, principal, agent_id, outcome))


# --- helpers ------------------------------------------------------------------------------------


async def _execute(request: web.Request, agent_id: str, command: Command) -> CommandOutcome:
    outcome = await ask(request, agent_key(agent_id), command)
    if not isinstance(outcome, CommandOutcome):
        raise SvcError("the agent actor answered without an outcome")
    if outcome.cursor and not await wait_applied(request, outcome.cursor, AGENT_MODELS):
        request.app[_UNAPPLIED][command.workspace_id] = outcome.cursor
        raise not_applied(
            request,
            AGENT_MODELS,
            "the read models did not apply it in time",
            recorded=f"agent {agent_id} was changed (read it with "
            f"min_cursor={public_cursor(request, outcome.cursor)})",
        )
    forget_agents(request.app, command.workspace_id)  # this process serves the change at once
    return outcome


async def _written(
    request: web.Request, principal: Principal, agent_id: str, outcome: CommandOutcome
) -> WrittenAgent:
    agent = await _read(request, principal, agent_id)
    return WrittenAgent(
        **_record(agent).model_dump(), cursor=public_cursor(request, outcome.cursor)
    )


async def _read(request: web.Request, principal: Principal, agent_id: str) -> agent_queries.Agent:
    agent = await agent_queries.get_agent(request.app[DATABASE], principal.workspace_id, agent_id)
    if agent is None:
        raise NotFound(f"agent {echoed(agent_id)} does not exist")
    return agent


async def _require_free_name(
    request: web.Request, principal: Principal, name: str, agent_id: str
) -> None:
    """Under the workspace's names lock. A write of this process the read model has not
    applied yet (its answer was a 503) may have taken the name: it is waited for first, and
    while it is not applied no name is given, rather than given twice."""
    unapplied = request.app[_UNAPPLIED]
    cursor = unapplied.get(principal.workspace_id)
    if cursor is not None:
        if not await wait_applied(request, cursor, AGENT_MODELS):
            raise not_applied(
                request,
                AGENT_MODELS,
                "an earlier change of this workspace's agents is not applied yet, and agent "
                "names are checked against it; retry shortly",
            )
        if unapplied.get(principal.workspace_id) == cursor:
            del unapplied[principal.workspace_id]
    holder = await agent_queries.find_active_agent(
        request.app[DATABASE], principal.workspace_id, name
    )
    if holder is not None and holder.agent_id != agent_id:
        raise Conflict(
            f"an active agent is already called {name!r} ({holder.agent_id}); choose another "
            "name or archive that agent first",
            code="agent_name_taken",
        )


def _names_lock(request: web.Request, principal: Principal) -> asyncio.Lock:
    locks = request.app[_NAME_LOCKS]
    return locks.setdefault(principal.workspace_id, asyncio.Lock())


def _check_model(request: web.Request, model: str) -> None:
    providers = request.app.get(MODEL_PROVIDERS)
    if providers is None:
        return
    try:
        select(providers.providers, model)
    except NotFound as exc:
        raise InvalidInput(exc.message, code="model_not_found") from None


def _path_id(request: web.Request) -> str:
    agent_id = request.match_info["agent_id"]
    if not _AGENT_ID.match(agent_id):
        raise NotFound(f"agent {echoed(agent_id)} does not exist")
    return agent_id


def _record(agent: agent_queries.Agent) -> AgentRecord:
    return AgentRecord(
        id=agent.agent_id,
        name=agent.name,
        description=agent.description,
        model=agent.model,
        system_prompt=agent.system_prompt,
        parameters=agent.parameters,
        archived=agent.archived,
        created_at=agent.created_at,
        updated_at=agent.updated_at,
        archived_at=agent.archived_at,
    )
