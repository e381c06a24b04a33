"""OpenAI's response shapes, as `mlx_lm.server` writes them: errors, whole replies,
streamed chunks, logprobs entries and usage, plus DFlash stats under `dflash`.

Every error is JSON in OpenAI's shape; a logprob that is not a number reads as -9999.0.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import mlx.core as mx
from fastapi.responses import JSONResponse
from mlx_lm.generate import TextStateMachine, make_text_state_machine
from mlx_lm.server import ToolCallFormatter
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..response import GenerationResponse, ReplyStats

# What a logprob that is not a number, or -inf, reads as in JSON (as OpenAI writes it).
NO_LOGPROB = -9999.0
# The finish reason of a reply whose generation stopped before its end (the server shutting
# down): cut short, as by its token limit. OpenAI's reasons have none of its own.
CUT_SHORT = "length"
# The stats a streamed chunk before the last carries under `dflash` (the last has them all).
LIVE_STATS = ("generation_tokens", "generation_tps", "tau", "accepted", "strategy")


def error(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    response: type[JSONResponse] = JSONResponse,
) -> JSONResponse:
    """An error in OpenAI's shape: the client's request (4xx) or the server's fault (5xx)."""
    return response(error_body(status, message, param, code), status_code=status)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def logprob_entries(
    tokenizer: TokenizerWrapper, response: GenerationResponse, top: int
) -> list[dict[str, Any]]:
    """`mlx_lm.server`'s logprobs entries for a response's tokens: each token's
    log-probability and the `top` most likely tokens at its position, best first."""
    logprobs = response.logprobs
    ids = mx.array(response.tokens)[:, None]
    chosen = mx.take_along_axis(logprobs, ids, axis=-1)[:, 0]
    best = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top] if top else ids[:, :0]
    best_logprobs = mx.take_along_axis(logprobs, best, axis=-1)
    order = mx.argsort(-best_logprobs, axis=-1)
    best = mx.take_along_axis(best, order, axis=-1).tolist()
    best_logprobs = mx.take_along_axis(best_logprobs, order, axis=-1).tolist()

    def entry(token: int, logprob: float) -> dict[str, Any]:
        logprob = logprob if math.isfinite(logprob) else NO_LOGPROB
        return {"id": token, "token": tokenizer.convert_ids_to_tokens(token), "logprob": logprob}

    return [
        {**entry(token, logprob), "top_logprobs": [entry(*e) for e in zip(ts, lps, strict=True)]}
        for token, logprob, ts, lps in zip(
            response.tokens, chosen.tolist(), best, best_logprobs, strict=True
        )
    ]


def pieces(response: GenerationResponse) -> list[tuple[str, bool]]:
    """The response's text in pieces, each with whether accepted drafts made it readable
    (`GenerationResponse.sources`; text they do not cover is the target's)."""
    parts, start = [], 0
    for count, drafted in response.sources:
        parts.append((response.text[start : start + count], drafted))
        start += count
    return [*parts, (response.text[start:], False)]


def initial_state(tokenizer: TokenizerWrapper, prompt: list[int]) -> str:
    """Where the reply starts in mlx-lm's text state machine: "reasoning" when the prompt
    opens a thinking block it does not close (as `mlx_lm.server` decides)."""
    state = "normal"
    if tokenizer.has_thinking and tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(
        prompt
    ):
        state = "reasoning"
    return tokenizer.response_initial_state or state


class OpenAIResponse:
    """The OpenAI response shapes for one request (as `mlx_lm.server` writes them), plus
    DFlash stats under `dflash`.

    A chat reply runs through mlx-lm's text state machine, which splits the text
    into content, reasoning (thinking models) and tool calls (parsed by the
    tokenizer's tool parser); a text completion is the raw text.
    """

    def __init__(
        self,
        kind: str,
        model_id: str,
        stream: bool,
        tokenizer: TokenizerWrapper,
        prompt: list[int],
        tools: list[dict[str, Any]] | None = None,
        with_logprobs: bool = False,
    ):
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        self.id, self.kind, self.model_id, self.stream = (
            f"{prefix}-{uuid.uuid4().hex}",
            kind,
            model_id,
            stream,
        )
        self.created = int(time.time())
        self.stats = ReplyStats()
        self.chat = kind == "chat.completion"
        if self.chat:
            machine = make_text_state_machine(tokenizer)
            self.state = machine.make_state(initial_state(tokenizer, prompt))
        self.tool_calls = ToolCallFormatter(tokenizer.tool_parser, tools, stream)
        self.made_tool_call, self.previous = False, None
        self.content, self.reasoning, self.tool_text, self.calls = "", "", "", []
        self.sources: list[list[str]] = []  # the content's pieces since the last chunk
        self.with_logprobs, self.logprobs = with_logprobs, []

    def add(self, response: GenerationResponse, logprobs: list[dict] | None = None) -> None:
        """Take one response's text into content, reasoning and finished tool calls, and
        its tokens' logprobs entries (`logprob_entries`) if asked for. The content's pieces
        keep where they came from (`sources`); text a chat's markers held back goes with
        the piece that let it out."""
        self.stats.add(response)
        self.logprobs.extend(logprobs or [])
        if not self.chat:
            self.take_content(pieces(response))
            return
        segments = []
        for text, drafted in pieces(response):
            self.state, split = TextStateMachine.split(self.state, text)
            segments += [(state, part, drafted) for state, part in split]
        if response.finish_reason == "stop":
            self.state, current = TextStateMachine.discard(self.state)
            segments.append((current, "", False))
        elif response.finish_reason == "length":
            self.state, flushed, current = TextStateMachine.flush(self.state)
            segments.append((current, flushed, False))
        for state, text, drafted in segments:
            if state == "reasoning":
                self.reasoning += text
            elif state == "tool":
                self.tool_text += text
            elif state == "normal":
                if self.previous == "tool":
                    self.end_tool_call()
                self.take_content([(text, drafted)])
            self.previous = state
        if response.finish_reason is not None and self.previous == "tool":
            self.end_tool_call()

    def take_content(self, parts: list[tuple[str, bool]]) -> None:
        """Add text to the content, each part with where it came from (True: drafts)."""
        for text, drafted in parts:
            source = "draft" if drafted else "target"
            self.content += text
            if self.sources and self.sources[-1][1] == source:
                self.sources[-1][0] += text
            elif text:
                self.sources.append([text, source])

    def end_tool_call(self) -> None:
        if self.tool_text:
            self.calls.append(self.tool_text)
            self.made_tool_call = True
        self.tool_text = ""

    def finish_reason(self) -> str:
        """Why the reply ended; `CUT_SHORT` when its generation was stopped before its end."""
        finish = self.stats.last.finish_reason if self.stats.last else None
        return "tool_calls" if finish == "stop" and self.made_tool_call else finish or CUT_SHORT

    def take(self) -> tuple[str, str, list, dict | None]:
        """Content, reasoning, formatted tool calls and logprobs gathered since the last take."""
        logprobs = {"content": self.logprobs} if self.with_logprobs else None
        taken = self.content, self.reasoning, self.tool_calls(self.calls), logprobs
        self.content, self.reasoning, self.calls, self.logprobs = "", "", [], []
        return taken

    def choice(self, finish_reason: str | None) -> dict:
        text, reasoning, tool_calls, logprobs = self.take()
        if not self.chat:
            if logprobs is not None:  # also in the completions API's own shape
                content = logprobs["content"]
                logprobs["tokens"] = [e["token"] for e in content]
                logprobs["token_logprobs"] = [e["logprob"] for e in content]
                logprobs["top_logprobs"] = [
                    {t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in content
                ]
            return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
        message: dict[str, Any] = {"role": "assistant"}
        if not self.stream:
            message["content"] = text or None  # the schema requires the field
        elif text:
            message["content"] = text
        if reasoning:
            message["reasoning"] = reasoning
        if tool_calls:
            message["tool_calls"] = tool_calls
        key = "delta" if self.stream else "message"
        return {"index": 0, key: message, "finish_reason": finish_reason, "logprobs": logprobs}

    def usage(self) -> dict:
        d = self.stats.as_dict()
        prompt, completion = d["prompt_tokens"], d["generation_tokens"]
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def body(self, *choices: dict, **extra: Any) -> dict:
        chunk = self.stream and self.chat
        return {
            "id": self.id,
            "object": f"{self.kind}.chunk" if chunk else self.kind,
            "created": self.created,
            "model": self.model_id,
            "choices": list(choices),
            **extra,
        }

    def dflash(self, fields: tuple[str, ...] | None = None) -> dict:
        """The `dflash` block: the reply's stats so far (`fields` of them; None: all), and
        where the content since the last block came from (`sources`)."""
        stats = self.stats.as_dict()
        sources, self.sources = self.sources, []
        return {**{k: stats[k] for k in fields or stats if k in stats}, "sources": sources}

    def whole(self) -> dict:
        choice = self.choice(self.finish_reason())
        return self.body(choice, usage=self.usage(), dflash=self.dflash())

    async def events(
        self, responses: AsyncIterator[GenerationResponse], include_usage: bool
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per verify cycle with something to show (a tool
        call once whole) with the stats so far that a live display shows, all stats on the
        last, then usage if asked, then [DONE]."""

        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        if self.chat:
            yield event(self.body(self.choice(None)))  # the role, before any text
        try:
            async for response, logprobs in responses:
                self.add(response, logprobs)
                if response.finish_reason is None and (
                    self.content or self.reasoning or self.calls
                ):
                    yield event(self.body(self.choice(None), dflash=self.dflash(LIVE_STATS)))
            # the last chunk, also of a reply stopped before its end
            yield event(self.body(self.choice(self.finish_reason()), dflash=self.dflash()))
        except Exception as exc:
            yield event(error_body(500, f"generation failed: {exc}"))
        if include_usage:
            yield event(self.body(usage=self.usage()))
        yield "data: [DONE]\n\n"
