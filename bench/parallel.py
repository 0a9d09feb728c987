"""Tensor parallelism on N GPUs of one host: decode speed against the N-GPU roofline, tokens against TP1.

    python -m g4rt.bench.parallel --config 31b --tensor-parallel 2 --out DIR [--batches 1,64]
                                  [--prompt-len 128] [--new-tokens 64] [--backend inductor|eager]

One process is one arm (`--tensor-parallel 1` is the plain one-GPU engine, no extra process; N > 1 is
`ParallelEngine`: rank 0 here, ranks 1..N-1 spawned). Weights are `checkpoint.random_model`'s bf16
draws (seed 0, "deep" init), sliced per rank (`models/parallel.py: random_rank_model`), so every arm
runs the same model. Per batch size: generate greedily twice (the first compiles and captures every
graph the second replays) and report decode tok/s per sequence and in total. The roofline is the bytes
one rank reads per decode step (its weight shards and its KV at the mean context) at the copy
bandwidth measured at the start: ranks read their shards in parallel, so that is the N-GPU roofline;
the all-reduces are not in it. Records go to DIR/parallel_bench.jsonl; an arm whose TP1 twin
(same config, batch, lengths) is already in the file records whether its tokens equal TP1's, and
per sequence where they first differ (`first_differences`, None where equal). Run arms alternately,
each in a fresh process, at least three times each.
On CPU (`--device cpu`, e.g. a tiny config directory) the same code runs over gloo, without roofline.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from g4rt.models.checkpoint import random_model
from g4rt.models.parallel import ParallelGemma4Model
from g4rt.runtime.admission import promise_for
from g4rt.runtime.engines.parallel import ParallelEngine, RankSpec, engine_for
from g4rt.runtime.llm import LLM
from g4rt.runtime.scheduler import SchedulerConfig

from .common import ceilings, first_differences, log_json
from .engine import prompts_for, roofline, run_llm

SEED, INIT = 0, "deep"
RESULTS = "parallel_bench.jsonl"


def open_arm(spec: RankSpec):
    """One arm's engine: the plain one-GPU engine at TP1, else ParallelEngine."""
    if spec.tensor_parallel > 1:
        return ParallelEngine(spec)
    return engine_for(spec, random_model(spec.config(), spec.weights_dtype(), spec.rank_device(0), SEED, init=INIT))


def tp1_tokens(path: Path, key: dict) -> list | None:
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("tensor_parallel") == 1 and all(r.get(k) == v for k, v in key.items()):
            return r["tokens"]
    return None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="published size (31b, ...) or a config directory")
    ap.add_argument("--tensor-parallel", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--backend", choices=("inductor", "eager"), default="inductor")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in a.batches.split(",")]
    cuda = torch.device(a.device).type == "cuda"
    ceil = ceilings(quick=False) if cuda else None  # before any weights take the memory
    probe = RankSpec(a.config, a.tensor_parallel, 1, dtype=a.dtype, device=a.device, backend=a.backend,
                     random_seed=SEED, init=INIT)
    chunk = max(a.prompt_len, 256)
    frames = max(batches) * promise_for(probe.geometry(), a.prompt_len, a.new_tokens, chunk).frames
    spec = dataclasses.replace(probe, num_frames=frames)
    # The shapes one rank holds (on the meta device): what the roofline counts.
    model = ParallelGemma4Model(spec.config(), spec.tensor_parallel, 0, dtype=spec.weights_dtype(), device="meta")
    engine = open_arm(spec)
    scheduler = SchedulerConfig(max_num_batched_tokens=max(chunk, max(batches)), chunk=chunk,
                                max_num_seqs=max(batches))
    try:
        for b in batches:
            key = {"config": a.config, "batch": b, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                   "backend": a.backend, "dtype": a.dtype}
            llm = LLM(engine, frames, scheduler, eos_ids=())
            r = run_llm(llm, prompts_for(model, b, a.prompt_len, SEED), a.new_tokens)
            record = {**key, "tensor_parallel": a.tensor_parallel, "frames": frames, **r}
            if ceil is not None:
                roof = roofline(model, b, a.prompt_len + a.new_tokens // 2, ceil)
                record.update(roof, of_roofline=round(r["decode_tok_s_total"] / roof["roofline_tok_s_total"], 3))
            if a.tensor_parallel > 1:
                ref = tp1_tokens(out / RESULTS, key)
                if ref is not None:
                    record.update(equal_to_tp1=ref == r["tokens"],
                                  first_differences=first_differences(r["tokens"], ref))
            log_json(out, record, RESULTS)
    finally:
        if isinstance(engine, ParallelEngine):
            engine.close()


if __name__ == "__main__":
    main()
