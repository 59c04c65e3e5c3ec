"""The built-in offline model: answers without any upstream, deterministically.

It is the embedded default (ARCHITECTURE.md decision 8), so a fresh `svc serve` answers chat
requests out of the box. Its reply says plainly that it is the offline model, echoes a short
digest of the last user message and tells the operator how to configure a real model. The
reply streams one word per delta; token counts follow `actors.models.tokens`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterable

from actors.models.port import ChatMessage, Finished, ModelEvent, ModelRequest, TextDelta, Usage
from actors.models.tokens import estimate_prompt_tokens

OFFLINE_MODEL = "svc-offline"
_ECHO_WORDS = 40
_ECHO_CHARS = 400
"""At most this much of the message is quoted back, however long its words."""
_WORD = re.compile(r"\S+\s*")


class OfflineProvider:
    """Serves `svc-offline` plus any extra model names configured for it."""

    name = "offline"

    def __init__(self, model_names: Iterable[str] = ()) -> None:
        names = [OFFLINE_MODEL, *(n for n in model_names if n and n != OFFLINE_MODEL)]
        self.model_names: tuple[str, ...] = tuple(dict.fromkeys(names))

    def serves(self, model: str) -> bool:
        return model in self.model_names

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        words = _WORD.findall(_until_stop(compose_reply(request.messages), request.stop))
        limit = request.max_tokens
        emitted = words if limit is None else words[:limit]
        for word in emitted:
            yield TextDelta(word)
            await asyncio.sleep(0)
        finish = "length" if len(emitted) < len(words) else "stop"
        usage = Usage(estimate_prompt_tokens(request.messages), len(emitted))
        yield Finished(finish_reason=finish, usage=usage)

    async def aclose(self) -> None:
        return None


def _until_stop(text: str, stop: tuple[str, ...]) -> str:
    """The text before the first stop sequence, which is not part of the answer (OpenAI's
    convention)."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]


def compose_reply(messages: Iterable[ChatMessage]) -> str:
    last = next((m.content for m in reversed(tuple(messages)) if m.role == "user"), "")
    words = last.split()
    if not words:
        said = "You sent no user message, so there is nothing to answer yet."
    else:
        digest = " ".join(words[:_ECHO_WORDS])
        if len(digest) > _ECHO_CHARS:  # a word may be as long as a message
            digest = digest[:_ECHO_CHARS] + " ..."
        elif len(words) > _ECHO_WORDS:
            digest += " ..."
        plural = "" if len(words) == 1 else "s"
        said = f'You said ({len(words)} word{plural}): "{digest}"'
    return (
        f"This is {OFFLINE_MODEL}, the built-in offline model; no language model is "
        f"connected, so I can only reflect your message. {said} To get real answers, set "
        "SVC_LLM_GATEWAY_URL and SVC_LLM_MODEL to an OpenAI-compatible model server."
    )
