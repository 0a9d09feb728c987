"""Engine token ids -> text, stop strings, logprobs, SSE chunks and responses (the API process).

The engine process sends, after each step, the new tokens of every choice that got any (wire.Update);
the client (client.py) hands them to `Outputs.apply` on the event loop, which turns them into bytes
and gives each job its own; the job's response then writes them. A `Job` is one HTTP request
(n choices x prompts); a `Choice` is one engine request.

That path runs once per step for every running stream, so its per-stream work is kept small: the
step's detokenizing is one tokenizer call for all streams (text.py), and a streamed chunk is its
choice's pre-rendered JSON head plus the few fields that change (the same bytes `sse` would write).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

from .metrics import Metrics
from .prepare import Spec
from .protocol import APIError, SSE_DONE, compact, new_id, now, sse, usage
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
        # a streamed chunk's bytes up to its first varying field (`Outputs._chunk`)
        self.head = job.head + b'{"index":%d,' % index if spec.stream else b""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Job:
    """One HTTP request. The event loop awaits `accepted`, then reads `chunks` (stream) or `result`."""

    def __init__(self, spec: Spec, model: str, loop: asyncio.AbstractEventLoop, tok: Tokenizer | None):
        self.spec, self.model, self.loop = spec, model, loop
        self.id = new_id("cmpl" if spec.kind == "completion" else "chatcmpl")
        self.object = "chat.completion.chunk" if spec.kind == "chat" else "text_completion"
        self.created = now()
        self.arrival = time.perf_counter()
        # every streamed chunk of this job starts so: {"id":...,"object":...,"created":...,"model":...,"choices":[
        self.head = b"data: " + compact({"id": self.id, "object": self.object, "created": self.created,
                                         "model": model})[:-1] + b',"choices":['
        self.choices = [Choice(self, i, p, tok) for i, (p, _) in enumerate(spec.choices)]
        self.open = len(self.choices)  # choices not done
        self.accepted: asyncio.Future = loop.create_future()
        self.result: asyncio.Future = loop.create_future()  # (status, body bytes) when not streaming
        self.finished = False
        self._pending: list = []  # stream bytes not yet taken, then None at the end (event loop only)
        self._wake: asyncio.Future | None = None

    def cids(self) -> list[int]:
        return [c.cid for c in self.choices if c.cid is not None]

    def push(self, payload: bytes | None) -> None:
        """On the event loop: queue stream bytes (None: the end) for `take`."""
        self._pending.append(payload)
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def take(self) -> list:
        """On the event loop: everything pushed since the last take (waiting for at least one)."""
        while not self._pending:
            self._wake = self.loop.create_future()
            await self._wake
        out, self._pending = self._pending, []
        return out


def _set(fut: asyncio.Future, value=None, error: BaseException | None = None) -> None:
    if not fut.done():
        fut.set_exception(error) if error else fut.set_result(value)


class Outputs:
    def __init__(self, tokenizer: Tokenizer | None, metrics: Metrics, cancel):
        self.tok = tokenizer
        self.metrics = metrics
        self.cancel = cancel  # cancel(cids): stop strings end choices the engine still runs

    def apply(self, updates: list[tuple[Choice, Update]], accepted: list = ()) -> None:
        """Format a step's updates and deliver them, with `accepted` jobs' (job, error or None). Streams
        that start or end this step go before the others: a first token (time to first token) and a last
        one (a closed-loop client's cue for its next request) then wait for no other stream's write."""
        posts = [(job, "accepted", err) for job, err in accepted]
        items: dict[Job, list] = {}  # in the order they came, per job
        urgent: set[Job] = set()
        try:
            tokens = 0
            for (c, u), texts in zip(updates, self._decode(updates)):
                tokens += len(u.token_ids)
                first = not c.last_sent
                out = self._apply(c, u, texts)
                if out:
                    items.setdefault(c.job, []).extend(out)
                    if first or c.job.finished:
                        urgent.add(c.job)
            if tokens:
                self.metrics.generation_tokens.inc(tokens)
        except Exception:  # a formatting bug must not take the service down: fail that batch's jobs
            log.exception("formatting a step's output failed")
            for c, _ in updates:
                err = APIError(500, "internal error while formatting output")
                items.setdefault(c.job, []).extend(self._fail(c.job, err))
        for job in sorted(items, key=lambda j: j not in urgent):  # stable: the urgent ones first, in order
            posts += items[job]
        _deliver(posts)

    def fail(self, jobs, err: APIError) -> None:
        """End every job in `jobs` with `err` (the engine process died): pending admissions and streams."""
        posts = []
        for job in jobs:
            posts += [(job, "accepted", err)] + self._fail(job, err)
        _deliver(posts)

    # ---- one step's detokenizing ----------------------------------------------------------------
    def _decode(self, updates: list[tuple[Choice, Update]]) -> list:
        """Per update, the decoded window its choice's detokenizer asked for (text.py), or None: all of
        the step's windows in one tokenizer call per skip_special_tokens setting."""
        slots, groups = [], {}
        for c, u in updates:
            ids = None
            if c.detok is not None and not (c.done or c.job.finished):
                ids = c.detok.window(self._visible(c, u), u.finish_reason is not None)
            if ids is None:
                slots.append(None)
                continue
            group = groups.setdefault(c.detok.skip, [])
            slots.append((c.detok.skip, len(group)))
            group += ids
        texts = {skip: self.tok.decode_many(ids, skip) for skip, ids in groups.items()}
        return [None if s is None else texts[s[0]][s[1]:s[1] + 2] for s in slots]

    @staticmethod
    def _visible(c: Choice, u: Update) -> list[int]:
        """The update's tokens that show as text (a stop token does not, unless asked)."""
        return u.token_ids[:-1] if u.finish_reason == "stop" and not c.job.spec.include_stop else u.token_ids

    # ---- one update ----------------------------------------------------------------------------
    def _apply(self, c: Choice, u: Update, texts: list[str] | None) -> list:
        job, m = c.job, self.metrics
        if c.done or job.finished:
            return []
        t = time.perf_counter()
        if u.queue_s is not None:
            m.queue.observe(u.queue_s)
        ids = u.token_ids
        if ids:
            if c.last_time is None:
                m.ttft.observe(t - job.arrival)
            else:
                m.itl.observe(t - c.last_time)
            c.last_time = t
        c.token_ids += ids
        final = u.finish_reason is not None
        piece = ""
        if c.detok is not None:
            piece = c.detok.advance(texts, final) if texts is not None else ""
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
            job.open -= 1
            m.finished.labels(c.finish_reason).inc()
            m.e2e.observe(t - job.arrival)
        c.text.append(piece)
        c.text_len += len(piece)
        if job.spec.stream:
            return self._stream_items(c, piece, ids, lps) if ids or c.done else []
        if not job.open:
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

    def _logprobs_value(self, spec: Spec, lps: list):
        if spec.logprobs is None:
            return None
        return {"content": lps} if spec.kind == "chat" else self._completion_logprobs(lps)

    def _choice_body(self, c: Choice, text: str) -> dict:
        """A response's choice (not streamed: streamed chunks are `_chunk`)."""
        spec = c.job.spec
        logprobs = self._logprobs_value(spec, c.lp_entries)
        if spec.kind == "chat":
            body = {"index": c.index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": c.finish_reason}
        else:
            body = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}
        if spec.return_token_ids:
            body["token_ids"] = c.token_ids
        return body

    def _chunk(self, c: Choice, text: str, ids: list[int], lps: list) -> bytes:
        """One streamed chunk: the bytes of `sse({"id", "object", "created", "model", "choices": [{"index",
        "text" | "delta" (with the role on a chat choice's first), "logprobs", "finish_reason",
        "token_ids" when asked}]})`, from the choice's pre-rendered head."""
        spec = c.job.spec
        if spec.kind == "chat":
            field = b'"delta":{"content":' if c.last_sent else b'"delta":{"role":"assistant","content":'
            body = field + compact(text) + b"}"
        else:
            body = b'"text":' + compact(text)
        logprobs = b"null" if spec.logprobs is None else compact(self._logprobs_value(spec, lps))
        reason = b"null" if c.finish_reason is None else compact(c.finish_reason)
        token_ids = b',"token_ids":[' + ",".join(map(str, ids)).encode() + b"]" if spec.return_token_ids else b""
        return c.head + body + b',"logprobs":' + logprobs + b',"finish_reason":' + reason + token_ids + b"}]}\n\n"

    def _stream_items(self, c: Choice, piece: str, ids: list[int], lps: list) -> list:
        job = c.job
        if c.error:
            return self._fail(job, APIError(500, f"engine error: {c.error}"))
        if not c.last_sent and job.spec.echo:
            piece = (job.spec.prompt_texts[c.prompt_index] or "") + piece
        items = [(job, "chunk", self._chunk(c, piece, ids, lps))]
        c.last_sent = True
        if not job.open:
            job.finished = True
            if job.spec.include_usage:
                items.append((job, "chunk", sse({"id": job.id, "object": job.object, "created": job.created,
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
            choices.append(self._choice_body(c, text))
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


def _deliver(items: list) -> None:
    """Hand each job its admission, its chunks or its result."""
    for job, kind, payload in items:
        if kind == "chunk":
            job.push(payload)
        elif kind == "accepted":
            _set(job.accepted, True, payload)
        else:
            _set(job.result, payload)
