"""Engine token ids -> text, stop strings, logprobs, SSE chunks and responses (the API process).

The engine process sends, after each step, the new tokens of every choice that got any (wire.Update);
the client's reader thread (client.py) hands them to `Outputs.apply`, which turns them into bytes and
posts one callback per batch to the event loop, which only writes them. A `Job` is one HTTP request
(n choices x prompts); a `Choice` is one engine request and is touched by the reader thread alone
once it runs.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from .metrics import Metrics
from .prepare import Spec
from .protocol import APIError, SSE_DONE, new_id, now, sse, usage
from .text import IncrementalDetokenizer, StopStrings, Tokenizer
from .wire import Update

log = logging.getLogger("g4rt.serve")


class Choice:
    def __init__(self, job: "Job", index: int, prompt_index: int, tok: Tokenizer | None):
        self.job, self.index, self.prompt_index = job, index, prompt_index
        spec = job.spec
        prompt = spec.prompts[prompt_index]
        self.detok = IncrementalDetokenizer(tok, prompt, spec.skip_special_tokens) if tok else None
        self.stops = StopStrings(spec.stops, spec.include_stop)
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.lp_entries: list = []  # completions: (token, logprob, top, offset); chat: content entries
        self.text_len = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.last_time: float | None = None
        self.cid: int | None = None  # the id the engine process knows it by (set when the job is submitted)
        self.last_sent = False  # a streamed chunk went out (chat: the first one carries the role)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Job:
    """One HTTP request. The event loop awaits `accepted`, then reads `chunks` (stream) or `result`."""

    def __init__(self, spec: Spec, model: str, loop: asyncio.AbstractEventLoop, tok: Tokenizer | None):
        self.spec, self.model, self.loop = spec, model, loop
        self.id = new_id("cmpl" if spec.kind == "completion" else "chatcmpl")
        self.created = now()
        self.arrival = time.perf_counter()
        self.choices = [Choice(self, i, p, tok) for i, (p, _) in enumerate(spec.choices)]
        self.accepted: asyncio.Future = loop.create_future()
        self.chunks: asyncio.Queue = asyncio.Queue()  # bytes, then None at the end of the stream
        self.result: asyncio.Future = loop.create_future()  # (status, body bytes) when not streaming
        self.finished = False

    def cids(self) -> list[int]:
        return [c.cid for c in self.choices if c.cid is not None]


def _set(fut: asyncio.Future, value=None, error: BaseException | None = None) -> None:
    if not fut.done():
        fut.set_exception(error) if error else fut.set_result(value)


class Outputs:
    def __init__(self, tokenizer: Tokenizer | None, metrics: Metrics, cancel):
        self.tok = tokenizer
        self.metrics = metrics
        self.cancel = cancel  # cancel(cids): stop strings end choices the engine still runs

    def apply(self, updates: list[tuple[Choice, Update]], accepted: list = ()) -> None:
        """Format a step's updates and post them, with `accepted` jobs' (job, error or None), to the
        event loop in one call."""
        posts: dict[asyncio.AbstractEventLoop, list] = {}
        for job, err in accepted:
            posts.setdefault(job.loop, []).append((job, "accepted", err))
        try:
            for c, u in updates:
                for item in self._apply(c, u):
                    posts.setdefault(c.job.loop, []).append(item)
        except Exception:  # a formatting bug must not take the service down: fail that batch's jobs
            log.exception("formatting a step's output failed")
            for c, _ in updates:
                posts.setdefault(c.job.loop, []).extend(
                    self._fail(c.job, APIError(500, "internal error while formatting output")))
        _post(posts)

    def fail(self, jobs, err: APIError) -> None:
        """End every job in `jobs` with `err` (the engine process died): pending admissions and streams."""
        posts: dict[asyncio.AbstractEventLoop, list] = {}
        for job in jobs:
            posts.setdefault(job.loop, []).append((job, "accepted", err))
            posts[job.loop] += self._fail(job, err)
        _post(posts)

    # ---- one update ----------------------------------------------------------------------------
    def _apply(self, c: Choice, u: Update) -> list:
        job, m = c.job, self.metrics
        if c.done or job.finished:
            return []
        t = time.perf_counter()
        if u.queue_s is not None:
            m.queue.observe(u.queue_s)
        ids = list(u.token_ids)
        if ids:
            m.generation_tokens.inc(len(ids))
            if c.last_time is None:
                m.ttft.observe(t - job.arrival)
            else:
                m.itl.observe(t - c.last_time)
            c.last_time = t
        c.token_ids += ids
        visible = ids[:-1] if u.finish_reason == "stop" and not job.spec.include_stop else ids
        final = u.finish_reason is not None
        piece = ""
        if c.detok is not None:
            piece = c.detok.push(visible) if visible else ""
            if final:
                piece += c.detok.flush()
            piece = c.stops.feed(piece, final=final)
        lps = self._logprobs(c, ids, u.logprobs)
        reason = u.finish_reason
        if c.stops.hit:
            reason = "stop"
            if not final:
                self.cancel([c.cid])
        if reason is not None:
            c.finish_reason = {"cancelled": "abort"}.get(reason, reason)
            c.error = u.error
            m.finished.labels(c.finish_reason).inc()
            m.e2e.observe(t - job.arrival)
        c.text.append(piece)
        c.text_len += len(piece)
        if job.spec.stream:
            return self._stream_items(c, piece, ids, lps) if ids or c.done else []
        if all(ch.done for ch in job.choices):
            return [self._response(job)]
        return []

    def _logprobs(self, c: Choice, ids: list[int], lps) -> list:
        if lps is None or self.tok is None:
            return []
        names = self.tok.token_strings(ids + [i for _, top in lps for i, _ in top])
        tokens, tops = names[:len(ids)], iter(names[len(ids):])
        out = []
        for tok_str, (lp, top) in zip(tokens, lps):
            top_named = [(next(tops), v) for _, v in top]
            if c.job.spec.kind == "chat":
                out.append({"token": tok_str, "logprob": lp, "bytes": list(tok_str.encode()),
                            "top_logprobs": [{"token": s, "logprob": v, "bytes": list(s.encode())}
                                             for s, v in top_named]})
            else:
                top_dict: dict[str, float] = {}
                for s, v in top_named:  # tokens that decode alike (partial characters) keep the likeliest
                    top_dict.setdefault(s, v)
                out.append((tok_str, lp, top_dict, c.text_len))
        c.lp_entries += out
        return out

    @staticmethod
    def _completion_logprobs(entries) -> dict:
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [e[2] for e in entries], "text_offset": [e[3] for e in entries]}

    def _choice_body(self, c: Choice, text: str, ids: list[int], lps: list, stream: bool) -> dict:
        spec = c.job.spec
        logprobs = None
        if spec.logprobs is not None:
            logprobs = {"content": lps} if spec.kind == "chat" else self._completion_logprobs(lps)
        if spec.kind == "chat":
            body = {"index": c.index, ("delta" if stream else "message"):
                    {"role": "assistant", "content": text} if not stream or not c.last_sent else {"content": text},
                    "logprobs": logprobs, "finish_reason": c.finish_reason}
        else:
            body = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}
        if spec.return_token_ids:
            body["token_ids"] = ids
        return body

    def _stream_items(self, c: Choice, piece: str, ids: list[int], lps: list) -> list:
        job = c.job
        if c.error:
            return self._fail(job, APIError(500, f"engine error: {c.error}"))
        items = []
        obj = "chat.completion.chunk" if job.spec.kind == "chat" else "text_completion"
        if not c.last_sent and job.spec.echo:
            piece = (job.spec.prompt_texts[c.prompt_index] or "") + piece
        items.append((job, "chunk", sse({"id": job.id, "object": obj, "created": job.created, "model": job.model,
                                         "choices": [self._choice_body(c, piece, ids, lps, True)]})))
        c.last_sent = True
        if all(ch.done for ch in job.choices):
            job.finished = True
            if job.spec.include_usage:
                items.append((job, "chunk", sse({"id": job.id, "object": obj, "created": job.created,
                                                 "model": job.model, "choices": [], "usage": self._usage(job)})))
            items += [(job, "chunk", SSE_DONE), (job, "chunk", None)]
        return items

    def _usage(self, job: Job) -> dict:
        return usage(sum(len(p) for p in job.spec.prompts), sum(len(c.token_ids) for c in job.choices))

    def _response(self, job: Job):
        job.finished = True
        errors = [c.error for c in job.choices if c.error]
        if errors:
            return (job, "result", (500, json.dumps(APIError(500, f"engine error: {errors[0]}").body()).encode()))
        choices = []
        for c in job.choices:
            text = "".join(c.text)
            if job.spec.echo:
                text = (job.spec.prompt_texts[c.prompt_index] or "") + text
            choices.append(self._choice_body(c, text, c.token_ids, c.lp_entries, False))
        body = {"id": job.id, "object": "chat.completion" if job.spec.kind == "chat" else "text_completion",
                "created": job.created, "model": job.model, "choices": choices, "usage": self._usage(job)}
        if job.spec.return_token_ids:
            body["prompt_token_ids"] = job.spec.prompts if len(job.spec.prompts) > 1 else job.spec.prompts[0]
        return (job, "result", (200, json.dumps(body, ensure_ascii=False).encode()))

    def _fail(self, job: Job, err: APIError) -> list:
        if job.finished:
            return []
        job.finished = True
        self.cancel(job.cids())
        if job.spec.stream:
            return [(job, "chunk", sse(err.body())), (job, "chunk", SSE_DONE), (job, "chunk", None)]
        return [(job, "result", (err.status, json.dumps(err.body()).encode()))]


def _post(posts: dict) -> None:
    for loop, items in posts.items():
        with contextlib.suppress(RuntimeError):  # the event loop already closed (shutdown)
            loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list) -> None:
    """On the event loop: hand each job its admission, its chunks or its result."""
    for job, kind, payload in items:
        if kind == "chunk":
            job.chunks.put_nowait(payload)
        elif kind == "accepted":
            _set(job.accepted, True, payload)
        else:
            _set(job.result, payload)
