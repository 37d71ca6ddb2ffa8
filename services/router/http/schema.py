"""OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``) and their checks. Pure.

Field defaults are OpenAI's: an unset ``temperature`` or ``top_p`` is 1.0 (sampling, not greedy),
``max_tokens`` 16 for completions and "up to the router's limit" for chat. Unknown fields are
ignored (as vLLM does). Fields Tandem does not implement yet are accepted only at their neutral
value; anything else is a 400 naming the field, never silently ignored. Extensions (as vLLM's):
``top_k`` (-1 or 0 = all), ``stop_token_ids``, ``ignore_eos``, ``min_p``, ``repetition_penalty``, and
Tandem's ``num_draft_tokens``. Logprobs (completions ``logprobs: N``; chat ``logprobs: true`` with
``top_logprobs: N``; N ≤ 20) are of the raw target distribution, before penalties and temperature.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.router.http.errors import RequestError
from services.router.jobs import MAX_LOGPROBS, MAX_SAMPLES


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0, lt=1 << 64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_SAMPLES)  # samples of one prompt: the first's prefill is reused by the rest
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    num_draft_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool = False
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=100)

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for every field set to something Tandem does not implement yet."""
        out = []
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported"))
        return out


class CompletionRequest(_Sampling):
    def logprob_count(self) -> int | None:
        return self.logprobs


    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.echo:
            out.append(("echo", "echo is not supported"))
        if self.best_of not in (None, 1):
            out.append(("best_of", "best_of > 1 is not supported"))
        if self.suffix:
            out.append(("suffix", "suffix is not supported"))
        return out

    def single_prompt(self) -> tuple[str | None, list[int] | None]:
        """(text, token ids): exactly one prompt (a batch of several is a 400)."""
        p = self.prompt
        if isinstance(p, str):
            return p, None
        if p and all(isinstance(x, int) for x in p):
            return None, list(p)
        if len(p) != 1:
            raise RequestError("exactly one prompt per request is supported (send a batch as separate requests)", "prompt")
        only = p[0]
        return (only, None) if isinstance(only, str) else (None, list(only))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.top_logprobs and not self.logprobs:
            out.append(("top_logprobs", "top_logprobs needs logprobs: true"))
        if self.tools:
            out.append(("tools", "tool calls are not supported"))
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            out.append(("response_format", "only response_format {type: text} is supported"))
        return out

    def logprob_count(self) -> int | None:
        """Top alternatives per token to ask the worker for; None = no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse(model: type[BaseModel], body: object) -> Any:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise RequestError(f"{param}: {first['msg']}" if param else first["msg"], param) from None
    problems = request.unsupported()
    if problems:
        field, why = problems[0]
        raise RequestError(why, field, "unsupported_parameter")
    return request
