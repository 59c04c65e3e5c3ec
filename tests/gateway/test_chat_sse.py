"""SSE framing helpers shared by the chat stream and the feeds."""

from __future__ import annotations

from gateway.sse import encode_event


def test_one_data_line_per_line_of_payload() -> None:
    assert encode_event("a\nb\r\nc") == b"data: a\ndata: b\ndata: c\n\n"


def test_id_and_event_fields_come_first_and_cannot_forge_fields() -> None:
    frame = encode_event(b"{}", event="x\ndata: forged", id="c1\r\nid: 2")
    assert frame == b"id: c1  id: 2\nevent: x data: forged\ndata: {}\n\n"


def test_done_sentinel() -> None:
    assert encode_event("[DONE]") == b"data: [DONE]\n\n"
