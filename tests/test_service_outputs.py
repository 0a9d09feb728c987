"""The engine messages' formatting alone (outputs.py, no server): streamed chunks, rendered from a
pre-built head with one batched detokenize per step, say exactly what the answer without streaming
says, in canonical JSON."""
from __future__ import annotations

import asyncio
import json
import random

import pytest

from g4rt.models.tiny import ensure_tiny
from g4rt.runtime.sampling import GenerationDefaults
from g4rt.runtime.service import prepare
from g4rt.runtime.service.chat import ChatTemplate
from g4rt.runtime.service.metrics import Metrics
from g4rt.runtime.service.outputs import Job, Outputs
from g4rt.runtime.service.protocol import sse
from g4rt.runtime.service.text import Tokenizer
from g4rt.runtime.service.wire import Update


@pytest.fixture(scope="module")
def ctx():
    d = ensure_tiny()
    return prepare.Context("tiny", 4096, Tokenizer.from_dir(d), ChatTemplate.from_dir(d))


def steps(rng, n_choices: int, logprobs: bool) -> list[list[tuple[int, Update]]]:
    """Random per-step updates of `n_choices` choices of different lengths, ending "length" or "stop"."""
    lengths = [rng.randint(1, 12) for _ in range(n_choices)]
    out = []
    for s in range(max(lengths)):
        step = []
        for i, n in enumerate(lengths):
            if s >= n:
                continue
            ids = [rng.randrange(4, 512)]
            lps = [(-rng.random(), [(rng.randrange(4, 512), -rng.random()) for _ in range(2)])] if logprobs else None
            step.append((i, Update(i, ids, lps, None if s < n - 1 else rng.choice(["length", "stop"]))))
        out.append(step)
    return out


def run(ctx, body: dict, updates) -> tuple[Job, list[bytes]]:
    loop = asyncio.new_event_loop()
    try:
        fn = prepare.chat if "messages" in body else prepare.completion
        job = Job(fn(json.dumps(body).encode(), ctx), "tiny", loop, ctx.tokenizer)
        out = Outputs(ctx.tokenizer, Metrics(), lambda cids: None)
        for step in updates:
            out.apply([(job.choices[i], u) for i, u in step])
        if body.get("stream"):
            return job, [p for p in loop.run_until_complete(job.take()) if p is not None]
        return job, [loop.run_until_complete(job.result)[1]]
    finally:
        loop.close()


@pytest.mark.parametrize("stops", [True, False])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streamed_chunks_say_what_the_unstreamed_answer_says(ctx, kind, stops):
    rng = random.Random(0 if kind == "chat" else 1)
    base = {"n": 3, "max_tokens": 16, "return_token_ids": True, "stop": ["ab", "é"] if stops else None}
    if kind == "chat":
        base |= {"messages": [{"role": "user", "content": "héllo 日本"}], "logprobs": True, "top_logprobs": 2}
    else:
        base |= {"prompt": ["héllo 日本", "x"], "logprobs": 2, "n": 2}
    for trial in range(20):
        choices = base["n"] * (2 if kind == "completion" else 1)
        updates = steps(rng, choices, logprobs=True)
        _, (whole,) = run(ctx, base, updates)
        _, chunks = run(ctx, {**base, "stream": True, "stream_options": {"include_usage": True}}, updates)
        assert chunks[-1] == b"data: [DONE]\n\n"
        events = [json.loads(c[6:]) for c in chunks[:-1]]
        assert all(c == sse(e) for c, e in zip(chunks, events)), trial  # canonical: what sse() writes
        expected = json.loads(whole)
        assert events[-1]["usage"] == expected["usage"]
        assert all(e["id"] == events[0]["id"] and e["created"] == events[0]["created"] for e in events)
        for ch in expected["choices"]:
            mine = [c for e in events for c in e["choices"] if c["index"] == ch["index"]]
            text = "".join(c["delta"]["content"] if kind == "chat" else c["text"] for c in mine)
            assert text == (ch["message"]["content"] if kind == "chat" else ch["text"]), trial
            if not stops:  # each choice's own tokens, decoded at once (a stop token does not show)
                shown = ch["token_ids"][:-1] if ch["finish_reason"] == "stop" else ch["token_ids"]
                assert text == ctx.tokenizer.decode(shown), trial
            assert sum((c["token_ids"] for c in mine), []) == ch["token_ids"]
            assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + [ch["finish_reason"]]
            if kind == "chat":
                assert [("role" in c["delta"]) for c in mine] == [True] + [False] * (len(mine) - 1)
                assert sum((c["logprobs"]["content"] for c in mine), []) == ch["logprobs"]["content"]
            else:
                assert sum((c["logprobs"]["tokens"] for c in mine), []) == ch["logprobs"]["tokens"]


def test_only_small_token_id_bodies_are_prepared_on_the_event_loop():
    ids = json.dumps({"prompt": [5, 6, 7], "max_tokens": 2}).encode()
    assert prepare.cheap(ids, 1024) and prepare.cheap(b'{"prompt":[[5,6],[7]]}', 1024)
    assert not prepare.cheap(ids, len(ids) - 1)  # too big: the prepare pool
    assert not prepare.cheap(json.dumps({"prompt": "5, 6", "max_tokens": 2}).encode(), 1024)  # text to tokenize
    assert not prepare.cheap(json.dumps({"prompt": ["a"]}).encode(), 1024)


def test_streams_that_start_or_end_are_delivered_before_the_others(ctx):
    """One step's chunks reach the event loop new and ending streams first, each job's in its order."""
    loop = asyncio.new_event_loop()
    try:
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 4, "stream": True}).encode()
        jobs = [Job(prepare.completion(body, ctx), "tiny", loop, ctx.tokenizer) for _ in range(3)]
        out = Outputs(ctx.tokenizer, Metrics(), lambda cids: None)
        out.apply([(jobs[0].choices[0], Update(0, [9], None)), (jobs[2].choices[0], Update(2, [9], None))])
        loop.run_until_complete(asyncio.sleep(0))  # jobs 0 and 2 are under way
        delivered = []
        for j in jobs:
            j.push = lambda payload, j=j: delivered.append((jobs.index(j), payload))
        out.apply([(jobs[0].choices[0], Update(0, [10], None)),  # under way
                   (jobs[1].choices[0], Update(1, [11], None)),  # its first token
                   (jobs[2].choices[0], Update(2, [12], None, "length"))])  # its last
        loop.run_until_complete(asyncio.sleep(0))  # the posted callback runs
        order = [i for i, _ in delivered]
        assert order == [1, 2, 2, 2, 0], order  # job 2: its chunk, [DONE], the end; then job 0
        assert delivered[3] == (2, None) and delivered[2][1] == b"data: [DONE]\n\n"
    finally:
        loop.close()


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_prompt_that_fills_max_model_len_is_refused_naming_the_prompt(ctx, kind):
    """No room for one token: a 400 naming the prompt's field and both lengths, whether max_tokens was
    sent or not (without it, chat's default of what is left would be 0 tokens)."""
    from g4rt.runtime.service.protocol import APIError

    body = ({"messages": [{"role": "user", "content": "Hello there, how are you today?"}]} if kind == "chat"
            else {"prompt": list(range(4, 40))})
    fn, param = (prepare.chat, "messages") if kind == "chat" else (prepare.completion, "prompt")
    n = len(fn(json.dumps(body).encode(), ctx).prompts[0])
    for limit in (n, n - 1):
        small = prepare.Context(ctx.model_name, limit, ctx.tokenizer, ctx.template)
        for extra in ({}, {"max_tokens": 1}):
            with pytest.raises(APIError) as e:
                fn(json.dumps({**body, **extra}).encode(), small)
            err = e.value
            assert (err.status, err.param, err.code) == (400, param, "context_length_exceeded"), err.message
            assert f"{param} is {n} tokens" in err.message and f"max_model_len {limit} tokens" in err.message
    roomy = prepare.Context(ctx.model_name, n + 1, ctx.tokenizer, ctx.template)
    assert fn(json.dumps({**body, "max_tokens": 1}).encode(), roomy).choices[0][1].max_new_tokens == 1


@pytest.mark.parametrize("choice, ok", [(None, True), ("none", True), ("auto", True), ("required", False),
                                        ({"type": "function", "function": {"name": "f"}}, False)])
def test_tool_choice_error_names_what_is_accepted(ctx, choice, ok):
    from g4rt.runtime.service.protocol import APIError, ChatCompletionRequest, parse

    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "tool_choice": choice}).encode()
    if ok:
        parse(ChatCompletionRequest, body)
        return
    with pytest.raises(APIError) as e:
        parse(ChatCompletionRequest, body)
    assert e.value.param == "tool_choice" and "only 'none' and 'auto'" in e.value.message


def test_sampling_a_request_leaves_out_comes_from_the_models_generation_config(tmp_path, ctx, caplog):
    """GenerationDefaults: without a generation_config.json a request gets the OpenAI API's settings; with one, the
    temperature / top_k / top_p / max_new_tokens it sets wherever the request leaves them out (what the request
    sends wins, top_k 0 or -1 turning the model's top-k off; the model's length within what the prompt leaves of
    max_model_len); a bad value is refused naming the file and the key; a setting this engine lacks is served
    without and logged."""
    def params(defaults, sent=None, prompt=(2, 5), kind="completion"):
        c = prepare.Context(ctx.model_name, ctx.max_model_len, ctx.tokenizer, ctx.template, defaults)
        body = {"prompt": list(prompt)} if kind == "completion" else {"messages": [{"role": "user", "content": "hi"}]}
        (_, p), = getattr(prepare, kind)(json.dumps({**body, **(sent or {})}).encode(), c).choices
        return p.temperature, p.top_k, p.top_p, p.max_new_tokens

    assert GenerationDefaults.from_dir(tmp_path) == GenerationDefaults()
    assert params(GenerationDefaults()) == (1.0, 0, 1.0, 16)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "top_k": 64, "top_p": 0.95, "repetition_penalty": 1.1, "bos_token_id": 2,
         "max_new_tokens": 40}))
    with caplog.at_level("WARNING", logger="g4rt.sampling"):
        gemma = GenerationDefaults.from_dir(tmp_path)
    assert "repetition_penalty" in caplog.text
    assert params(gemma) == (1.0, 64, 0.95, 40) and params(gemma, kind="chat")[3] == 40
    assert params(gemma, prompt=[2] * (ctx.max_model_len - 3))[3] == 3  # within what the prompt leaves
    assert params(gemma, {"temperature": 0.5, "top_p": 0.5, "max_tokens": 7}) == (0.5, 64, 0.5, 7)
    assert params(gemma, {"top_k": 0})[:3] == params(gemma, {"top_k": -1})[:3] == (1.0, 0, 0.95)
    assert gemma.eos_token_ids == ()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    assert GenerationDefaults.from_dir(tmp_path) == GenerationDefaults(eos_token_ids=(1, 106))
    for bad, key in (({"top_p": 1.5}, "top_p"), ({"top_k": 6.5}, "top_k"), ({"temperature": -1}, "temperature"),
                     ({"max_new_tokens": 0}, "max_new_tokens")):
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=f"generation_config.json: {key}"):
            GenerationDefaults.from_dir(tmp_path)
