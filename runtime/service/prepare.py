"""Request bodies -> engine requests, on a worker thread (JSON, validation, chat template, tokenizing).

Prompt length is bounded before tokenizing: a text whose byte length alone proves it longer than
`max_model_len` tokens is refused without being tokenized, so the work a prompt can cause is bounded
by max_model_len x the longest token's bytes (and the body limit), not by what a client sends.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..sampling import GenerationDefaults, SamplingParams
from .chat import ChatTemplate
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, parse
from .text import Tokenizer


@dataclass(frozen=True)
class Context:
    """What preparing a request needs to know about the deployment."""

    model_name: str
    max_model_len: int
    tokenizer: Tokenizer | None
    template: ChatTemplate | None
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)  # what a request leaves out


@dataclass
class Spec:
    """One HTTP request's work: `choices[i] = (prompt index, params)`, plus how to present the output."""

    kind: str  # "completion" | "chat"
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    choices: list[tuple[int, SamplingParams]]
    stream: bool = False
    include_usage: bool = False
    stops: tuple[str, ...] = ()
    include_stop: bool = False
    logprobs: int | None = None
    echo: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False


_ID_PROMPT = re.compile(rb'"prompt"\s*:\s*\[\s*[\[\d]')


def cheap(body: bytes, limit: int) -> bool:
    """Whether preparing `body` likely costs less than handing it to a worker thread and back (two thread
    hops, each a wake-up and a GIL hand-over): a body of at most `limit` bytes whose prompt is token ids,
    so there is nothing to tokenize. A guess from the bytes (the body is not parsed twice); a wrong guess
    only moves a small request's work to another thread, never changes its result."""
    return len(body) <= limit and _ID_PROMPT.search(body) is not None


def _check_model(ctx: Context, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise APIError(404, f"model '{model}' does not exist; this server serves '{ctx.model_name}'", "model",
                       "model_not_found")


def _need_tokenizer(ctx: Context, what: str) -> Tokenizer:
    if ctx.tokenizer is None:
        raise APIError(400, f"{what} needs a tokenizer.json next to the model; send token ids instead", "prompt")
    return ctx.tokenizer


def _tokenize(ctx: Context, texts: list[str], add_special_tokens: bool, param: str) -> list[list[int]]:
    tok = _need_tokenizer(ctx, f"a text {param}")
    for t in texts:
        if (least := tok.min_tokens(t)) > ctx.max_model_len:
            raise APIError(400, f"{param} is longer than max_model_len {ctx.max_model_len} tokens "
                                f"({len(t.encode())} bytes, at least {least} tokens)", param,
                           "context_length_exceeded")
    return tok.encode(texts, add_special_tokens)


def _params(req, prompt_len: int, max_new: int | None, ctx: Context, i: int, param: str,
            unset: int | None = None) -> SamplingParams:
    """A choice's SamplingParams; `max_new` None (the request sent no max_tokens): the model's
    max_new_tokens (generation_config.json) within what is left of max_model_len after the prompt, else
    `unset`, else what is left. A prompt that leaves no room for one token is refused naming the prompt's
    field (`param`), not max_tokens, which the client may not have sent."""
    if prompt_len >= ctx.max_model_len:
        raise APIError(400, f"{param} is {prompt_len} tokens, which leaves no room for output within "
                            f"max_model_len {ctx.max_model_len} tokens", param, "context_length_exceeded")
    d, room = ctx.defaults, ctx.max_model_len - prompt_len
    if max_new is None:
        max_new = min(d.max_new_tokens, room) if d.max_new_tokens is not None else unset or room
    if prompt_len + max_new > ctx.max_model_len:
        raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_new}) = {prompt_len + max_new} "
                            f"exceeds max_model_len {ctx.max_model_len}", "max_tokens", "context_length_exceeded")
    try:  # left out: the model's setting, else the OpenAI API's (temperature 1, no top-k, top_p 1)
        return SamplingParams(
            max_new_tokens=max_new, temperature=d.pick("temperature", req.temperature, 1.0),
            top_k=d.pick("top_k", None if req.top_k is None else max(0, req.top_k), 0),
            top_p=d.pick("top_p", req.top_p, 1.0),
            seed=None if req.seed is None else req.seed + i, stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos)
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _spec(kind: str, req, prompts: list[list[int]], texts: list, max_new, ctx: Context, logprobs,
          unset: int | None = None) -> Spec:
    param = "messages" if kind == "chat" else "prompt"
    choices = [(p, _params(req, len(prompts[p]), max_new, ctx, j, param, unset))
               for p in range(len(prompts)) for j in range(req.n)]
    return Spec(kind, prompts, texts, choices, stream=req.stream, include_usage=req.include_usage, stops=req.stops,
                include_stop=req.include_stop_str_in_output, logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens, return_token_ids=req.return_token_ids)


def completion(body: bytes, ctx: Context) -> Spec:
    req = parse(CompletionRequest, body)
    _check_model(ctx, req.model)
    if req.echo and req.logprobs is not None:  # before tokenizing: a refused request costs no tokenizer work
        raise APIError(400, "echo with logprobs needs prompt logprobs, which this engine does not compute", "echo")
    raw = req.prompts()
    texts = [p if isinstance(p, str) else None for p in raw]
    given = [t for t in texts if t is not None]
    encoded = iter(_tokenize(ctx, given, True, "prompt") if given else [])
    prompts = [next(encoded) if isinstance(p, str) else list(p) for p in raw]
    if (req.echo or req.stops) and ctx.tokenizer is None:
        raise APIError(400, "echo and stop strings need a tokenizer", "stop" if req.stops else "echo")
    if req.echo:  # token-id prompts echo as their text
        texts = [t if t is not None else ctx.tokenizer.decode(p, req.skip_special_tokens) for t, p in zip(texts, prompts)]
    spec = _spec("completion", req, prompts, texts, req.max_tokens, ctx, req.logprobs, unset=16)  # the API's 16
    spec.echo = req.echo
    return spec


def chat_prompt(ctx: Context, messages, add_generation_prompt: bool, extra: dict | None = None) -> str:
    if ctx.template is None:
        raise APIError(400, "this model has no chat template (chat_template.jinja or tokenizer_config.json); "
                            "use /v1/completions", "messages")
    dicts = [m.model_dump(exclude_none=True) | {"content": m.text()} for m in messages]
    return ctx.template.render(dicts, add_generation_prompt, extra)


def chat(body: bytes, ctx: Context) -> Spec:
    req = parse(ChatCompletionRequest, body)
    _check_model(ctx, req.model)
    _need_tokenizer(ctx, "a chat completion")
    text = chat_prompt(ctx, req.messages, req.add_generation_prompt, req.chat_template_kwargs)
    ids = _tokenize(ctx, [text], False, "messages")  # the template writes the BOS itself
    return _spec("chat", req, ids, [text], req.max_new, ctx, req.num_logprobs)


def tokenize(body: bytes, ctx: Context) -> dict:
    req = parse(TokenizeRequest, body)
    _check_model(ctx, req.model)
    if req.messages is not None:
        ids = _tokenize(ctx, [chat_prompt(ctx, req.messages, req.add_generation_prompt)], False, "messages")[0]
    else:
        ids = _tokenize(ctx, [req.prompt], req.add_special_tokens, "prompt")[0]
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}


def detokenize(body: bytes, ctx: Context) -> dict:
    req = parse(DetokenizeRequest, body)
    _check_model(ctx, req.model)
    tok = _need_tokenizer(ctx, "detokenize")
    if any(t >= tok.vocab_size for t in req.tokens):
        raise APIError(400, f"token ids must be below the vocabulary size {tok.vocab_size}", "tokens")
    return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}
