"""Finding a request's prompt tokens, LoRA name and cache salt in what Serve hands the router.

A handle call carries them as keyword arguments (``prompt_token_ids=...`` or ``token_ids=...``);
an OpenAI-style body (a dict or a request object, the first positional argument) carries them in
``prompt_token_ids``, ``token_ids``, or ``prompt`` when that is a list of token ids. A text prompt
or chat ``messages`` needs a tokenizer: the router is given one as an import path
(``"package.module:function"``, since router kwargs must be JSON), called with the body. The
cache salt is a ``cache_salt`` keyword argument or the body's ``cache_salt`` field, as vLLM's
OpenAI server takes it.
"""

from __future__ import annotations

import importlib
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from kvbridge.normalizers.hashing import DYNAMO_SALT_PREFIX

__all__ = [
    "Tokenizer",
    "load_tokenizer",
    "prompt_cache_salt",
    "prompt_lora_name",
    "prompt_tokens",
]

Tokenizer = Callable[[Any], Sequence[int] | None]
"""Called with the request body; returns its prompt's token ids, or ``None``."""

TOKEN_FIELDS: Final = ("prompt_token_ids", "token_ids")


def load_tokenizer(path: str) -> Tokenizer:
    """The callable at ``"package.module:attribute"``.

    Raises:
        ValueError: the path is malformed, cannot be imported, or is not callable.
    """
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"tokenizer must be 'package.module:function', got {path!r}")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot load tokenizer {path!r}: {error}") from None
    if not callable(target):
        raise ValueError(f"tokenizer {path!r} is not callable")
    tokenizer: Tokenizer = target
    return tokenizer


def _field(body: object, name: str) -> Any:
    if isinstance(body, Mapping):
        return body.get(name)
    return getattr(body, name, None)


def _token_ids(value: object) -> array[int] | None:
    """``value`` as a non-empty ``array("I")`` of u32 token ids, or ``None`` if it is not one.

    ``array("I", value)`` checks every id in C (an integer, and a u32) and packs the ids as the
    little-endian u32s Dynamo hashes, in one pass: the router hashes the array's own bytes
    (:meth:`~kvbridge.ray_integration.RoutingState.choose`), with no list made back from it.
    """
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not value:
        return None
    try:
        return array("I", value)
    except (TypeError, OverflowError):
        return None


def prompt_tokens(
    args: Sequence[Any], kwargs: Mapping[str, Any], tokenizer: Tokenizer | None = None
) -> array[int] | None:
    """The request's prompt token ids (as ``array("I")``), or ``None`` if it has none the
    router can find."""
    for name in TOKEN_FIELDS:
        if name in kwargs:
            return _token_ids(kwargs[name])
    if not args:
        return None
    body = args[0]
    for name in (*TOKEN_FIELDS, "prompt"):
        tokens = _token_ids(_field(body, name))
        if tokens is not None:
            return tokens
    if tokenizer is not None and (
        isinstance(_field(body, "prompt"), str) or _field(body, "messages") is not None
    ):
        result = tokenizer(body)
        return None if result is None else _token_ids(result)
    return None


def prompt_lora_name(kwargs: Mapping[str, Any], multiplexed_model_id: str | None) -> str | None:
    """The LoRA adapter: a ``lora_name`` keyword argument, else Serve's multiplexed model id."""
    name = kwargs.get("lora_name") or multiplexed_model_id
    return str(name) if name else None


def prompt_cache_salt(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """The request's cache salt: a ``cache_salt`` keyword argument, else the body's
    ``cache_salt`` field; ``None`` if there is none or it is empty (vLLM then salts nothing).
    Dynamo's ``dynamo-cache-salt:`` prefix is removed, as the relay removes it from a block's
    extra keys, so that the router hashes the salt the relay hashed the blocks with."""
    if "cache_salt" in kwargs:
        salt = kwargs["cache_salt"]
    else:
        salt = _field(args[0], "cache_salt") if args else None
    if not isinstance(salt, str):
        return None
    return salt.removeprefix(DYNAMO_SALT_PREFIX) or None
