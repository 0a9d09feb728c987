"""The OpenAI wire format as `vllm serve` speaks it: request models, error objects, response bodies.

Requests are pydantic models with `extra="forbid"`: a misspelt field is a 400 that names it rather
than a setting silently ignored. Fields OpenAI defines but this engine does not implement (penalties,
logit bias, tools) are accepted only at their neutral value, so a client that sends the defaults works
and one that relies on them is told so.
"""
from __future__ import annotations

import json
import random
import time
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_N = 128
SEED_MAX = 2**63 - MAX_N  # choice i samples with seed + i: all n of them must fit the sampler's int64 seeds
MAX_LOGPROBS = 20


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}`."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
             429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def from_validation(e: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming its field (dotted path)."""
    err = e.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    if err["type"] == "extra_forbidden":
        return APIError(400, f"unknown field '{param}'", param, "unknown_field")
    return APIError(400, f"field '{param}': {err['msg']} (got {err.get('input')!r:.80})", param, "invalid_value")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class StreamOptions(_Model):
    include_usage: bool = False


def _only(neutral) -> AfterValidator:
    """A field this engine does not implement: accepted absent or at `neutral`, the value that changes nothing."""
    def check(value, info):
        if value not in (None, neutral):
            raise ValueError(f"{info.field_name} is not supported by this engine (only {neutral!r})")
        return value
    return AfterValidator(check)


class _Sampling(_Model):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # 0 or -1: off (vLLM's convention)
    seed: Annotated[int, Field(ge=0, le=SEED_MAX)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    user: str | None = None
    presence_penalty: Annotated[float | None, _only(0.0)] = None
    frequency_penalty: Annotated[float | None, _only(0.0)] = None
    repetition_penalty: Annotated[float | None, _only(1.0)] = None
    logit_bias: Annotated[dict | None, _only({})] = None
    best_of: int | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of not in (None, self.n):
            raise ValueError("best_of other than n is not supported")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PromptType = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    prompt: PromptType
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: Annotated[str | None, _only(None)] = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("prompt token lists must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts as texts or token lists (a single prompt becomes a list of one)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # templates may read extra keys (name, tool_calls, ...)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    tools: Annotated[list | None, _only([])] = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, v):
        if v not in (None, "none", "auto"):
            raise ValueError(f"tool_choice {v!r} is not supported: only 'none' and 'auto' (no tools are "
                             f"accepted, so either means no tool call)")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        if v and v.get("type") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        return v

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def parse(model: type[BaseModel], body: bytes):
    """JSON bytes -> a request model; APIError(400) names what is wrong."""
    try:
        data = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation(e) from None


# ---- responses ---------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    """A unique response id, 32 hex digits as uuid4().hex has them: from `random` (seeded from the OS once),
    not a system call per request. Ids name responses; they guard nothing."""
    return f"{prefix}-{random.getrandbits(128):032x}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def compact(obj) -> bytes:
    """JSON as the stream writes it: no spaces, UTF-8 (not \\u escapes)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def sse(obj) -> bytes:
    return b"data: " + compact(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def model_card(name: str, max_model_len: int, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "g4rt", "root": name,
            "parent": None, "max_model_len": max_model_len}
