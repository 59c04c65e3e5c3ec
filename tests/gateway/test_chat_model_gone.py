"""A retried Idempotency-Key whose model the instance no longer serves: the key's first run
answers (or its misuse is told), not the model's absence."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import stub_upstream
from platform_support import running, settings_for

CHAT = "/v1/chat/completions"


@pytest.fixture
async def stub() -> AsyncIterator[stub_upstream.StubUpstream]:
    upstream = await stub_upstream.StubUpstream(tokens=2).start()
    try:
        yield upstream
    finally:
        await upstream.stop()


def _body(model: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}]}


async def test_a_key_retried_after_its_model_went_is_still_judged_by_its_first_run(
    database_url: str, stub: stub_upstream.StubUpstream
) -> None:
    served = {"SVC_LLM_GATEWAY_URL": stub.base_url, "SVC_LLM_MODEL": "model-then"}
    async with running(settings_for(database_url, **served)) as svc:
        key, _ = await svc.issue_key("ws-model-gone", ("chat",))
        first_key = {"Idempotency-Key": "turn-with-the-old-model"}
        status, body, headers = await svc.request(
            "POST", CHAT, key, json=_body("model-then"), headers=first_key
        )
        assert status == 200, body
        first_conversation = headers["X-SVC-Conversation-Id"]
        status, _, headers = await svc.request("POST", CHAT, key, json=_body("model-then"))
        other = {"X-SVC-Conversation-Id": headers["X-SVC-Conversation-Id"]}
    # The instance restarts serving another model only.
    served["SVC_LLM_MODEL"] = "model-now"
    async with running(settings_for(database_url, **served)) as svc:
        # The same key on the same conversation: its first answer.
        again = {**first_key, "X-SVC-Conversation-Id": first_conversation}
        status, replayed, _ = await svc.request(
            "POST", CHAT, key, json=_body("model-then"), headers=again
        )
        assert status == 200, replayed
        # All but `created`, the retry's own acceptance time (docs/chat.md).
        assert {**replayed, "created": 0} == {**body, "created": 0}
        # On another conversation: the key's reuse is told (409), not the model's absence.
        status, refused, _ = await svc.request(
            "POST", CHAT, key, json=_body("model-then"), headers={**first_key, **other}
        )
        assert status == 409, refused
        assert refused["error"]["code"] == "idempotency_key_reused"
        # A new key with that model: the model is gone.
        status, gone, _ = await svc.request(
            "POST", CHAT, key, json=_body("model-then"), headers={"Idempotency-Key": "new"}
        )
        assert status == 404 and gone["error"]["code"] == "model_not_found"
