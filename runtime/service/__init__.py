"""The OpenAI-compatible service behind `g4rt serve` (runtime/server.py runs it on uvicorn).

Two processes (as vLLM's API server and engine core), so that the step loop never waits on a
client's Python and no client waits on a step:

* the **engine process** (engine_loop.py, multiprocessing "spawn") owns the `LLM`: it builds it,
  warms it up, and steps whenever there is work; after each step it sends every request's new token
  ids in one message over a pipe (wire.py);
* the **API process** keeps everything else. Its **event loop** (uvicorn) reads bodies, checks
  auth and limits, writes bytes, and prepares completions of token ids in small bodies itself
  (prepare.cheap: cheaper than two thread hops); **worker threads** parse and validate other JSON,
  render chat templates and tokenize (prepare.py). The pipe to the engine is the event loop's too
  (client.py): it writes new requests and cancellations at once, and takes the engine's messages
  as they arrive, detokenizes, applies stop strings, formats logprobs and encodes the SSE chunks and
  responses (outputs.py), streams that start or end first.

Modules import one way: protocol, text, chat, metrics, wire  <-  prepare  <-  outputs (its `Spec`);
wire  <-  engine_loop; outputs, engine_loop  <-  client  <-  app.
"""
