"""Agents as models: /v1/admin/agents over real HTTP, then the real `openai` SDK calling
`model=<agent name>` against the whole service, with the stub OpenAI-compatible upstream of
test_chat.py recording what reached the model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from test_admin_support import GatewayTestServer, Service, uid
from test_chat import HELLO, UPSTREAM_MODEL, Chat, stub_upstream

import gateway.app
import gateway.bootstrap
from gateway import admin_agents
from gateway.app import create_app
from gateway.settings import Settings
from gateway.state import PROJECTIONS, STORE
from projections import default_projectors
from projections.agents import AgentsProjector
from projections.projector import Projector
from schemas.events import EventFromNewerVersion

AGENTS = "/v1/admin/agents"
PROMPT = "You are Ada, the support agent of ACME. Answer in one line."


@pytest.fixture
def agents_wired(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Until gateway/app.py and projections/__init__.py wire them in: the agents projector in
    the runner and the admin routes in the app. Returns the extra route installers."""
    if not any(p.name == AgentsProjector.name for p in default_projectors()):

        def with_agents() -> list[Projector]:
            return [*default_projectors(), AgentsProjector()]

        monkeypatch.setattr(gateway.bootstrap, "default_projectors", with_agents)
    wired = admin_agents.add_routes in gateway.app.ROUTES
    yield [] if wired else [admin_agents.add_routes]


@pytest.fixture
async def chat(database_url: str, tmp_path: Path, agents_wired: list[Any]) -> AsyncIterator[Chat]:
    stub = await stub_upstream.StubUpstream(tokens=5).start()
    settings = Settings(
        {
            "SVC_DATABASE_URL": database_url,
            "SVC_DATA_DIR": str(tmp_path),
            "SVC_LLM_GATEWAY_URL": stub.base_url,
            "SVC_LLM_MODEL": UPSTREAM_MODEL,
            "SVC_LLM_RETRIES": "1",
            "SVC_LLM_CALL_TIMEOUT_S": "30",
        }
    )
    server = GatewayTestServer(create_app(settings, extra_routes=agents_wired), host="127.0.0.1")
    await server.start_server()
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
    service = Service(server.app, server, http)
    try:
        workspace = uid("ws-")
        chat = Chat(service, stub, workspace, "")
        chat.key = await chat.issue_key(workspace, scopes=("*",))
        yield chat
        for client in chat.clients:
            await client.close()
    finally:
        await http.close()
        await server.close()
        await stub.stop()


async def send(
    chat: Chat, method: str, path: str, body: Any = None, *, key: str | None = None, **headers: str
) -> tuple[int, Any]:
    resp = await chat.service.http.request(
        method,
        chat.service.url(path),
        headers=chat.service.auth(key or chat.key, **headers),
        json=body,
    )
    return resp.status, orjson.loads(await resp.read())


async def create_agent(chat: Chat, key: str | None = None, **fields: Any) -> dict[str, Any]:
    body = {"name": uid("ada-"), "model": UPSTREAM_MODEL, "system_prompt": PROMPT, **fields}
    status, agent = await send(chat, "POST", AGENTS, body, key=key)
    assert status == 201, agent
    return dict(agent)


# --- admin API ---------------------------------------------------------------------------------


async def test_create_list_get_update_and_archive(chat: Chat) -> None:
    agent = await create_agent(chat, parameters={"temperature": 0.2, "max_tokens": 7})
    assert agent["id"].startswith("agt_") and agent["cursor"]
    assert (agent["model"], agent["system_prompt"], agent["archived"]) == (
        UPSTREAM_MODEL,
        PROMPT,
        False,
    )
    assert agent["parameters"]["temperature"] == 0.2

    status, listed = await send(chat, "GET", AGENTS)
    assert status == 200 and [a["id"] for a in listed["agents"]] == [agent["id"]]
    status, one = await send(chat, "GET", f"{AGENTS}/{agent['id']}")
    assert status == 200 and one["name"] == agent["name"]

    status, changed = await send(
        chat, "PATCH", f"{AGENTS}/{agent['id']}", {"name": "ada-renamed", "model": "svc-offline"}
    )
    assert status == 200, changed
    assert (changed["name"], changed["model"], changed["system_prompt"]) == (
        "ada-renamed",
        "svc-offline",
        PROMPT,
    )
    # The same values again append nothing: the empty cursor is "nothing to wait for".
    status, same = await send(chat, "PATCH", f"{AGENTS}/{agent['id']}", {"name": "ada-renamed"})
    assert (status, same["cursor"]) == (200, ""), same
    status, one = await send(chat, "GET", f"{AGENTS}/{agent['id']}?min_cursor={same['cursor']}")
    assert status == 200 and one["name"] == "ada-renamed"

    status, archived = await send(chat, "POST", f"{AGENTS}/{agent['id']}/archive")
    assert status == 200 and archived["archived"] and archived["archived_at"]
    status, listed = await send(chat, "GET", AGENTS)
    assert listed["agents"] == []
    status, listed = await send(chat, "GET", AGENTS + "?include_archived=true")
    assert [a["id"] for a in listed["agents"]] == [agent["id"]]
    resp = await chat.service.http.patch(
        chat.service.url(f"{AGENTS}/{agent['id']}"),
        json={"description": "x"},
        headers=chat.service.auth(chat.key),
    )
    refused = orjson.loads(await resp.read())
    assert resp.status == 409 and refused["error"]["code"] == "agent_archived", refused
    assert resp.headers["x-should-retry"] == "false"  # the SDKs retry a 409 otherwise


async def test_the_list_comes_a_page_at_a_time(chat: Chat) -> None:
    """Review finding: the list had no bound, and each agent may carry a system prompt of
    100,000 characters."""
    made = [await create_agent(chat, name=f"pager-{n}") for n in range(3)]
    status, archived = await send(chat, "POST", f"{AGENTS}/{made[0]['id']}/archive")
    assert status == 200, archived
    status, first = await send(chat, "GET", AGENTS + "?limit=1")
    assert status == 200, first
    assert [a["name"] for a in first["agents"]] == ["pager-1"]
    assert (first["total"], first["limit"], first["offset"]) == (2, 1, 0)
    status, rest = await send(chat, "GET", AGENTS + "?limit=1&offset=1")
    assert [a["name"] for a in rest["agents"]] == ["pager-2"] and rest["total"] == 2
    status, every = await send(chat, "GET", AGENTS + "?include_archived=true&offset=1")
    assert [a["name"] for a in every["agents"]] == ["pager-2", "pager-0"]  # archived last
    assert (every["total"], every["limit"]) == (3, 200)
    for query in ("limit=0", "limit=201", "offset=-1", "limit=ten"):
        status, error = await send(chat, "GET", f"{AGENTS}?{query}")
        assert status == 400, (query, error)
        assert query.split("=")[0] in error["error"]["message"], error


async def test_duplicate_name_is_a_conflict_until_archived(chat: Chat) -> None:
    agent = await create_agent(chat)
    status, error = await send(
        chat, "POST", AGENTS, {"name": agent["name"], "model": "svc-offline"}
    )
    assert status == 409 and error["error"]["code"] == "agent_name_taken"
    other = await create_agent(chat)
    status, error = await send(chat, "PATCH", f"{AGENTS}/{other['id']}", {"name": agent["name"]})
    assert status == 409 and error["error"]["code"] == "agent_name_taken"

    await send(chat, "POST", f"{AGENTS}/{agent['id']}/archive")
    again = await create_agent(chat, name=agent["name"])
    assert again["id"] != agent["id"]


async def test_a_retried_create_answers_with_the_first_agent(chat: Chat) -> None:
    body = {"name": uid("ada-"), "model": UPSTREAM_MODEL}
    key = uid("idem-")
    first = await send(chat, "POST", AGENTS, body, **{"Idempotency-Key": key})
    second = await send(chat, "POST", AGENTS, body, **{"Idempotency-Key": key})
    assert first[0] == second[0] == 201
    assert first[1]["id"] == second[1]["id"]
    status, listed = await send(chat, "GET", AGENTS)
    assert status == 200 and len(listed["agents"]) == 1


async def test_a_key_reused_with_another_body_is_refused_not_answered_with_the_first(
    chat: Chat,
) -> None:
    """QA finding: a create, or an update, sent again under its Idempotency-Key with another
    body answered 2xx with the first result: a deploy script believed its new prompt live."""
    key = {"Idempotency-Key": uid("idem-")}
    body = {"name": uid("ada-"), "model": UPSTREAM_MODEL}
    status, first = await send(chat, "POST", AGENTS, body, **key)
    assert status == 201, first
    other = {**body, "system_prompt": "something else"}
    status, error = await send(chat, "POST", AGENTS, other, **key)
    assert status == 409 and error["error"]["code"] == "idempotency_key_reused", error
    # In the request's terms, not the service's command class (it said "(CreateAgent)").
    assert "for a request with another body to agent" in error["error"]["message"], error
    assert "CreateAgent" not in error["error"]["message"], error
    status, again = await send(chat, "POST", AGENTS, body, **key)  # the same body: its retry
    assert status == 201 and again["id"] == first["id"], again
    update, path = {"Idempotency-Key": uid("idem-")}, f"{AGENTS}/{first['id']}"
    status, one = await send(chat, "PATCH", path, {"description": "one"}, **update)
    assert status == 200, one
    status, error = await send(chat, "PATCH", path, {"description": "two"}, **update)
    assert status == 409 and error["error"]["code"] == "idempotency_key_reused", error
    status, current = await send(chat, "GET", path)
    assert current["description"] == "one" and current["system_prompt"] == "", current


async def test_an_agents_reasoning_effort_is_what_chat_takes(chat: Chat) -> None:
    """QA finding: chat passed `minimal` (the docs' own example) to the model server, while
    an agent's default refused it with a list of five words."""
    for effort in ("minimal", "xhigh"):
        body = {
            "name": uid("rz-"),
            "model": UPSTREAM_MODEL,
            "parameters": {"reasoning_effort": effort},
        }
        status, agent = await send(chat, "POST", AGENTS, body)
        assert status == 201 and agent["parameters"]["reasoning_effort"] == effort, agent
    body = {"name": uid("rz-"), "model": UPSTREAM_MODEL, "parameters": {"reasoning_effort": "Hi!"}}
    status, refused = await send(chat, "POST", AGENTS, body)
    assert status == 400 and "parameters.reasoning_effort" in refused["error"]["message"]


async def test_a_null_optional_field_of_a_create_is_its_default(chat: Chat) -> None:
    """QA finding: a PATCH's null keeps a field, but a create's null was a 400 ("must be a
    string"), though a form sending every field sends null for one left blank."""
    nulls = {"description": None, "system_prompt": None, "parameters": None}
    body = {"name": uid("nil-"), "model": UPSTREAM_MODEL, **nulls}
    status, agent = await send(chat, "POST", AGENTS, body)
    assert status == 201, agent
    assert agent["description"] == "" and agent["system_prompt"] == "", agent
    status, refused = await send(chat, "POST", AGENTS, {**body, "name": None})
    assert status == 400 and "name: must be a string" in refused["error"]["message"], refused


async def test_a_create_its_read_model_cannot_apply_still_says_it_was_recorded(
    chat: Chat, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agents read model waits on an event a newer version wrote (after a rollback): the
    create is recorded all the same, so the 503 says so first, then what to do, and tells
    the SDKs not to retry it (a retry without a key would create a second agent)."""
    runner = chat.service.app[PROJECTIONS]
    newer = EventFromNewerVersion("agent.future", "schema version 9, this code knows 1")
    monkeypatch.setattr(runner, "waiting_on_newer", lambda names=None: newer)

    async def given_up(*_: Any, **__: Any) -> bool:
        return False

    monkeypatch.setattr(admin_agents, "wait_applied", given_up)
    body = {"name": uid("ada-"), "model": UPSTREAM_MODEL}
    resp = await chat.service.http.post(
        chat.service.url(AGENTS), headers=chat.service.auth(chat.key), json=body
    )
    error = orjson.loads(await resp.read())["error"]
    assert resp.status == 503 and error["code"] == "event_from_newer_version", error
    assert error["message"].startswith("agent agt_") and "was changed" in error["message"]
    assert "upgrade this process" in error["message"], error
    assert resp.headers["x-should-retry"] == "false"
    # Each answer is its own error: the runner's is not raised, so its traceback stays empty.
    assert newer.__traceback__ is None


async def test_a_name_taken_by_a_create_not_applied_yet_is_not_given_again(
    chat: Chat, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review finding: a create answered 503 (its read model behind) left the names lock
    with the name not yet in the read model, and a second create of the name, checked
    against that stale model, was recorded too: two active agents of one name."""
    applied = [False]
    real_wait = admin_agents.wait_applied

    async def wait(*args: Any, **kwargs: Any) -> bool:
        return await real_wait(*args, **kwargs) if applied[0] else False

    async def stale(*_: Any, **__: Any) -> None:  # the read model has not seen the first
        return None

    monkeypatch.setattr(admin_agents, "wait_applied", wait)
    body = {"name": uid("ada-"), "model": UPSTREAM_MODEL}
    first = await send(chat, "POST", AGENTS, body)
    assert first[0] == 503, first
    with monkeypatch.context() as behind:
        behind.setattr(admin_agents.agent_queries, "find_active_agent", stale)
        status, error = await send(chat, "POST", AGENTS, body)
    assert status == 503 and "names are checked against it" in error["error"]["message"]
    applied[0] = True  # the read model is waited for again: the name is the first create's
    status, error = await send(chat, "POST", AGENTS, body)
    assert status == 409 and error["error"]["code"] == "agent_name_taken", error
    _, listed = await send(chat, "GET", AGENTS)
    assert [a["name"] for a in listed["agents"]] == [body["name"]]


async def test_a_retried_update_answers_with_the_first_result(chat: Chat) -> None:
    """The retry finds the agent already as asked, so it would change nothing: it still gets
    the first update's answer, its cursor included, not an empty one."""
    agent = await create_agent(chat)
    key = {"Idempotency-Key": uid("idem-")}
    patch = {"description": "retried"}
    first = await send(chat, "PATCH", f"{AGENTS}/{agent['id']}", patch, **key)
    second = await send(chat, "PATCH", f"{AGENTS}/{agent['id']}", patch, **key)
    assert first[0] == second[0] == 200
    assert first[1]["cursor"] and second[1] == first[1]


async def test_a_retry_gets_its_first_result_though_the_name_was_taken_since(chat: Chat) -> None:
    """A client whose first answer was lost retries with the same key: what happened since
    (the name given to another agent) must not turn its own first result into a 409."""
    name, renamed_to = uid("ada-"), uid("bea-")
    create = {"Idempotency-Key": uid("idem-")}
    body = {"name": name, "model": UPSTREAM_MODEL}
    status, first = await send(chat, "POST", AGENTS, body, **create)
    assert status == 201, first
    rename, path = {"Idempotency-Key": uid("idem-")}, f"{AGENTS}/{first['id']}"
    status, renamed = await send(chat, "PATCH", path, {"name": renamed_to}, **rename)
    assert status == 200, renamed
    other = await create_agent(chat, name=name)  # the first name, free again, taken
    third = await create_agent(chat, name=uid("cid-"))
    status, taken = await send(chat, "PATCH", f"{AGENTS}/{third['id']}", {"name": renamed_to})
    assert status == 409 and taken["error"]["code"] == "agent_name_taken"  # a new write is held
    status, again = await send(chat, "POST", AGENTS, body, **create)
    assert status == 201 and again["id"] == first["id"] and again["id"] != other["id"], again
    # The rename, retried after its name went to another agent: its first answer too.
    await send(chat, "POST", f"{path}/archive")
    status, reused = await send(chat, "PATCH", f"{AGENTS}/{third['id']}", {"name": renamed_to})
    assert status == 200, reused
    status, again = await send(
        chat, "PATCH", f"{AGENTS}/{first['id']}", {"name": renamed_to}, **rename
    )
    assert status == 200 and again["id"] == first["id"], again


async def test_a_retried_chat_turn_is_answered_after_its_agent_is_archived(chat: Chat) -> None:
    agent = await create_agent(chat)
    key = {"Idempotency-Key": uid("idem-")}
    body = {"model": agent["name"], "messages": [{"role": "user", "content": "hi"}]}
    status, first = await send(chat, "POST", "/v1/chat/completions", body, **key)
    assert status == 200, first
    status, _ = await send(chat, "POST", f"{AGENTS}/{agent['id']}/archive")
    assert status == 200
    status, again = await send(chat, "POST", "/v1/chat/completions", body, **key)
    assert status == 200, again
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    assert len(chat.stub.bodies) == 1  # answered from the record, no second model call
    # Without a first attempt, the archived name is unknown.
    status, error = await send(chat, "POST", "/v1/chat/completions", body)
    assert status == 404 and error["error"]["code"] == "model_not_found", error
    assert "agents of this workspace" not in error["error"]["message"], error  # none left
    # QA finding: the message named the served models only, not the agents a model may be
    # (one just renamed, say).
    renamed = await create_agent(chat, name=uid("bea-"))
    status, error = await send(chat, "POST", "/v1/chat/completions", body)
    assert status == 404, error
    assert f"agents of this workspace: {renamed['name']!r}" in error["error"]["message"]


async def test_an_update_with_the_creates_idempotency_key_is_refused(chat: Chat) -> None:
    """The key of the create, sent again on an update of that agent, names another request:
    409, and the update is not answered as if it had been made."""
    key = {"Idempotency-Key": uid("idem-")}
    body = {"name": uid("ada-"), "model": UPSTREAM_MODEL, "system_prompt": PROMPT}
    status, agent = await send(chat, "POST", AGENTS, body, **key)
    assert status == 201, agent
    patch = {"system_prompt": "changed"}
    status, error = await send(chat, "PATCH", f"{AGENTS}/{agent['id']}", patch, **key)
    assert status == 409 and error["error"]["code"] == "idempotency_key_reused", error
    status, current = await send(chat, "GET", f"{AGENTS}/{agent['id']}")
    assert status == 200 and current["system_prompt"] == PROMPT


async def test_scopes_and_validation(chat: Chat) -> None:
    reader = await chat.issue_key(chat.workspace, scopes=("admin:read",))
    status, error = await send(chat, "POST", AGENTS, {"name": "x", "model": "m"}, key=reader)
    assert status == 403, error
    status, _ = await send(chat, "GET", AGENTS, key=reader)
    assert status == 200
    status, error = await send(chat, "POST", AGENTS, {"name": " padded", "model": UPSTREAM_MODEL})
    assert status == 400 and "begin or end with white space" in error["error"]["message"], error
    # A direction override would make a listing read other than the name is (QA finding).
    for name in ("key\u202egnp.exe", "a\u2067b"):
        status, error = await send(chat, "POST", AGENTS, {"name": name, "model": UPSTREAM_MODEL})
        assert status == 400 and "direction" in error["error"]["message"], error
        status, error = await send(
            chat, "POST", "/v1/admin/apikeys", {"name": name, "scopes": ["chat"]}
        )
        assert status == 400 and "direction" in error["error"]["message"], error
    # Nor what shows as nothing: `hel\u200bper` listed as a second `helper` (QA finding).
    # The zero-width joiner of an emoji sequence is no such character.
    for name in (
        "hel\u200bper",
        "a\u00adb",
        "\ufeffbom",
        "hel\u200dper",
        "gi\u200cna",
        "Nguy\u1ec5\u200dn",
    ):
        for path in (AGENTS, "/v1/admin/apikeys"):
            body = {"name": name, "model": UPSTREAM_MODEL, "scopes": ["chat"]}
            body.pop("scopes" if path == AGENTS else "model")
            status, error = await send(chat, "POST", path, body)
            assert status == 400 and "show as nothing" in error["error"]["message"], error
    family = uid("fam-") + "\U0001f468\u200d\U0001f469\u200d\U0001f467"
    persian = uid("fa-") + "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645"  # a joiner it needs
    for name in (family, persian):
        status, made = await send(chat, "POST", AGENTS, {"name": name, "model": UPSTREAM_MODEL})
        assert status == 201, made
    # Listed on one line (GET /v1/models), as key names are: no control characters.
    for name in ("x\u001b[2J", "a\tb", "c\u0085d"):
        status, error = await send(chat, "POST", AGENTS, {"name": name, "model": UPSTREAM_MODEL})
        assert status == 400 and "control characters" in error["error"]["message"], error
    status, error = await send(chat, "PATCH", f"{AGENTS}/agt_missing", {"description": "x"})
    assert status == 404, error
    status, error = await send(chat, "GET", f"{AGENTS}/agt_missing")
    assert status == 404, error
    # QA finding: a null was read as "keep", and the client told it had sent nothing.
    agent = await create_agent(chat)
    path = f"{AGENTS}/{agent['id']}"
    status, error = await send(chat, "PATCH", path, {"system_prompt": None, "model": None})
    message = error["error"]["message"]
    assert status == 400 and "model, system_prompt: null keeps a field as it is" in message
    assert 'send "" to clear system_prompt' in message, message
    # Beside a value, null keeps its field, as a client sending every field expects.
    status, kept = await send(chat, "PATCH", path, {"description": "d", "system_prompt": None})
    assert status == 200 and kept["system_prompt"] == agent["system_prompt"], kept
    status, error = await send(chat, "PATCH", path, {})
    assert status == 400 and "give at least one of" in error["error"]["message"], error
    status, cleared = await send(chat, "PATCH", path, {"system_prompt": ""})
    assert status == 200 and cleared["system_prompt"] == "", cleared


# --- agents as models in chat ----------------------------------------------------------------


async def test_chat_with_an_agent_name_runs_the_agent(chat: Chat) -> None:
    agent = await create_agent(
        chat, parameters={"temperature": 0.2, "max_tokens": 3, "reasoning_effort": "low"}
    )
    raw = await chat.client().chat.completions.with_raw_response.create(
        model=agent["name"],
        messages=[
            {"role": "system", "content": "client system prompt"},
            {"role": "user", "content": "hello agent"},
        ],
        top_p=0.5,
        max_tokens=4,
    )
    completion = raw.parse()
    assert completion.model == agent["name"]
    assert completion.choices[0].message.content == "tok0 tok1 tok2 tok3 "

    (body,) = chat.stub.bodies
    assert body["model"] == UPSTREAM_MODEL
    assert [m["role"] for m in body["messages"]] == ["system", "system", "user"]
    assert body["messages"][0]["content"] == PROMPT
    assert body["messages"][1]["content"] == "client system prompt"
    # Agent parameters are defaults; the request's own values win.
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.2, 0.5, 4)
    assert body["reasoning_effort"] == "low"  # the agent's, the request naming none

    conversation = raw.headers["X-SVC-Conversation-Id"]
    recorded = await chat.service.app[STORE].read_stream(f"conversation:{conversation}")
    started = next(e for e in recorded if e.type == "conversation.turn_started")
    assert (started.data["agent"], started.data["model"]) == (agent["id"], UPSTREAM_MODEL)


async def test_an_agents_token_limit_goes_under_the_name_its_model_takes(chat: Chat) -> None:
    """With no limit in the request the agent's applies: sent as `max_completion_tokens`
    when the agent sets a reasoning effort (OpenAI's reasoning models refuse `max_tokens`,
    and every turn of such an agent failed), as `max_tokens` otherwise."""
    reasoning = await create_agent(chat, parameters={"max_tokens": 3, "reasoning_effort": "high"})
    plain = await create_agent(chat, parameters={"max_tokens": 3})
    for agent in (reasoning, plain):
        await chat.client().chat.completions.create(model=agent["name"], messages=HELLO)
    sent_reasoning, sent_plain = chat.stub.bodies
    assert sent_reasoning["max_completion_tokens"] == 3 and "max_tokens" not in sent_reasoning
    assert sent_plain["max_tokens"] == 3 and "max_completion_tokens" not in sent_plain


async def test_streamed_chat_with_an_agent_on_the_offline_model(chat: Chat) -> None:
    agent = await create_agent(chat, model="svc-offline")
    stream = await chat.client().chat.completions.create(
        model=agent["name"], messages=[{"role": "user", "content": "hi"}], stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert "svc-offline" in text
    assert chat.stub.calls == 0


async def test_models_list_includes_agents_and_archive_makes_the_name_unknown(
    chat: Chat,
) -> None:
    agent = await create_agent(chat)
    models = await chat.client().models.list()
    cards = {m.id: m.owned_by for m in models.data}
    assert cards[agent["name"]] == "agent" and UPSTREAM_MODEL in cards

    await send(chat, "POST", f"{AGENTS}/{agent['id']}/archive")
    models = await chat.client().models.list()
    assert agent["name"] not in {m.id for m in models.data}

    # A blank SVC_LLM_MODEL would serve any name upstream; here the upstream serves one model.
    with pytest.raises(openai.NotFoundError) as raised:
        await chat.client().chat.completions.create(
            model=agent["name"], messages=[{"role": "user", "content": "still there?"}]
        )
    assert raised.value.code == "model_not_found"
    assert chat.stub.calls == 0


async def test_agents_are_invisible_to_other_workspaces(chat: Chat) -> None:
    agent = await create_agent(chat)
    other_ws = uid("ws-")
    other = await chat.issue_key(other_ws, scopes=("*",))

    status, listed = await send(chat, "GET", AGENTS, key=other)
    assert status == 200 and listed["agents"] == []
    status, _ = await send(chat, "GET", f"{AGENTS}/{agent['id']}", key=other)
    assert status == 404
    status, _ = await send(chat, "POST", f"{AGENTS}/{agent['id']}/archive", key=other)
    assert status == 404
    status, _ = await send(chat, "PATCH", f"{AGENTS}/{agent['id']}", {"name": "x"}, key=other)
    assert status == 404

    models = await chat.client(other).models.list()
    assert agent["name"] not in {m.id for m in models.data}
    with pytest.raises(openai.NotFoundError):
        await chat.client(other).chat.completions.create(
            model=agent["name"], messages=[{"role": "user", "content": "hi"}]
        )
    # Another workspace may use the same name for its own agent.
    mine = await create_agent(chat, key=other, name=agent["name"], model="svc-offline")
    assert mine["id"] != agent["id"]
    status, still = await send(chat, "GET", f"{AGENTS}/{agent['id']}")
    assert status == 200 and not still["archived"]


async def test_openapi_documents_the_agent_routes(chat: Chat) -> None:
    resp = await chat.service.http.get(chat.service.url("/openapi.json"))
    doc = orjson.loads(await resp.read())
    assert resp.status == 200
    assert set(doc["paths"][AGENTS]) == {"get", "post"}
    assert set(doc["paths"][AGENTS + "/{agent_id}"]) == {"get", "patch"}
    assert "post" in doc["paths"][AGENTS + "/{agent_id}/archive"]
    assert {"AgentCreate", "AgentUpdate", "WrittenAgent"} <= set(doc["components"]["schemas"])


async def test_a_key_pasted_into_the_wrong_place_is_not_said_back(chat: Chat) -> None:
    """QA finding: a key sent as a limit, an id, a model or a conversation header was quoted
    whole in the 400 or 404 (anything that logs answers kept it). The access log already
    redacted it."""
    pasted = chat.key
    asks = [
        ("GET", f"/v1/admin/conversations?limit={pasted}", None, {}),
        ("GET", f"{AGENTS}/{pasted}", None, {}),
        ("GET", f"/v1/models/{pasted}", None, {}),
        ("GET", f"/v1/admin/conversations/messages?id={pasted}", None, {}),
        (
            "POST",
            "/v1/chat/completions",
            {"model": pasted, "messages": [{"role": "user", "content": "hi"}]},
            {},
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"model": UPSTREAM_MODEL, "messages": [{"role": "user", "content": "hi"}]},
            {"X-SVC-Conversation-Id": pasted},
        ),
    ]
    for method, path, body, headers in asks:
        status, answer = await send(chat, method, path, body, **headers)
        assert 400 <= status < 500, (path, answer)
        assert pasted not in orjson.dumps(answer).decode(), (path, answer)
        assert pasted[4:20] not in orjson.dumps(answer).decode(), (path, answer)
