"""The `g4rt` console script: generate, serve, bench, plan, export, build, check, trt-engine.

The top of the dependency order (plugins <- models <- export, runtime <- this module): it is the one
place that imports both `export` (which writes engine directories) and `runtime` (which runs them).
Building the parser imports only the base dependencies, so `g4rt plan`, `g4rt generate --model` and
`g4rt --help` work without any extra; a command that needs one says which (`_need`).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

from g4rt.models.config import PUBLISHED, ConfigError, load_config
from g4rt.models.layout import DTYPES, KV_DTYPES, PAGE_TOKENS, PageGeometry
from g4rt.models.manifest import BACKENDS
from g4rt.models.parallel import TP_SIZES
from g4rt.plugins.ops import KERNELS, check_kernels
from g4rt.runtime.admission import RequestTooLarge, promise_for
from g4rt.runtime.plan import GIB, format_plan, make_plan
from g4rt.runtime.sampling import GenerationDefaults, SamplingParams


def _need(cmd: str, extra: str, *modules: str) -> None:
    """Stop `cmd` with the pip command that installs `extra` when one of `modules` is missing."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"{cmd}: needs {', '.join(missing)}, from the {extra} extra: pip install 'g4rt[{extra}]'")


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


def _run_device(args, cmd: str, manifest: dict | None) -> str:
    """The device the engine runs on: --device, else the backend's (CUDA for inductor and tensorrt
    engines, which run nowhere else; the CPU for --model and onnxruntime engines, whose device the
    execution providers pick, --ort-providers)."""
    import torch

    backend = manifest.get("backend") if manifest else None
    if args.device is None:
        return "cuda" if backend in ("inductor", "tensorrt") else "cpu"
    try:
        kind = torch.device(args.device).type
    except RuntimeError as e:
        raise SystemExit(f"{cmd}: --device {args.device!r}: {e}") from None
    if backend == "onnxruntime" and kind != "cpu":
        raise SystemExit(f"{cmd}: --device {args.device} does not apply to an onnxruntime engine (its arena is "
                         f"in host memory); pick its execution providers with --ort-providers")
    return args.device


def _scheduler_config(args, cmd: str, device: str, manifest: dict | None):
    """The scheduler's settings: each flag given, else the built engine's recorded limit
    (`runtime.scheduler.engine_limits`), else the device's (`SchedulerConfig.for_device`). A compiled
    engine runs only steps within the limits it was built for, so a flag beyond one is refused here
    rather than failing every step that crosses it. The token budget is at least the chunk (raised to
    it), and a chunk left to its default is at most a --max-batched-tokens given."""
    import dataclasses

    from g4rt.runtime.scheduler import LIMIT_FIELDS, SchedulerConfig, engine_limits

    limits = engine_limits(manifest) if manifest else {}
    limit_key = {field: key for key, field in LIMIT_FIELDS.items()}
    flags = {"chunk": ("--chunk", args.chunk),
             "max_num_batched_tokens": ("--max-batched-tokens", args.max_batched_tokens),
             "max_num_seqs": ("--max-num-seqs", args.max_num_seqs),
             "max_model_len": ("--max-model-len", args.max_model_len)}
    for field, (flag, value) in flags.items():
        if value is not None and field in limits and value > limits[field]:
            key = limit_key[field]
            raise SystemExit(f"{cmd}: {flag} {value} exceeds what the engine in {args.engine} was built for "
                             f"({key} {limits[field]}); pass at most {limits[field]}, or rebuild the engine with "
                             f"--{key.replace('_', '-')} {value}")
    try:
        base = SchedulerConfig.for_device(device, **limits)
        tokens = args.max_batched_tokens
        chunk = args.chunk or (base.chunk if tokens is None else min(base.chunk, tokens))
        return dataclasses.replace(base, chunk=chunk,
                                   max_num_batched_tokens=max(chunk, tokens or base.max_num_batched_tokens),
                                   max_num_seqs=args.max_num_seqs or base.max_num_seqs,
                                   max_model_len=args.max_model_len or base.max_model_len)
    except ValueError as e:
        raise SystemExit(f"{cmd}: {e}") from None


def _open_parallel_llm(args, cmd: str, source: Path, frames_for, config, kernels, device: str):
    """--tensor-parallel N > 1: one process per rank (runtime/engines/parallel.py) over cuda:K..K+N-1 (from
    --device cuda:K; on CPU over gloo), on --model or on the weights of an inductor --engine directory
    (compiled per rank, decode replayed as CUDA graphs, every rank compiling into the directory's cache).
    The ranks stop when the command ends."""
    import atexit
    import dataclasses

    from g4rt.models import manifest as mf
    from g4rt.models.parallel import ParallelError
    from g4rt.runtime.engines.parallel import ParallelEngine, RankSpec
    from g4rt.runtime.llm import LLM

    if getattr(args, "reference", False):
        raise SystemExit(f"{cmd}: --reference runs on one device; drop --tensor-parallel")
    try:
        kw = dict(model=str(source), dtype=args.dtype, page_tokens=args.page_tokens)
        if args.engine:
            from g4rt.runtime.engines.inductor import use_compile_cache

            # Only inductor engines run per rank; the check also refuses a directory this code cannot run.
            manifest = mf.check_manifest(args.engine, backend="inductor")
            if mf.manifest_kv_dtype(manifest) != manifest["dtype"]:
                raise SystemExit(f"{cmd}: --tensor-parallel: the engine in {args.engine} has a "
                                 f"{mf.manifest_kv_dtype(manifest)} arena; tensor-parallel ranks keep KV in the "
                                 f"weights' dtype ({manifest['dtype']}); run it on one device")
            kw = dict(model=str(mf.resolve_file(args.engine, manifest, "weights")), dtype=manifest["dtype"],
                      page_tokens=manifest["geometry"]["page_tokens_arg"], backend="inductor",
                      compile_mode=manifest["compile"]["mode"], compile_scope=manifest["compile"].get("scope", "layers"))
            use_compile_cache(args.engine, manifest)  # before the ranks start: they inherit the environment
        spec = RankSpec(tensor_parallel=args.tensor_parallel, num_frames=1, device=device, kernels=kernels, **kw)
        spec = dataclasses.replace(spec, num_frames=frames_for(spec.geometry(), config, device))
        engine = ParallelEngine(spec)
    except (ParallelError, ConfigError, mf.ManifestError, OSError, RuntimeError, ValueError) as e:
        raise SystemExit(f"{cmd}: --tensor-parallel {args.tensor_parallel}: {e}")
    atexit.register(engine.close)
    return (LLM(engine, spec.num_frames, config, eos_ids=engine.config.eos_token_ids, kernels=kernels),
            f"{spec.backend} over {spec.tensor_parallel} ranks")


def _generation_defaults(args, cmd: str, source: Path) -> GenerationDefaults:
    """--generation-config auto: the directory's generation_config.json, read once a command; a bad value stops
    the command naming the flag, the file and the key (for `serve`, before the engine process starts)."""
    if args.generation_config == "none":
        return GenerationDefaults()
    try:
        return GenerationDefaults.from_dir(source)
    except ValueError as e:
        raise SystemExit(f"{cmd}: --generation-config auto: {e}")


def _open_llm(args, cmd: str, source: Path, frames_for, eos_ids=()):
    """`_build_llm`'s LLM, which also ends a sequence at `eos_ids` (generation_config.json's) beside
    config.json's, as HF's generate and vLLM do."""
    llm, name = _build_llm(args, cmd, source, frames_for)
    llm.eos_ids = tuple(dict.fromkeys(llm.eos_ids + tuple(eos_ids)))
    return llm, name


def _build_llm(args, cmd: str, source: Path, frames_for):
    """The LLM that `generate` and `serve` run: a built engine (--engine) or the eager paged engine
    (or, with --reference, the linear cache) on --model. `frames_for(geometry, config, device)` sizes
    the arena; a built engine's recorded max_frames caps it."""
    from g4rt.models import manifest as mf
    from g4rt.models.checkpoint import CheckpointError, load_model
    from g4rt.runtime.engines import open_engine
    from g4rt.runtime.llm import LLM

    try:
        kernels = None if args.kernels is None else check_kernels(args.kernels, "--kernels")
    except ValueError as e:
        raise SystemExit(f"{cmd}: {e}")
    if args.kv_dtype and (args.engine or args.tensor_parallel > 1):
        why = ("a built engine's arena has the dtype it was built with (g4rt build --kv-dtype)" if args.engine
               else "drop --tensor-parallel")
        raise SystemExit(f"{cmd}: --kv-dtype applies to --model on one device; {why}")
    manifest = None
    if args.engine:
        try:
            manifest = mf.read_manifest(args.engine)
        except (mf.ManifestError, OSError) as e:
            raise SystemExit(f"{cmd}: --engine: {e}")
    backend = manifest.get("backend") if manifest else None
    if kernels and backend not in (None, "inductor"):
        raise SystemExit(f"{cmd}: --kernels applies to --model and inductor engines; a {backend} engine has its "
                         f"kernels built in")
    if args.ort_providers and backend != "onnxruntime":
        raise SystemExit(f"{cmd}: --ort-providers applies to onnxruntime engines, not to "
                         f"{f'a {backend} engine' if backend else '--model'}")
    device = _run_device(args, cmd, manifest)
    config = _scheduler_config(args, cmd, device, manifest)
    if args.tensor_parallel > 1:
        return _open_parallel_llm(args, cmd, source, frames_for, config, kernels, device)
    if args.engine:
        kw = {"device": device} if backend in ("inductor", "tensorrt") else {}
        if kernels:
            kw["kernels"] = kernels
        if args.ort_providers:
            kw["providers"] = args.ort_providers
        try:
            frames = frames_for(mf.manifest_geometry(manifest), config, device)
            most = (manifest.get("limits") or {}).get("max_frames")
            if most is not None:
                if args.num_frames and args.num_frames > most:
                    raise SystemExit(f"{cmd}: --num-frames {args.num_frames} exceeds what the engine in {args.engine} "
                                     f"was built for (max_frames {most}); pass at most {most}, or rebuild the engine "
                                     f"with --max-frames {args.num_frames}")
                frames = min(frames, most)
            # Each engine that needs an extra (onnxruntime, tensorrt) says which when it is missing.
            engine = open_engine(args.engine, frames, **kw)
        except (mf.ManifestError, OSError, RuntimeError, ValueError) as e:
            raise SystemExit(f"{cmd}: --engine: {e}")
        return (LLM(engine, frames, config, eos_ids=engine.config.eos_token_ids, kernels=kernels),
                f"{backend} engine")
    try:
        model = load_model(source, dtype=args.dtype, device=device, kernels=kernels, kv_dtype=args.kv_dtype)
    except (CheckpointError, ConfigError, ValueError) as e:
        raise SystemExit(f"{cmd}: --model: {e}")
    frames = frames_for(PageGeometry.build(model.layout, args.page_tokens), config, device)
    kw = dict(num_frames=frames, page_tokens=args.page_tokens, config=config, kernels=kernels)
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
    d = _generation_defaults(args, "generate", source)
    max_new = d.pick("max_new_tokens", args.max_new_tokens, 16)
    # as HF's generate: greedy unless the file's do_sample is true, then at its temperature (else 1)
    default_temperature = d.pick("temperature", None, 1.0) if d.do_sample else 0.0
    try:
        params = [SamplingParams(max_new_tokens=max_new,
                                 temperature=default_temperature if args.temperature is None else args.temperature,
                                 top_k=d.pick("top_k", args.top_k, 0), top_p=d.pick("top_p", args.top_p, 1.0),
                                 seed=None if args.seed is None else args.seed + i)
                  for i in range(len(prompts))]
    except ValueError as e:
        raise SystemExit(f"generate: {e}")

    def frames_for(geometry, config, device) -> int:  # default: every request at once (their promises summed)
        return args.num_frames or sum(promise_for(geometry, len(p), max_new, config.chunk).frames for p in prompts)

    llm, engine_name = _open_llm(args, "generate", source, frames_for, d.eos_token_ids)
    frames = llm.pool.num_frames
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, params)
    except (RequestTooLarge, ValueError) as e:
        raise SystemExit(f"generate: {e}")
    wall = time.perf_counter() - t0
    if hasattr(llm.engine, "close"):  # --tensor-parallel: stop the ranks now
        llm.engine.close()
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


def _serve_frames(args, geometry: PageGeometry, device: str) -> int:
    """KV frames for `serve`: --num-frames, else --kv-memory-gib, else on a CUDA `device` (the one the engine
    runs on) --gpu-memory-utilization of it (less what is in use, and less the weights when they are not
    loaded yet: the --engine path sizes its arena first), else 1 GiB."""
    import torch

    from g4rt.runtime.arena import frames_in_budget
    if args.num_frames:
        return args.num_frames
    if args.kv_memory_gib is not None:
        budget = int(args.kv_memory_gib * GIB)
    elif torch.cuda.is_available() and torch.device(device).type == "cuda":
        free, total = torch.cuda.mem_get_info(torch.device(device))
        weights = 0
        if torch.cuda.memory_allocated() == 0:
            cfg = geometry.layout.config
            weights = make_plan("serve", cfg, context=1, dtype=geometry.layout.dtype).weight_bytes
        budget = int(args.gpu_memory_utilization * total) - (total - free) - weights
    else:
        budget = GIB
    frames = frames_in_budget(max(0, budget), geometry.frame_bytes())
    if frames < 1:
        raise SystemExit(f"serve: a KV budget of {budget} bytes holds no frame of {geometry.frame_bytes()} bytes; "
                         f"raise --kv-memory-gib or --gpu-memory-utilization")
    return frames


def cmd_serve(args) -> int:
    """The OpenAI-compatible service (runtime/server.py); the key may come from G4RT_API_KEY, as is usual
    for secrets, so that it does not show in the process list."""
    import functools
    import logging
    import os
    _need("serve", "serve", "fastapi", "uvicorn", "prometheus_client", "jinja2")
    from g4rt.runtime.server import Server
    from g4rt.runtime.service.app import Service, ServiceConfig
    from g4rt.runtime.service.client import EngineStartError
    from g4rt.runtime.service.wire import EngineSpec

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    source = _source(args, "serve")
    try:
        config = ServiceConfig(served_model_name=args.served_model_name or source.resolve().name,
                               max_queue=args.max_queue, api_key=args.api_key or os.environ.get("G4RT_API_KEY"),
                               allowed_origins=tuple(args.allowed_origins or ()), max_body_bytes=args.max_body_bytes,
                               read_timeout_s=args.read_timeout)
    except ValueError as e:
        raise SystemExit(f"serve: {e}")
    d = _generation_defaults(args, "serve", source)
    try:  # the LLM is built in the engine process (runtime/service/wire.py says why)
        service = Service.from_dir(EngineSpec(functools.partial(_serve_llm, args, source, d.eos_token_ids)), source,
                                   config, d)
    except EngineStartError as e:
        raise SystemExit(str(e))
    try:
        server = Server(service, args.host, args.port, backlog=args.backlog, shutdown_timeout_s=args.shutdown_timeout,
                        access_log=not args.no_access_log)
    except (OSError, ValueError) as e:
        service.close()
        raise SystemExit(f"serve: {e}")
    info = service.engine.info
    length = f"up to {d.max_new_tokens} tokens" if d.max_new_tokens else "the API's max_tokens"
    print(f"g4rt serve: {info['engine']} as '{config.served_model_name}' on {server.url} ({info['num_frames']} KV "
          f"frames, max_num_seqs {info['max_num_seqs']}, max_model_len {service.ctx.max_model_len}; a request "
          f"that leaves them out samples at temperature {d.pick('temperature', None, 1.0)}, top_k "
          f"{d.pick('top_k', None, 0)}, top_p {d.pick('top_p', None, 1.0)}, {length}); "
          f"warming up, GET /ready answers 200 when done; SIGTERM or Ctrl-C drains", flush=True)
    return server.run()


def _serve_llm(args, source: Path, eos_ids):
    """`serve`'s LLM, built in the engine process (a module-level function: it is pickled to get there)."""
    return _open_llm(args, "serve", source, lambda geometry, config, device: _serve_frames(args, geometry, device),
                     eos_ids)[0]


def cmd_bench_serve(args) -> int:
    """bench/ is this module's peer (neither imports the other), so its module is loaded by name, and
    parses its own arguments (`g4rt bench serve --help` lists them)."""
    import importlib
    return importlib.import_module("g4rt.bench.serve").main(args.args)


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
                               page_tokens=args.page_tokens, dtype=args.dtype, kv_dtype=args.kv_dtype,
                               memory_bytes=memory))
    if args.json:
        print(json.dumps([p.as_dict() for p in plans], indent=1))
    else:
        print("\n\n".join(format_plan(p) for p in plans))
    return 0


def _engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by `generate` and `serve`: what runs and how the KV pool and steps are sized. The
    scheduler's flags default to a built engine's limits, else to the device's settings
    (SchedulerConfig.for_device), which the help shows."""
    from g4rt.runtime.scheduler import SchedulerConfig
    cuda, other = SchedulerConfig.for_device("cuda"), SchedulerConfig.for_device("cpu")

    def default(field: str) -> str:
        return (f"default: a built engine's limit, else the device's: {getattr(cuda, field)} on CUDA, "
                f"{getattr(other, field)} elsewhere")

    p.add_argument("--model", help="model directory (config.json + safetensors) or 'tiny': the eager engine")
    p.add_argument("--engine", help="an engine directory from `g4rt build` (its manifest names the backend)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="weights and KV dtype (--model)")
    p.add_argument("--kv-dtype", choices=list(KV_DTYPES), default=None,
                   help="the KV arena's dtype when it differs from --dtype (--model on one device): float8_e4m3fn "
                        "halves the bytes a decode step reads and doubles the positions a GiB holds, K and V "
                        "rounded to e4m3 without a scale")
    p.add_argument("--device", default=None,
                   help="cpu or cuda[:N] (default: cuda for inductor and tensorrt engines, else cpu); the KV budget "
                        "is measured on it")
    p.add_argument("--kernels", default=None, metavar="|".join(KERNELS),
                   help="implementation of the plugin ops, the model's fused blocks and the sampler: triton or the "
                        "torch reference (default: triton on CUDA, reference on CPU)")
    p.add_argument("--ort-providers", nargs="+", default=None, metavar="PROVIDER",
                   help="onnxruntime engines: execution providers (default: the manifest's, else CUDA when "
                        "available, then CPU)")
    p.add_argument("--page-tokens", type=_positive("--page-tokens"), default=PAGE_TOKENS,
                   help="positions per sliding-group page")
    p.add_argument("--chunk", type=_positive("--chunk"), default=None,
                   help=f"prefill chunk: the most tokens one request computes in a step, a capacity parameter "
                        f"(every request is promised sliding pages for it); at most --max-batched-tokens when that "
                        f"is given ({default('chunk')})")
    p.add_argument("--max-batched-tokens", "--max-num-batched-tokens", type=_positive("--max-batched-tokens"),
                   default=None, help=f"token budget of one step, raised to --chunk when smaller "
                                      f"({default('max_num_batched_tokens')})")
    p.add_argument("--max-num-seqs", type=_positive("--max-num-seqs"), default=None,
                   help=f"requests in the running batch at most ({default('max_num_seqs')})")
    p.add_argument("--max-model-len", type=_positive("--max-model-len"), default=None,
                   help="prompt + output tokens per request at most (default: a built engine's limit, else the "
                        "model's max_position_embeddings)")
    p.add_argument("--num-frames", type=_positive("--num-frames"), default=None,
                   help="KV arena frames (generate: default every prompt at once; serve: see --kv-memory-gib; "
                        "at most a built engine's max_frames, which also caps the default)")
    p.add_argument("--tensor-parallel", type=int, choices=TP_SIZES, default=1, metavar="N",
                   help="one model over N devices of this host, one process per rank (NCCL on cuda:K..K+N-1 from "
                        "--device cuda:K, gloo on CPU); KV frames are per rank. 1 (default): one device, no extra "
                        "process")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="g4rt")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate tokens from one or more prompts",
                       description="Generate with continuous batching over the paged KV arena "
                                   "(or the linear reference cache with --reference).")
    _engine_args(g)
    g.add_argument("--token-ids", type=_token_ids, action="append",
                   help="a prompt as comma-separated token ids, e.g. 2,15,7 (repeat for several prompts)")
    g.add_argument("--prompt", action="append", help="a prompt as text (needs tokenizer.json; repeatable)")
    g.add_argument("--max-new-tokens", type=_positive("--max-new-tokens"), default=None,
                   help="tokens to generate at most (default: the model's, else 16)")
    g.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the model's when its generation_config.json samples, else 0)")
    g.add_argument("--top-k", type=int, default=None,
                   help="keep the k most likely tokens, 0 = off (default: the model's, else 0)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus mass to keep, 1 = off (default: the model's, "
                                                            "else 1)")
    g.add_argument("--generation-config", choices=["auto", "none"], default="auto",
                   help="'auto': the settings above that are not given come from the model or engine directory's "
                        "generation_config.json where it sets them (sampling only when its do_sample is true, as "
                        "HF's generate), and its eos_token_id ends a sequence beside config.json's; 'none': "
                        "greedy, 16 tokens, config.json's end ids")
    g.add_argument("--seed", type=int, default=None, help="sampling seed; prompt i uses seed + i")
    g.add_argument("--reference", action="store_true", help="use the linear reference cache instead of pages")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate)

    v = sub.add_parser("serve", help="the OpenAI-compatible HTTP service (needs the serve extra)",
                       description="OpenAI's API as `vllm serve` exposes it, on uvicorn: POST /v1/completions, "
                                   "/v1/chat/completions (the checkpoint's chat template), /tokenize, /detokenize; "
                                   "GET /v1/models, /health (alive), /ready (503 until warm-up is done), /metrics "
                                   "(Prometheus). Streams as Server-Sent Events. Binds 127.0.0.1 unless --host says "
                                   "otherwise; /v1/* needs 'Authorization: Bearer KEY' when --api-key (or "
                                   "G4RT_API_KEY) is set. The engine (the LLM, its warm-up and steps) runs in a "
                                   "process of its own, so HTTP, JSON and (de)tokenizing never slow a step; it stops "
                                   "with the server, and the server stops (exit 1) if it dies.")
    _engine_args(v)
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    v.add_argument("--served-model-name", default=None, help="the `model` clients name (default: the directory's)")
    v.add_argument("--kv-memory-gib", type=_positive("--kv-memory-gib", float), default=None,
                   help="KV arena size (default: --gpu-memory-utilization on CUDA, 1 GiB on CPU)")
    v.add_argument("--gpu-memory-utilization", type=_positive("--gpu-memory-utilization", float), default=0.9,
                   help="fraction of the GPU's memory for weights + KV (the rest: activations, graphs)")
    v.add_argument("--max-queue", type=_positive("--max-queue"), default=1024,
                   help="requests waiting for admission beyond which new ones get 429 with Retry-After")
    v.add_argument("--api-key", default=None, help="require this Bearer key on /v1/* (or set G4RT_API_KEY)")
    v.add_argument("--allowed-origins", nargs="*", default=None, help="CORS origins (default: CORS off)")
    v.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM/SIGINT before they are ended")
    v.add_argument("--max-body-bytes", type=_positive("--max-body-bytes"), default=1 << 20,
                   help="request bodies beyond this get 413 before they are read")
    v.add_argument("--read-timeout", type=_positive("--read-timeout", float), default=30.0,
                   help="seconds a client has to send its request body")
    v.add_argument("--generation-config", choices=["auto", "none"], default="auto",
                   help="where the sampling settings a request leaves out come from: 'auto' the model directory's "
                        "generation_config.json (temperature, top_k, top_p, max_new_tokens as max_tokens; its "
                        "eos_token_id ends a sequence beside config.json's; as vLLM), 'none' the OpenAI API's "
                        "(temperature 1, top_p 1, no top-k; max_tokens 16 for completions, the rest of "
                        "max_model_len for chat)")
    v.add_argument("--backlog", type=int, default=4096, help="listen backlog (>= 2048, for bursts of connections)")
    v.add_argument("--no-access-log", action="store_true", help="do not log one line per request")
    v.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks against a running service").add_subparsers(
        dest="bench", required=True, metavar="BENCH")
    bs = bench.add_parser("serve", help="load generator for `g4rt serve` (like vLLM's benchmark_serving): "
                                        "concurrency and Poisson sweeps, TTFT/ITL/TPOT/E2E percentiles, JSON",
                          add_help=False, prefix_chars="\0")  # every argument goes to bench/serve.py
    bs.add_argument("args", nargs=argparse.REMAINDER)
    bs.set_defaults(func=cmd_bench_serve)

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
    p.add_argument("--page-tokens", type=_positive("--page-tokens"), default=PAGE_TOKENS)
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="weights and KV dtype (default: the config's)")
    p.add_argument("--kv-dtype", choices=list(KV_DTYPES), default=None,
                   help="the KV dtype when it differs from --dtype (float8_e4m3fn: one byte an element)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    _export_commands(sub)
    parser.description = (f"g4rt: Gemma 4 text inference. Commands: {', '.join(sub.choices)}. "
                          f"`g4rt COMMAND --help` explains each.")
    return parser


# ---- export / build: write engine directories (the export package) ------------------------------

def _export_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory (config.json + safetensors) or 'tiny'")
    p.add_argument("--out", required=True, help="engine directory to write")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="weights/arena dtype (default: float32 for onnxruntime, else bfloat16)")
    p.add_argument("--page-tokens", type=_positive("--page-tokens"), default=PAGE_TOKENS,
                   help="sliding-group page size (runtime's default)")


def cmd_export(args) -> int:
    _need("export", "export", "onnx", "onnxscript", "polygraphy")
    from g4rt.export.build import BuildError, export_onnx
    from g4rt.models.manifest import ManifestError
    try:
        m = export_onnx(args.model, args.out, dtype=args.dtype or "float32", page_tokens=args.page_tokens)
    except (BuildError, ManifestError) as e:
        raise SystemExit(f"export: {e}")
    print(json.dumps({"out": args.out, "backend": m["backend"], "dtype": m["dtype"],
                      "config_hash": m["model"]["config_hash"]}))
    return 0


def cmd_build(args) -> int:
    from g4rt.export.build import BuildError, build, check_backend_available
    from g4rt.models.manifest import ManifestError
    limits = providers = None
    try:
        check_backend_available(args.backend)
        if args.backend == "tensorrt":
            limits = _step_limits(args, "build", args.dtype or "bfloat16")
        if args.backend == "onnxruntime":
            from g4rt.runtime.engines.onnxruntime import default_providers
            providers = args.ort_providers or default_providers()
        out = build(args.model, args.backend, args.out, dtype=args.dtype, page_tokens=args.page_tokens,
                    progress=not args.quiet, limits=limits, providers=providers, kv_dtype=args.kv_dtype)
    except (BuildError, ManifestError, RuntimeError) as e:
        raise SystemExit(f"build: {e}")
    named = f" (execution providers: {', '.join(providers)})" if providers else ""
    print(f"built {args.backend} engine in {out}{named}")
    return 0


def _export_commands(sub) -> None:
    e = sub.add_parser(
        "export", help="export the step graph to ONNX (model.onnx + data + manifest)",
        description="Export one runtime step (arena + StepBatch in, logits + arena out) as ONNX. The plugin "
                    "ops are single nodes G4KVWrite / G4PagedAttention / G4MoE in domain 'gemma4' (what "
                    "TensorRT's parser hands to registered plugins), each with a reference ONNX function so ONNX "
                    "Runtime on CPU runs the graph. Weights go to model.onnx.data. Needs the export extra.")
    _export_common(e)
    e.set_defaults(func=cmd_export)
    b = sub.add_parser(
        "build", help="build an engine directory for one backend",
        description="Build an engine directory that `g4rt generate --engine DIR` runs. Backends: onnxruntime "
                    "(CPU; the export plus ORT's offline-optimised graph; export extra), inductor (CUDA GPU; "
                    "torch.compile of the step over the same Triton kernels, decode replayed as CUDA graphs; the "
                    "weights are linked or copied into the directory and compiled at load, cache in the directory), "
                    "tensorrt (needs TensorRT >= 10.9 with tensorrt.plugin; untested here, where TensorRT cannot "
                    "be installed). Each directory has a manifest.json the runtime checks on load; every path in "
                    "it is relative, so the directory can be moved.")
    _export_common(b)
    b.add_argument("--backend", choices=list(BACKENDS), required=True)
    b.add_argument("--kv-dtype", choices=list(KV_DTYPES), default=None,
                   help="inductor: the KV arena's dtype when it differs from --dtype (float8_e4m3fn: half the bytes "
                        "a position costs, twice the positions a GiB holds)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--ort-providers", nargs="+", default=None, metavar="PROVIDER",
                   help="onnxruntime: execution providers recorded in the manifest (default: CUDAExecutionProvider "
                        "then CPU when onnxruntime-gpu is installed, else CPUExecutionProvider)")
    _limits_args(b.add_argument_group("tensorrt: the optimization profile (the scheduler limits the engine serves)"))
    b.set_defaults(func=cmd_build)
    _trt_commands(sub)


# ---- TensorRT readiness: limits for compiled engines, `g4rt check`, `g4rt trt-engine` -------------

TRT_ARENA_GIB = 64.0  # default arena bound of a build: what an H200 keeps for KV next to the 31B's bf16 weights


def _limits_args(p) -> None:
    """The scheduler limits a compiled engine is built for (its TensorRT optimization profile)."""
    from g4rt.runtime.scheduler import SchedulerConfig
    d = SchedulerConfig()
    p.add_argument("--max-batched-tokens", "--max-num-batched-tokens", type=_positive("--max-batched-tokens"),
                   default=d.max_num_batched_tokens,
                   help="tokens of one step at most (the scheduler's max_num_batched_tokens)")
    p.add_argument("--chunk", type=_positive("--chunk"), default=d.chunk,
                   help="prefill chunk of one request at most (bounds the sliding page table)")
    p.add_argument("--max-seqs", "--max-num-seqs", type=_positive("--max-seqs"), default=d.max_num_seqs,
                   help="sequences of one step at most (the scheduler's max_num_seqs; generate and serve take the "
                        "same flag)")
    p.add_argument("--max-frames", type=_positive("--max-frames"), default=None,
                   help=f"KV arena frames at most (default: what {TRT_ARENA_GIB:g} GiB holds)")
    p.add_argument("--max-model-len", type=_positive("--max-model-len"), default=None,
                   help="positions of one request at most (default: the model's max_position_embeddings)")


def _step_limits(args, cmd: str, dtype: str):
    """StepLimits from the flags; the defaults that depend on the model come from its config."""
    from g4rt.models.layout import KVLayout
    from g4rt.models.profiles import StepLimits
    from g4rt.runtime.arena import frames_in_budget
    cfg = load_config(_model_dir(args.model))
    geometry = PageGeometry.build(KVLayout.from_config(cfg, dtype), args.page_tokens)
    try:
        return StepLimits(max_batched_tokens=args.max_batched_tokens, chunk=args.chunk, max_seqs=args.max_seqs,
                          max_frames=args.max_frames or max(1, frames_in_budget(int(TRT_ARENA_GIB * GIB),
                                                                                geometry.frame_bytes())),
                          max_model_len=args.max_model_len or cfg.max_position_embeddings)
    except ValueError as e:
        raise SystemExit(f"{cmd}: {e}")


def _tolerance(text: str) -> tuple[str, float]:
    name, _, value = text.partition("=")
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--atol: expected OUTPUT=VALUE (e.g. logits=1e-3), got {text!r}") from None


def check_engine(engine_dir: str | Path, *, atol: dict | None = None, providers: list[str] | None = None) -> dict:
    """The polygraphy comparison of an engine directory against its golden steps (export/goldens.py):
    ONNX Runtime engines through polygraphy's OnnxrtRunner, TensorRT plans through its TrtRunner."""
    from g4rt.export.goldens import compare, tolerances
    from g4rt.models import manifest as mf
    manifest = mf.read_manifest(engine_dir)
    backend = manifest.get("backend")
    if backend == "onnxruntime":
        from polygraphy.backend.onnxrt import OnnxrtRunner

        from g4rt.runtime.engines.onnxruntime import resolve_providers, session
        chosen = resolve_providers(manifest, providers)
        runner = OnnxrtRunner(lambda: session(engine_dir, manifest, chosen), name="onnxruntime")
        where = f"onnxruntime ({', '.join(chosen)})"
    elif backend == "tensorrt":
        from g4rt.runtime.engines.tensorrt import polygraphy_runner
        runner = polygraphy_runner(engine_dir, manifest)
        where = f"tensorrt {manifest.get('tensorrt_version', '?')}"
    else:
        raise ValueError(f"{engine_dir}: `check` compares onnxruntime and tensorrt engines; this one is {backend!r}")
    report = compare(manifest, engine_dir, runner, tolerances(manifest["dtype"], atol))
    return {**report, "engine": where, "dtype": manifest["dtype"]}


def _print_check(report: dict) -> None:
    print(f"{report['engine']} vs golden eager-torch steps ({report['dtype']}; max |error| per output)")
    for s in report["steps"]:
        for name, o in s["outputs"].items():
            verdict = "ok" if o["passed"] else "FAIL"
            print(f"  {s['step']:<8} {name:<10} {o['max_abs']:.3e}  (atol {report['tolerances'][name]:.1e})  {verdict}")
    print("PASSED" if report["passed"] else "FAILED")


def cmd_check(args) -> int:
    _need("check", "export", "onnx", "polygraphy")
    from g4rt.export.goldens import GoldenError
    from g4rt.models.manifest import ManifestError
    from g4rt.plugins.trt_plugins import TensorRTUnavailable
    try:
        report = check_engine(args.engine_dir, atol=dict(args.atol or []), providers=args.ort_providers)
    except (GoldenError, ManifestError, TensorRTUnavailable, RuntimeError, ValueError, OSError) as e:
        raise SystemExit(f"check: {e}")
    if args.json:
        print(json.dumps(report))
    else:
        _print_check(report)
    return 0 if report["passed"] else 1


def generation_parity(engine_dir: str | Path, model_dir: str | Path, prompts: list[list[int]], new_tokens: int,
                      device: str = "cpu") -> dict:
    """Greedy tokens of the built engine against the eager paged engine on the same checkpoint, in the
    engine's dtypes (weights and arena), under the same scheduler: {"equal", "engine", "eager", "first_difference"}."""
    from g4rt.models import manifest as mf
    from g4rt.models.checkpoint import load_model
    from g4rt.runtime.engines import open_engine
    from g4rt.runtime.llm import LLM
    from g4rt.runtime.scheduler import SchedulerConfig, engine_limits

    manifest = mf.read_manifest(engine_dir)
    geometry = mf.manifest_geometry(manifest)
    config = SchedulerConfig(**engine_limits(manifest))  # the build's limits; else the scheduler's defaults
    frames = sum(promise_for(geometry, len(p), new_tokens, config.chunk).frames for p in prompts)
    engine = open_engine(engine_dir, frames)
    got = [o.token_ids for o in LLM(engine, frames, config, eos_ids=()).generate(
        prompts, SamplingParams(max_new_tokens=new_tokens))]
    del engine
    model = load_model(model_dir, dtype=manifest["dtype"], device=device, kv_dtype=mf.manifest_kv_dtype(manifest))
    want = [o.token_ids for o in LLM.paged(model, num_frames=frames, page_tokens=manifest["geometry"]["page_tokens_arg"],
                                           config=config).generate(prompts, SamplingParams(max_new_tokens=new_tokens))]
    first = next(((i, j) for i, (a, b) in enumerate(zip(got, want)) for j, (x, y) in enumerate(zip(a, b)) if x != y),
                 None)
    return {"equal": got == want, "engine": got, "eager": want, "first_difference": first}


def cmd_trt_engine(args) -> int:
    """Prerequisites, export + build + inspection, polygraphy check, short generation against eager."""
    from g4rt.plugins.trt_plugins import prerequisites
    missing = prerequisites()
    if missing:
        raise SystemExit("trt-engine: this machine cannot build a TensorRT engine (nothing was written):\n"
                         + "\n".join(f"  - {m}" for m in missing))
    from g4rt.export.build import BuildError, build
    from g4rt.export.trt import TrtBuildError
    from g4rt.models.manifest import ManifestError
    dtype = args.dtype or "bfloat16"
    print(f"[1/3] export, golden steps, TensorRT build and arena inspection -> {args.out}", flush=True)
    try:
        build(args.model, "tensorrt", args.out, dtype=dtype, page_tokens=args.page_tokens,
              limits=_step_limits(args, "trt-engine", dtype))
    except (BuildError, ManifestError, TrtBuildError) as e:
        raise SystemExit(f"trt-engine: {e}")
    print("[2/3] polygraphy check against the golden steps", flush=True)
    report = check_engine(args.out)
    _print_check(report)
    if not report["passed"]:
        raise SystemExit("trt-engine: the engine does not match the golden steps")
    print(f"[3/3] greedy generation, {args.new_tokens} tokens: TensorRT vs the eager engine", flush=True)
    parity = generation_parity(args.out, _model_dir(args.model), [[2, 15, 7, 42, 9, 3, 11, 5], [2, 99, 4]],
                               args.new_tokens, device="cuda")
    print(json.dumps(parity))
    if not parity["equal"]:
        raise SystemExit(f"trt-engine: tokens differ from the eager engine at (prompt, position) "
                         f"{parity['first_difference']}")
    print(f"trt-engine: {args.out} is built, checked and generates the eager engine's tokens")
    return 0


def _trt_commands(sub) -> None:
    c = sub.add_parser(
        "check", help="compare an engine with its golden steps (polygraphy)",
        description="Run the engine directory's golden steps (golden/inputs.json, written by export from the eager "
                    "torch step on the same weights) through polygraphy: ONNX Runtime engines with OnnxrtRunner, "
                    "TensorRT plans with TrtRunner (plugins registered); report the max absolute error of each "
                    "output of each step against per-dtype tolerances. Exit 1 if any exceeds. Needs the export extra.")
    c.add_argument("engine_dir")
    c.add_argument("--atol", type=_tolerance, action="append", metavar="OUTPUT=VALUE",
                   help="override one output's tolerance, e.g. logits=5e-3 (repeatable)")
    c.add_argument("--ort-providers", nargs="+", default=None, metavar="PROVIDER",
                   help="ONNX Runtime execution providers (default: the manifest's, else CUDA when available, CPU)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_check)
    t = sub.add_parser(
        "trt-engine", help="build a TensorRT engine and prove it (what `make trt-engine` runs)",
        description="On a machine with TensorRT >= 10.9 and a GPU: check the prerequisites (and say exactly what is "
                    "missing), export with golden steps, build the plan with progress, fail if it copies the KV "
                    "arena, run the polygraphy check, and compare a short greedy generation with the eager engine.")
    _export_common(t)
    _limits_args(t.add_argument_group("the optimization profile (the scheduler limits the engine serves)"))
    t.add_argument("--new-tokens", type=_positive("--new-tokens"), default=8)
    t.set_defaults(func=cmd_trt_engine)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
