"""Rendering a conversation for the model: its chat template or, for a tokenizer
without one, the plain role format `mlx_lm.server` falls back to.

Shared by the subcommands, the bench and the trainer, so a drafter is trained on
prompts rendered the way they are served.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

logger = logging.getLogger(__name__)

# mlx_lm.server's default role prefixes; the reply starts after "ASSISTANT:".
PLAIN_ROLES = {"system": "ASSISTANT's RULE: ", "user": "USER: ", "assistant": "ASSISTANT: "}


def encode_prompt(tokenizer: TokenizerWrapper, prompt: str | list[int] | mx.array) -> list[int]:
    """Token ids of a prompt given as text (a BOS added unless it starts with one), ids or
    an array of ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        bos = tokenizer.bos_token
        ids = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    elif isinstance(prompt, mx.array):
        ids = prompt.reshape(-1).tolist()
    else:
        ids = list(prompt)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    if not all(isinstance(t, int) for t in ids):
        raise ValueError("a token-id prompt must contain only integers")
    return ids


@cache
def warn_once(message: str) -> None:
    logger.warning(message)


def plain_chat(messages: list[dict[str, str]]) -> str:
    """One `ROLE: content` line per message, then the reply's own prefix."""
    lines = [f"{PLAIN_ROLES.get(m['role'], '')}{m['content']}" for m in messages]
    return "\n".join([*lines, PLAIN_ROLES["assistant"].rstrip()])


def has_chat_template(tokenizer: TokenizerWrapper) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt(
    tokenizer: TokenizerWrapper,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    """The conversation rendered with the model's chat template, ready for the reply.

    `tools` and `template_kwargs` (e.g. `enable_thinking=False`) reach the
    template as in mlx-lm's `apply_chat_template`. A tokenizer without a
    template gets `plain_chat`, as in `mlx_lm.server`, with a warning the first time.
    """
    if not has_chat_template(tokenizer):
        warn_once(
            "the model's tokenizer has no chat template: "
            "using a plain 'USER: ... ASSISTANT:' format, as mlx_lm.server does"
        )
        return plain_chat(messages)
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, **template_kwargs
    )


def encode_chat(tokenizer: TokenizerWrapper, text: str) -> list[int]:
    """Token ids of a conversation `chat_prompt` rendered, as mlx-lm's generate, chat and
    server encode it: a chat template writes every special token it wants, so none is
    added; the plain role format gets the tokenizer's own (its BOS)."""
    return tokenizer.encode(text, add_special_tokens=not has_chat_template(tokenizer))


def render(tokenizer: TokenizerWrapper, prompt: str, chat: bool) -> list[int]:
    """Token ids of `prompt`, as one user turn of the conversation format when `chat`."""
    if chat:
        return encode_chat(tokenizer, chat_prompt(tokenizer, [{"role": "user", "content": prompt}]))
    return encode_prompt(tokenizer, prompt)


QUERY = "<query>"  # stands for a later prompt where the template is rendered around it


def open_prompt(
    tokenizer: TokenizerWrapper, text: str, system: str | None, chat: bool, template: dict
) -> list[int]:
    """Token ids of a prompt to cache and go on from later: with the chat template (`chat`),
    a user message left open (mlx_lm.cache_prompt's convention), else the text itself."""
    if not chat:
        return encode_prompt(tokenizer, text)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": text})
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True, **template
    )


def continued_prompt(
    tokenizer: TokenizerWrapper, cached: list[int], text: str, chat: bool, template: dict
) -> list[int]:
    """Token ids of the `cached` prompt followed by `text`: with the chat template, the rest
    of the open user message and what the template puts after it, ready for the reply."""
    if chat:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": QUERY}],
            add_generation_prompt=True,
            tokenize=False,
            **template,
        )
        text += rendered[rendered.index(QUERY) + len(QUERY) :]
    return cached + tokenizer.encode(text, add_special_tokens=False)
