"""The token estimate used where no tokenizer speaks: one token per whitespace-separated word.

The offline provider counts with it exactly (each streamed delta is one word, so `max_tokens`
cuts at a word). The OpenAI-compatible provider falls back to it only when the upstream
reports no usage. Real tokenizers give roughly 1.3 tokens per English word, so the estimate
runs low by that factor; it is a budget figure, not a bill.
"""

from __future__ import annotations

from collections.abc import Iterable

from actors.models.port import ChatMessage

MESSAGE_OVERHEAD_TOKENS = 3
"""Per-message framing (role and separators), as chat-format tokenizers add."""


def estimate_tokens(text: str) -> int:
    return len(text.split())


def estimate_prompt_tokens(messages: Iterable[ChatMessage]) -> int:
    return sum(estimate_tokens(m.content) + MESSAGE_OVERHEAD_TOKENS for m in messages)
