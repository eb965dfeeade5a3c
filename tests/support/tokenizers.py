"""A tokenizer hook for the router tests: UTF-8 bytes as token ids."""

from __future__ import annotations

from typing import Any

NOT_CALLABLE = 42


def bytes_tokenizer(body: Any) -> list[int]:
    """The prompt's text, or the chat messages' contents joined, as UTF-8 byte values."""
    text = body.get("prompt")
    if not isinstance(text, str):
        text = "".join(message["content"] for message in body["messages"])
    return list(text.encode())
