"""The OpenAI-compatible service behind `g4rt serve` (runtime/server.py runs it on uvicorn).

Three threads of work, so that no step waits on a client and no client waits on a step:

* the **event loop** (uvicorn) only reads bodies, checks auth and limits, and writes bytes;
* **worker threads** parse and validate JSON, render chat templates and tokenize (prepare.py);
* the **engine thread** owns the `LLM` and steps it whenever there is work (engine_loop.py); after
  each step it hands the new token ids to
* the **output thread** (outputs.py), which detokenizes incrementally, applies stop strings, formats
  logprobs and encodes the SSE chunks and responses, then posts them to the event loop in one call.

Modules import one way: protocol, text, chat, metrics  <-  prepare, outputs  <-  engine_loop  <-  app.
"""
