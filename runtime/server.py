"""`g4rt serve`: a small HTTP service over one `LLM`, built for latency.

One engine thread owns the `LLM` and steps it whenever there is work; HTTP handler threads only hand
requests over and wait on a per-request queue. So a step never waits for a client, a slow or gone
client never stalls the batch, and new requests join the running batch at the next step (continuous
batching). Standard library only (`http.server`): the service is a thin shell around the runtime.

    POST /v1/completions
      {"prompt": "text"  |  "token_ids": [2, 15, 7],          one of the two
       "max_tokens": 16, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": null,
       "stop_token_ids": [], "ignore_eos": false, "stream": false}
      -> {"id", "token_ids", "text", "finish_reason", "error", "ttft_s", "total_s"}
      With "stream": true the reply is application/x-ndjson: one {"token_id", "text"} line per
      token as it is sampled, then the summary object above. A client that hangs up mid-stream
      cancels its request, and its pages go back to the pool at once.
    GET /health -> {"ok": true, "running": n, "waiting": n, "free_frames": n, "frames": n}

Bad input is a 400 whose message names the field; a request that can never fit the KV pool is a 400
naming the numbers (runtime/admission.py).
"""
from __future__ import annotations

import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .admission import RequestTooLarge
from .llm import LLM, RequestOutput
from .sampling import SamplingParams

FIELDS = {"prompt": str, "token_ids": list, "max_tokens": int, "temperature": (int, float), "top_k": int,
          "top_p": (int, float), "seed": (int, type(None)), "stop_token_ids": list, "ignore_eos": bool,
          "stream": bool}


class BadRequest(ValueError):
    pass


class Service:
    """Runs `llm` on its own thread. `submit` returns a queue of events for one request:
    ("token", id) per sampled token, then ("done", RequestOutput) or ("error", message)."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[int, list] = {}  # request id -> [events queue, tokens already sent]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="g4rt-engine", daemon=True)

    def start(self) -> "Service":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> queue.Queue:
        events: queue.Queue = queue.Queue()
        self._inbox.put(("add", prompt_ids, params, events))
        return events

    def cancel(self, request_id: int) -> None:
        self._inbox.put(("cancel", request_id))

    def stats(self) -> dict:
        s = self.llm.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting), "free_frames": self.llm.pool.num_free,
                "frames": self.llm.pool.num_frames}

    # ---- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.llm.has_unfinished())
            if self._stop.is_set() or not self.llm.has_unfinished():
                continue
            try:
                finished = self.llm.step()
            except Exception:  # the scheduler already ended the step's requests with the error;
                finished = []  # the next step() hands their outputs back
            self._publish(finished)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block)
            while True:
                if item is not None:
                    self._handle(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, item) -> None:
        if item[0] == "cancel":
            self.llm.cancel(item[1])
            self._publish([])
            return
        _, prompt_ids, params, events = item
        try:
            rid = self.llm.add_request(prompt_ids, params)
        except (ValueError, RequestTooLarge) as e:
            events.put(("error", str(e)))
            return
        events.put(("id", rid))
        self._streams[rid] = [events, 0]

    def _publish(self, finished: list[RequestOutput]) -> None:
        done = {o.request_id: o for o in finished} | {o.request_id: o for o in self.llm.take_finished()}
        for rid, (events, sent) in list(self._streams.items()):
            seq = self.llm.scheduler.seqs.get(rid)
            tokens = done[rid].token_ids if rid in done else (seq.output if seq else [])
            for tok in tokens[sent:]:
                events.put(("token", tok))
            self._streams[rid][1] = len(tokens)
            if rid in done:
                events.put(("done", done[rid]))
                del self._streams[rid]


def parse_request(body: bytes, tokenizer) -> tuple[list[int], SamplingParams, bool]:
    """JSON body -> (prompt ids, sampling params, stream); BadRequest names the offending field."""
    try:
        req = json.loads(body or b"{}")
    except json.JSONDecodeError as e:
        raise BadRequest(f"body is not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise BadRequest("body must be a JSON object")
    unknown = sorted(set(req) - set(FIELDS))
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(unknown)}; known: {', '.join(FIELDS)}")
    for name, kind in FIELDS.items():
        if name in req and (not isinstance(req[name], kind) or (kind is int and isinstance(req[name], bool))):
            raise BadRequest(f"field '{name}' has the wrong type: {req[name]!r}")
    if ("prompt" in req) == ("token_ids" in req):
        raise BadRequest("give exactly one of the fields 'prompt' and 'token_ids'")
    if "prompt" in req:
        if tokenizer is None:
            raise BadRequest("field 'prompt' needs a tokenizer.json next to the model; send 'token_ids'")
        ids = tokenizer.encode(req["prompt"]).ids
    else:
        ids = req["token_ids"]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRequest("field 'token_ids' must be a list of integers")
    try:
        params = SamplingParams(max_new_tokens=req.get("max_tokens", 16), temperature=float(req.get("temperature", 0.0)),
                                top_k=req.get("top_k", 0), top_p=float(req.get("top_p", 1.0)), seed=req.get("seed"),
                                stop_token_ids=tuple(req.get("stop_token_ids", ())),
                                ignore_eos=req.get("ignore_eos", False))
    except ValueError as e:
        raise BadRequest(f"{e} (fields max_tokens, temperature, top_k, top_p, seed)") from None
    return ids, params, req.get("stream", False)


def make_server(service: Service, host: str = "127.0.0.1", port: int = 8000, tokenizer=None) -> ThreadingHTTPServer:
    """The HTTP front end; `serve_forever()` it (port 0 picks a free port: see `server_address`)."""

    def summary(out: RequestOutput) -> dict:
        return {"id": out.request_id, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                "text": tokenizer.decode(out.token_ids) if tokenizer else None, "error": out.error,
                "ttft_s": out.ttft_s, "total_s": out.total_s}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: the service is measured, not logged per request
            pass

        def _json(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path != "/health":
                return self._json(404, {"error": f"no route GET {self.path}"})
            self._json(200, {"ok": True, **service.stats()})

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                return self._json(404, {"error": f"no route POST {self.path}"})
            try:
                ids, params, stream = parse_request(self.rfile.read(int(self.headers.get("Content-Length", 0))),
                                                    tokenizer)
            except BadRequest as e:
                return self._json(400, {"error": str(e)})
            events = service.submit(ids, params)
            kind, value = events.get()
            if kind == "error":
                return self._json(400, {"error": value})
            rid = value
            if not stream:
                while (ev := events.get())[0] != "done":
                    pass
                return self._json(200, summary(ev[1]))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                while True:
                    kind, value = events.get()
                    line = summary(value) if kind == "done" else {
                        "token_id": value, "text": tokenizer.decode([value]) if tokenizer else None}
                    self._chunk(json.dumps(line).encode() + b"\n")
                    if kind == "done":
                        break
                self._chunk(b"")
            except (BrokenPipeError, ConnectionResetError):
                service.cancel(rid)  # the client left: free its pages now

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server
