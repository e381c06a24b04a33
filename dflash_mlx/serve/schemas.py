"""The requests the server takes, as pydantic models, and the bounds on their fields.

Every number a request sends is bounded to what the model and MLX take (400 naming the
field): indices by MLX's 32-bit ones, sampling numbers so logits stay finite. Fields that
would change the output in a way this server cannot honour are refused by name.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Strict(BaseModel):
    # NaN and infinities parse from JSON in Python, and would reach the sampler as settings
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


MAX_SEED = 2**32 - 1  # what a request's `seed` may be
MAX_INDEX = 2**31 - 1  # MLX slices and counts with 32-bit integers
# Sampling numbers far past any useful value, bounded so logits stay finite: 1e308 is
# infinite in float32 already, the sampler scales logits by 1 / temperature (infinite for a
# temperature of 1e-300), a repetition penalty multiplies or divides them, and the additive
# penalties and biases add to them. An infinite logit makes every probability NaN.
MIN_SCALE, MAX_SCALE = 0.01, 100.0  # a temperature or repetition penalty, but for 0 (off)
MAX_PENALTY = 1000.0  # presence and frequency penalties, either sign
MAX_LOGIT_BIAS = 100.0  # as OpenAI's
# A prompt's text is bounded before it is tokenized, at this many characters per token
# of the model's context: more than any tokenizer packs into one token.
PROMPT_CHARS_PER_TOKEN = 64
# Stop strings a request may give, and their length: the matcher's work per piece of
# text grows with both.
MAX_STOPS, MAX_STOP_CHARS = 16, 1000
# apply_chat_template's own arguments and the names a template is rendered with: a
# request setting one would pick the template or how it is applied, which only the
# model (and the operator's --chat-template-args) decide.
TEMPLATE_OWN = frozenset(
    {
        "chat_template",
        "conversation",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


# Fields that change the output but that this server cannot honour: a request
# setting one to anything but a value that changes nothing is refused, naming it.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "response_format": ({"type": "text"},),
    "tool_choice": ("auto",),
    "functions": (),
    "function_call": (),
    "adapters": (),
}


# The content parts that carry an image, as mlx_lm.server reads them.
IMAGE_PARTS = ("image_url", "input_image", "image")


class FieldError(ValueError):
    """A whole request's check that found one field wrong (its error names `field`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: dict[str, Any]

    @field_validator("arguments", mode="before")
    @classmethod
    def parse_arguments(cls, value: Any) -> Any:
        """OpenAI sends the arguments as a JSON string; templates want the object. What the
        body may not hold the string may not either (NaN, infinities), and nesting deeper
        than Python's parser follows is the client's mistake (400), not the server's."""
        if not isinstance(value, str):
            return value
        try:
            return json.loads(value, parse_constant=_no_constant)
        except RecursionError:
            raise ValueError("the arguments are nested too deeply to parse") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"the arguments hold {name}, which is not a JSON number")


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def no_images(cls, content: Any) -> Any:
        """An image part is refused with why (not as a part that is not text)."""
        parts = content if isinstance(content, list) else []
        if any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS for p in parts):
            raise ValueError(
                "image parts are not supported: this server prefills text prompts only "
                "(dflash-mlx generate --image takes images, for the models mlx-lm takes them for)"
            )
        return content

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (text content, parsed tool arguments)."""
        message = self.model_dump(exclude_none=True)
        if not isinstance(self.content, str):
            message["content"] = "".join(p.text for p in self.content or [])
        return message


class StreamOptions(Strict):
    include_usage: bool = False


class DflashOptions(Strict):
    """This server's own request fields, under `dflash` (OpenAI clients send them as extra
    body): `draft: false` decodes the reply without drafting (plain steps, as `--block-size
    1`), to compare against."""

    draft: bool = True


class CompletionParams(Strict):
    """Fields both endpoints take; unset sampling fields fall back to the server's flags."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_INDEX)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INDEX)
    temperature: float | None = Field(None, ge=0, le=MAX_SCALE)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0, le=MAX_INDEX)
    min_p: float | None = Field(None, ge=0, le=1)
    xtc_probability: float | None = Field(None, ge=0, le=1)
    xtc_threshold: float | None = Field(None, ge=0, le=0.5)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = (
        None
    )
    repetition_penalty: float | None = Field(None, ge=0, le=MAX_SCALE)
    repetition_context_size: int | None = Field(None, ge=0, le=MAX_INDEX)
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    presence_context_size: int | None = Field(None, ge=0, le=MAX_INDEX)
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_context_size: int | None = Field(None, ge=0, le=MAX_INDEX)
    logprobs: bool | Annotated[int, Field(ge=0, le=20)] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    dflash: DflashOptions | None = None

    @property
    def alternatives(self) -> int | None:
        """How many most likely tokens to report per token; None: no logprobs.

        `logprobs=true` with `top_logprobs` (chat, mlx-lm), or `logprobs=k` (the
        completions API); `top_logprobs` alone also asks, as in `mlx_lm.server`.
        """
        if isinstance(self.logprobs, bool) or self.logprobs is None:
            return self.top_logprobs or 0 if self.logprobs or self.top_logprobs else None
        return self.logprobs

    @field_validator("temperature", "repetition_penalty")
    @classmethod
    def off_or_in_scale(cls, value: float | None) -> float | None:
        if value is not None and 0 < value < MIN_SCALE:
            raise ValueError(f"0 or at least {MIN_SCALE}, got {value}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def token_ids(cls, bias: dict[str, float] | None) -> dict[int, float] | None:
        if bias is None:
            return None
        if not all(k.isascii() and k.isdigit() for k in bias):  # not "١٢" (int() takes it)
            raise ValueError("keys must be token ids in ASCII digits")
        return {int(k): v for k, v in bias.items()}

    @field_validator("stop")
    @classmethod
    def few_short_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return stop

    @model_validator(mode="before")
    @classmethod
    def refuse_unsupported(cls, body: Any) -> Any:
        if isinstance(body, dict):
            for name, harmless in UNSUPPORTED.items():
                value = body.get(name)
                if value is not None and value not in harmless:
                    message = f"{name}={json.dumps(value)} is not supported by this server"
                    raise FieldError(name, message)
        return body

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else self.stop or []


class ChatRequest(CompletionParams):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def template_variables_only(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(TEMPLATE_OWN.intersection(kwargs or {}))
        if taken:
            raise ValueError(f"{taken[0]} is not for a request to set: the template is the model's")
        return kwargs


class TextRequest(CompletionParams):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)

    @field_validator("prompt")
    @classmethod
    def one_prompt(cls, prompt: Any) -> str | list[int]:
        """A list of prompts is a batch; one prompt per request is served (n = 1)."""
        if isinstance(prompt, list) and not isinstance(prompt[0], int):
            if len(prompt) > 1:
                raise ValueError(f"one prompt per request is supported, got {len(prompt)}")
            return prompt[0]
        return prompt


def text_size(value: Any) -> int:
    """Characters in the strings of a JSON value (keys too): what a template may render."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_size(k) + text_size(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(map(text_size, value))
    return 0
