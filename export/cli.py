"""`g4rt export` and `g4rt build` (`g4rt generate --engine DIR` opens engines through build.load_engine).

runtime/cli.py calls `add_subcommands(subparsers)`; each subcommand sets `func(args) -> int`.
"""
from __future__ import annotations

import argparse
import json

from .build import DTYPES, BuildError, build, export_onnx
from .manifest import BACKENDS, ManifestError


def _positive(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return v


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory (config.json + safetensors) or 'tiny'")
    p.add_argument("--out", required=True, help="engine directory to write")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="weights/arena dtype (default: float32 for onnxruntime, else bfloat16)")
    p.add_argument("--page-tokens", type=_positive, default=16, help="sliding-group page size (runtime's default)")


def cmd_export(args) -> int:
    try:
        m = export_onnx(args.model, args.out, dtype=args.dtype or "float32", page_tokens=args.page_tokens)
    except (BuildError, ManifestError) as e:
        raise SystemExit(f"export: {e}")
    print(json.dumps({"out": args.out, "backend": m["backend"], "dtype": m["dtype"],
                      "config_hash": m["model"]["config_hash"]}))
    return 0


def cmd_build(args) -> int:
    try:
        out = build(args.model, args.backend, args.out, dtype=args.dtype, page_tokens=args.page_tokens,
                    progress=not args.quiet)
    except (BuildError, ManifestError) as e:
        raise SystemExit(f"build: {e}")
    print(f"built {args.backend} engine in {out}")
    return 0


def add_subcommands(subparsers) -> None:
    e = subparsers.add_parser(
        "export", help="export the step graph to ONNX (model.onnx + data + manifest)",
        description="Export one runtime step (arena + StepBatch in, logits + arena out) as ONNX. The two plugin "
                    "ops are single nodes G4KVWrite / G4PagedAttention in domain 'gemma4' (what TensorRT's parser "
                    "hands to registered plugins), each with a reference ONNX function so ONNX Runtime on CPU runs "
                    "the graph. Weights go to model.onnx.data.")
    _common(e)
    e.set_defaults(func=cmd_export)
    b = subparsers.add_parser(
        "build", help="build an engine directory for one backend",
        description="Build an engine directory that `g4rt generate --engine DIR` runs. Backends: onnxruntime "
                    "(CPU; the export plus ORT's offline-optimised graph), inductor (CUDA GPU; torch.compile of the "
                    "step over the same Triton kernels, decode replayed as CUDA graphs; compiles at load, cache in "
                    "the directory), tensorrt (needs TensorRT >= 10.9 with tensorrt.plugin; untested here, where "
                    "TensorRT cannot be installed). Each directory has a manifest.json the runtime checks on load.")
    _common(b)
    b.add_argument("--backend", choices=list(BACKENDS), required=True)
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_build)
