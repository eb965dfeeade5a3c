"""Prompt token ids of OpenAI text and chat requests, exactly as vLLM's OpenAI server makes them.

vLLM 0.32's OpenAI server renders every request through its ``OnlineRenderer``: the model's
tokenizer, its chat template (or the server's ``--chat-template``), ``add_generation_prompt``,
``add_special_tokens``, ``continue_final_message``, ``chat_template_kwargs`` and the other
options of the request itself. :class:`VllmTokenizer` builds the same renderer from the same
``VllmConfig`` and frontend options, so the router's token ids are the engine's.

Ray Serve LLM's own pre-routing tokenizer does the same but imports
``vllm.entrypoints.chat_utils``, which vLLM 0.32 moved to ``vllm.renderers.chat_utils``.

The renderer's calls are ``async`` but do their work (template, tokenizer) on the calling
thread, so :class:`VllmTokenizer` runs them on a thread and event loop of its own: a router
awaits :meth:`VllmTokenizer.submit`'s future and Serve's loop never blocks. Loading (the
tokenizer files, the config) happens on that thread too.

vLLM is imported only inside this module's functions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["TokenizeError", "VllmTokenizer"]


class TokenizeError(ValueError):
    """vLLM's renderer rejected the request (vLLM's server would answer 400 too)."""


def _fields(body: Any) -> dict[str, Any]:
    if isinstance(body, Mapping):
        return dict(body)
    dump = getattr(body, "model_dump", None)
    if dump is None:
        raise TypeError(f"cannot read a request body of type {type(body).__name__}")
    fields: dict[str, Any] = dump(exclude_unset=True)
    return fields


class VllmTokenizer:
    """Renders OpenAI completion and chat bodies to the prompt token ids vLLM will see.

    Args:
        load: called once, on the tokenizer's thread, to give the ``VllmConfig`` and the
            frontend options (``chat_template``, ``chat_template_content_format``,
            ``trust_request_chat_template``, ``default_chat_template_kwargs``,
            ``enable_auto_tool_choice``, ``tool_call_parser``,
            ``exclude_tools_when_tool_choice_none``), as vLLM's ``FrontendArgs`` name them.

    Use :meth:`from_engine_args` or :meth:`from_llm_config`.
    """

    def __init__(self, load: Callable[[], tuple[Any, Mapping[str, Any]]]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvbridge-tokenizer", daemon=True
        )
        self._thread.start()
        self._ready: concurrent.futures.Future[None] = asyncio.run_coroutine_threadsafe(
            self._load(load), self._loop
        )
        self._renderer: Any = None
        self._model_config: Any = None

    @classmethod
    def from_engine_args(
        cls, frontend: Mapping[str, Any] | None = None, **engine_kwargs: Any
    ) -> VllmTokenizer:
        """For an engine started with ``AsyncEngineArgs(**engine_kwargs)`` and the OpenAI
        server's ``frontend`` options."""

        def load() -> tuple[Any, Mapping[str, Any]]:
            from vllm.engine.arg_utils import AsyncEngineArgs  # type: ignore[import-not-found]

            return AsyncEngineArgs(**engine_kwargs).create_engine_config(), dict(frontend or {})

        return cls(load)

    @classmethod
    def from_llm_config(cls, llm_config: Any) -> VllmTokenizer:
        """For a Ray Serve LLM deployment's ``LLMConfig`` (its engine and frontend options)."""

        def load() -> tuple[Any, Mapping[str, Any]]:
            from ray.llm._internal.serve.engines.vllm.vllm_engine import (
                _get_vllm_engine_config,
            )

            engine_config = llm_config.get_engine_config()
            _, vllm_config = _get_vllm_engine_config(llm_config, device_type="cpu")
            return vllm_config, dict(engine_config.frontend_kwargs)

        return cls(load)

    async def _load(self, load: Callable[[], tuple[Any, Mapping[str, Any]]]) -> None:
        from vllm.renderers import renderer_from_config  # type: ignore[import-not-found]
        from vllm.renderers.chat_utils import load_chat_template  # type: ignore[import-not-found]
        from vllm.renderers.online_renderer import OnlineRenderer  # type: ignore[import-not-found]

        vllm_config, frontend = load()
        self._model_config = vllm_config.model_config
        self._renderer = OnlineRenderer(
            self._model_config,
            renderer_from_config(vllm_config),
            request_logger=None,
            chat_template=load_chat_template(frontend.get("chat_template")),
            chat_template_content_format=frontend.get("chat_template_content_format", "auto"),
            trust_request_chat_template=bool(frontend.get("trust_request_chat_template", False)),
            enable_auto_tools=bool(frontend.get("enable_auto_tool_choice", False)),
            exclude_tools_when_tool_choice_none=bool(
                frontend.get("exclude_tools_when_tool_choice_none", False)
            ),
            tool_parser=frontend.get("tool_call_parser"),
            default_chat_template_kwargs=frontend.get("default_chat_template_kwargs"),
        )

    def wait_loaded(self, timeout: float | None = None) -> None:
        """Block until the tokenizer is loaded (re-raises a load error)."""
        self._ready.result(timeout)

    def submit(self, body: Any) -> concurrent.futures.Future[list[int] | None]:
        """The prompt token ids of ``body`` (a dict or a request object), on the tokenizer's
        thread; ``None`` for a body vLLM would not render to one token list (several prompts,
        token-list or embedding prompts, neither ``prompt`` nor ``messages``). The future
        raises :class:`TokenizeError` when vLLM rejects the request."""
        return asyncio.run_coroutine_threadsafe(self._tokenize(body), self._loop)

    def tokenize(self, body: Any, timeout: float | None = None) -> list[int] | None:
        """:meth:`submit`, waited for (not on an event loop's thread)."""
        return self.submit(body).result(timeout)

    async def _tokenize(self, body: Any) -> list[int] | None:
        await asyncio.wrap_future(self._ready)
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # type: ignore[import-not-found]
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # type: ignore[import-not-found]
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse  # type: ignore[import-not-found]
        from vllm.renderers.inputs.preprocess import extract_prompt_components  # type: ignore[import-not-found]

        fields = _fields(body)
        try:
            if "messages" in fields:
                chat = ChatCompletionRequest.model_validate(
                    {k: v for k, v in fields.items() if k in ChatCompletionRequest.model_fields}
                )
                result = await self._renderer.render_chat(chat, skip_mm_cache=True)
                if isinstance(result, ErrorResponse):
                    raise TokenizeError(result.error.message)
                _, inputs = result
            elif isinstance(fields.get("prompt"), str):
                completion = CompletionRequest.model_validate(
                    {k: v for k, v in fields.items() if k in CompletionRequest.model_fields}
                )
                result = await self._renderer.render_completion(completion, skip_mm_cache=True)
                if isinstance(result, ErrorResponse):
                    raise TokenizeError(result.error.message)
                inputs = result
            else:
                return None
        except TokenizeError:
            raise
        except Exception as error:  # pydantic, jinja2 and vLLM's own validation errors
            raise TokenizeError(f"{type(error).__name__}: {error}") from None
        if len(inputs) != 1:
            return None
        token_ids = extract_prompt_components(self._model_config, inputs[0]).token_ids
        return None if token_ids is None else list(token_ids)

    def close(self) -> None:
        """Stop the tokenizer's thread. Idempotent."""
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
