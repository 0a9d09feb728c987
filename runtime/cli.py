"""The `g4rt` console script: `generate` and `plan` (and `export`/`build` when export is installed)."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import time
from pathlib import Path

from g4rt.models.config import PUBLISHED, ConfigError, load_config

from .admission import RequestTooLarge, promise_for
from .plan import GIB, format_plan, make_plan
from .sampling import SamplingParams


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--token-ids: expected comma-separated integers, got {text!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"--token-ids: expected non-negative integers, got {text!r}")
    return ids


def _positive(name: str, kind=int):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: expected a number, got {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{name}: must be positive, got {text}")
        return v
    return parse


def _model_dir(spec: str) -> Path:
    from g4rt.models.tiny import resolve_model_dir
    try:
        return resolve_model_dir(spec)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None


def _tokenizer(model_dir: Path):
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path))


def _source(args, cmd: str) -> Path:
    if (args.model is None) == (args.engine is None):
        raise SystemExit(f"{cmd}: give exactly one of --model (eager engine) and --engine (a built engine dir)")
    return Path(args.engine) if args.engine else _model_dir(args.model)


def _open_llm(args, cmd: str, source: Path, frames_for):
    """The LLM that `generate` and `serve` run: a built engine (--engine) or the eager paged engine
    (or, with --reference, the linear cache) on --model. `frames_for(geometry)` sizes the arena."""
    import torch

    from g4rt.models.checkpoint import load_model

    from .llm import LLM
    from .scheduler import SchedulerConfig

    try:
        config = SchedulerConfig(max_num_batched_tokens=max(args.chunk, args.max_batched_tokens), chunk=args.chunk)
    except ValueError as e:
        raise SystemExit(f"{cmd}: {e}")
    if args.engine:
        from g4rt.export.build import load_engine
        from g4rt.export.manifest import ManifestError, manifest_geometry, read_manifest
        try:
            frames = frames_for(manifest_geometry(read_manifest(args.engine)))
            engine = load_engine(args.engine, frames)
        except (ManifestError, OSError, RuntimeError) as e:
            raise SystemExit(f"{cmd}: --engine: {e}")
        return LLM(engine, frames, config, eos_ids=engine.config.eos_token_ids), \
            f"{read_manifest(args.engine)['backend']} engine"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = load_model(source, dtype=dtype, device=args.device)
    frames = frames_for(LLM.geometry_for(model, args.page_tokens))
    kw = dict(num_frames=frames, page_tokens=args.page_tokens, config=config)
    if getattr(args, "reference", False):
        return LLM.reference(model, **kw), "linear reference"
    return LLM.paged(model, **kw), "eager paged"


def cmd_generate(args) -> int:
    source = _source(args, "generate")
    tok = _tokenizer(source)
    prompts = list(args.token_ids or [])
    for text in args.prompt or []:
        if tok is None:
            raise SystemExit(f"--prompt needs {source / 'tokenizer.json'}; pass --token-ids instead")
        prompts.append(tok.encode(text).ids)
    if not prompts:
        raise SystemExit("generate: give at least one --token-ids or --prompt")
    try:
        params = [SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p, seed=None if args.seed is None else args.seed + i)
                  for i in range(len(prompts))]
    except ValueError as e:
        raise SystemExit(f"generate: {e}")

    def frames_for(geometry) -> int:  # default pool: every request at once (their promises summed)
        return args.num_frames or sum(promise_for(geometry, len(p), args.max_new_tokens, args.chunk).frames
                                      for p in prompts)

    llm, engine_name = _open_llm(args, "generate", source, frames_for)
    frames = llm.pool.num_frames
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, params)
    except (RequestTooLarge, ValueError) as e:
        raise SystemExit(f"generate: {e}")
    wall = time.perf_counter() - t0
    n_tokens = sum(len(o.token_ids) for o in outs)
    results = [{"prompt_token_ids": o.prompt_token_ids, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                "text": tok.decode(o.token_ids) if tok else None, "ttft_s": o.ttft_s,
                "decode_tokens_per_s": o.decode_tokens_per_s} for o in outs]
    summary = {"engine": engine_name, "frames": frames, "wall_s": wall,
               "tokens": n_tokens, "tokens_per_s": n_tokens / wall if wall > 0 else None}
    if args.json:
        print(json.dumps({"outputs": results, **summary}))
    else:
        for i, r in enumerate(results):
            print(f"[{i}] {','.join(map(str, r['token_ids']))}  ({r['finish_reason']})")
            if r["text"] is not None:
                print(f"    {r['text']!r}")
        print(f"{n_tokens} tokens in {wall:.2f} s = {summary['tokens_per_s']:.1f} tokens/s ({summary['engine']})")
    return 0


def cmd_serve(args) -> int:
    from .arena import frames_in_budget
    from .server import Service, make_server

    source = _source(args, "serve")
    llm, engine_name = _open_llm(
        args, "serve", source,
        lambda geometry: args.num_frames or max(1, frames_in_budget(int(args.kv_memory_mib * 2**20),
                                                                    geometry.frame_bytes())))
    service = Service(llm).start()
    server = make_server(service, args.host, args.port, _tokenizer(source))
    host, port = server.server_address[:2]
    print(f"g4rt serve: {engine_name} on http://{host}:{port} ({llm.pool.num_frames} KV frames); "
          f"POST /v1/completions, GET /health; Ctrl-C stops", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        service.close()
    return 0


def cmd_plan(args) -> int:
    names = [args.model] if args.model else list(PUBLISHED)
    memory = None if args.memory_gib is None else int(args.memory_gib * GIB)
    plans = []
    for name in names:
        try:
            cfg = load_config(name)
        except ConfigError as e:
            raise SystemExit(f"plan: --model: {e}")
        plans.append(make_plan(name, cfg, context=args.context or cfg.max_position_embeddings, chunk=args.chunk,
                               page_tokens=args.page_tokens, dtype=args.dtype, memory_bytes=memory))
    if args.json:
        print(json.dumps([p.as_dict() for p in plans], indent=1))
    else:
        print("\n\n".join(format_plan(p) for p in plans))
    return 0


def _engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by `generate` and `serve`: what runs and how the KV pool and steps are sized."""
    p.add_argument("--model", help="model directory (config.json + safetensors) or 'tiny': the eager engine")
    p.add_argument("--engine", help="an engine directory from `g4rt build` (its manifest names the backend)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--page-tokens", type=_positive("--page-tokens"), default=16,
                   help="positions per sliding-group page")
    p.add_argument("--chunk", type=_positive("--chunk"), default=256, help="prefill chunk (a capacity parameter)")
    p.add_argument("--max-batched-tokens", type=_positive("--max-batched-tokens"), default=512,
                   help="token budget of one step")
    p.add_argument("--num-frames", type=_positive("--num-frames"), default=None,
                   help="KV arena frames (generate: default every prompt at once; serve: see --kv-memory-mib)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="g4rt", description="g4rt: Gemma 4 text inference. generate tokens, plan KV capacity, export the step graph and "
                                     "build engines. `g4rt COMMAND --help` explains each.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate tokens from one or more prompts",
                       description="Generate with continuous batching over the paged KV arena "
                                   "(or the linear reference cache with --reference).")
    _engine_args(g)
    g.add_argument("--token-ids", type=_token_ids, action="append",
                   help="a prompt as comma-separated token ids, e.g. 2,15,7 (repeat for several prompts)")
    g.add_argument("--prompt", action="append", help="a prompt as text (needs tokenizer.json; repeatable)")
    g.add_argument("--max-new-tokens", type=_positive("--max-new-tokens"), default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass to keep (1 = off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed; prompt i uses seed + i")
    g.add_argument("--reference", action="store_true", help="use the linear reference cache instead of pages")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate)

    v = sub.add_parser("serve", help="serve completions over HTTP (continuous batching, streaming)",
                       description="A low-latency HTTP service: one engine thread steps the batch while handler "
                                   "threads wait on their requests. POST /v1/completions {prompt | token_ids, "
                                   "max_tokens, temperature, top_k, top_p, seed, stop_token_ids, ignore_eos, "
                                   "stream}; GET /health. Binds 127.0.0.1 unless --host says otherwise.")
    _engine_args(v)
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    v.add_argument("--kv-memory-mib", type=_positive("--kv-memory-mib", float), default=256.0,
                   help="KV arena size when --num-frames is not given")
    v.set_defaults(func=cmd_serve)

    p = sub.add_parser("plan", help="KV bytes, page geometry and capacity per model size",
                       description="Per-token KV bytes of each cache group, per-request KV with every position "
                                   "kept vs sliding layers keeping W-1+chunk, page geometry, and how many "
                                   "requests fit in a memory budget after the weights.")
    p.add_argument("--model", help=f"model directory or size ({', '.join(PUBLISHED)}); default: all four")
    p.add_argument("--context", type=_positive("--context"), default=None,
                   help="positions per request (default: the model's max_position_embeddings)")
    p.add_argument("--memory-gib", type=_positive("--memory-gib", float), default=None,
                   help="device memory for weights + KV, in GiB")
    p.add_argument("--chunk", type=_positive("--chunk"), default=1, help="prefill chunk (1 = decode only)")
    p.add_argument("--page-tokens", type=_positive("--page-tokens"), default=16)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="weights and KV dtype (default: the config's)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    # The export engineer's subcommands (`export`, `build`) appear when that module exists.
    if importlib.util.find_spec("g4rt.export.cli") is not None:
        importlib.import_module("g4rt.export.cli").add_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
