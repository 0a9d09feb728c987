"""`g4rt export` / `g4rt build`: turn a checkpoint into an engine directory for one backend.

Every engine directory holds a `manifest.json` (models/manifest.py) next to the backend's artifacts;
every path the manifest names is relative to the directory, so a directory can be moved or copied:

* onnxruntime: `model.onnx` + `model.onnx.data` (the step graph with reference functions) and
  `model.ort.onnx` (+ data), the graph ORT optimised offline, which the ORT engine loads first;
* inductor: the checkpoint's files under `weights/` (hard links where the filesystem allows, else
  copies) + compile settings; the engine compiles at load time with its compiler cache inside the
  directory (runtime/engines/inductor.py);
* tensorrt: the ONNX export plus `engine.plan` built with our plugins (trt.py).

The engines that run these directories are runtime/engines/; this package only writes them.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from g4rt.models import manifest as mf
from g4rt.models.checkpoint import checkpoint_files, load_model
from g4rt.models.config import load_config
from g4rt.models.layout import ALIGN, PAGE_TOKENS, KVLayout, PageGeometry, dtype_name, torch_dtype
from g4rt.models.paged import PagedStep
from g4rt.models.profiles import StepLimits, derive_profiles
from g4rt.models.tiny import resolve_model_dir as _resolve

ORT_OPTIMIZED_FILE = "model.ort.onnx"
WEIGHTS_DIR = "weights"
CACHE_DIR = "compile_cache"


class BuildError(RuntimeError):
    pass


def resolve_model_dir(spec: str | Path) -> Path:
    try:
        return _resolve(spec)
    except FileNotFoundError as e:
        raise BuildError(str(e)) from None


def _geometry(cfg, dtype: str, page_tokens: int) -> PageGeometry:
    return PageGeometry.build(KVLayout.from_config(cfg, dtype), page_tokens, ALIGN)


def _manifest(cfg, geometry, model_dir: Path, backend: str, dtype: str, page_tokens: int, **kw) -> dict:
    return mf.build_manifest(cfg, geometry, backend=backend, dtype=dtype, page_tokens=page_tokens,
                             align=ALIGN, name=model_dir.resolve().name, **kw)


def copy_tokenizer(model_dir: Path, out: Path) -> dict:
    """Copy the checkpoint's tokenizer.json, if any, so text prompts work with `--engine` alone (and its
    tokenizer_config.json / chat_template.jinja, where `g4rt serve` finds the chat template), and its
    generation_config.json (the sampling defaults `g4rt serve` applies); returns the manifest's `files`
    entry for the tokenizer."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out / name)
    return {"tokenizer": "tokenizer.json"} if (model_dir / "tokenizer.json").is_file() else {}


def export_onnx(model_spec: str | Path, out_dir: str | Path, *, dtype: str = "float32",
                page_tokens: int = PAGE_TOKENS, backend: str = "onnxruntime", bar: tqdm | None = None,
                limits: StepLimits | None = None) -> dict:
    """Load the checkpoint once, export PagedStep(functional=True) to `out_dir`, write the golden
    steps (export/goldens.py) and the manifest. `limits` (the scheduler limits the engine is built
    for) become the manifest's `profiles`, which a TensorRT build needs."""
    try:
        from .goldens import write_goldens
        from .onnx_export import DATA_FILE, MODEL_FILE, export_step
    except ImportError as e:
        raise BuildError(f"exporting ONNX needs the export extra (pip install 'g4rt[export]'): {e}") from None
    model_dir = resolve_model_dir(model_spec)
    out = Path(out_dir)
    # Export traces on CPU with the reference kernels: the plugin nodes do not depend on them.
    model = load_model(model_dir, dtype=torch_dtype(dtype), device="cpu", kernels="reference")
    cfg = model.config
    geometry = _geometry(cfg, dtype, page_tokens)
    _tick(bar, "export ONNX")
    step = PagedStep(model, geometry, functional=True)
    export_step(step, geometry, out, torch_dtype(dtype))
    _tick(bar, "golden steps (eager torch)")
    golden = write_goldens(step, geometry, out, torch_dtype(dtype))
    del model, step
    files = {"onnx": MODEL_FILE, "onnx_data": DATA_FILE, **copy_tokenizer(model_dir, out)}
    extra = {"golden": golden, **({"limits": asdict(limits)} if limits else {})}
    manifest = _manifest(cfg, geometry, model_dir, backend, dtype, page_tokens, files=files, extra=extra,
                         profiles=derive_profiles(limits, geometry) if limits else None)
    mf.write_manifest(out, manifest)
    return manifest


def optimize_for_ort(out_dir: str | Path) -> Path:
    """Let ORT run its graph optimisations once and save the result (inlined functions, fused ops),
    weights again as external data, so engine start-up skips that work."""
    import onnxruntime as ort

    from .onnx_export import MODEL_FILE
    out = Path(out_dir)
    so = ort.SessionOptions()
    so.log_severity_level = 3  # the reference functions trigger harmless shape-merge warnings
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED  # portable across CPUs
    so.optimized_model_filepath = str(out / ORT_OPTIMIZED_FILE)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                ORT_OPTIMIZED_FILE + ".data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(out / MODEL_FILE), so, providers=["CPUExecutionProvider"])
    return out / ORT_OPTIMIZED_FILE


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link `src` to `dst` (no second copy of the weights on one filesystem), else copy it."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def write_inductor_engine(model_dir: Path, out_dir: Path, *, dtype: str, page_tokens: int,
                          kv_dtype: str | None = None) -> dict:
    """The inductor engine directory: manifest, the checkpoint's files under weights/, an empty
    compile cache. Compilation happens when the engine is opened (runtime/engines/inductor.py). `kv_dtype`: the
    arena's (layout.KV_DTYPES; default `dtype`), recorded as the manifest's `kv_dtype`."""
    cfg = load_config(model_dir)
    kv_dtype = dtype_name(kv_dtype or dtype, kv=True)
    geometry = _geometry(cfg, kv_dtype, page_tokens)
    weights = out_dir / WEIGHTS_DIR
    weights.mkdir(parents=True, exist_ok=True)
    for src in [model_dir / "config.json", *sorted(set(checkpoint_files(model_dir).values()))]:
        _link_or_copy(src, weights / src.name)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        _link_or_copy(index, weights / index.name)
    manifest = _manifest(
        cfg, geometry, model_dir, "inductor", dtype, page_tokens,
        files={"weights": WEIGHTS_DIR, "compile_cache": CACHE_DIR, **copy_tokenizer(model_dir, out_dir)},
        extra={"kv_dtype": kv_dtype,
               "compile": {"mode": "default", "scope": "layers", "cuda_graphs": "decode buckets",
                           "batch_buckets": "powers of two up to the largest batch"}})
    (out_dir / CACHE_DIR).mkdir(parents=True, exist_ok=True)
    mf.write_manifest(out_dir, manifest)
    return manifest


def _tick(bar: tqdm | None, what: str) -> None:
    """Finish the previous stage (if any) and name the next one on the progress bar."""
    if bar is None or bar.disable:
        return
    if getattr(bar, "g4_started", False):
        bar.update(1)
    bar.g4_started = True
    bar.set_description_str(what)


def check_backend_available(backend: str) -> None:
    """Fail before any work when this machine cannot build `backend`, naming what is missing."""
    if backend not in mf.BACKENDS:
        raise BuildError(f"unknown backend {backend!r}; choose one of {', '.join(mf.BACKENDS)}")
    if backend == "inductor":
        if not torch.cuda.is_available():
            raise BuildError("backend inductor builds a CUDA-graph engine and needs a CUDA GPU; none is visible here")
        return
    # onnxruntime and tensorrt both export the step graph and write its golden steps.
    needed = ("onnx", "onnxscript", "polygraphy") + (("onnxruntime",) if backend == "onnxruntime" else ())
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        raise BuildError(f"backend {backend} needs {', '.join(missing)}, from the export extra "
                         f"(pip install 'g4rt[export]')")
    if backend == "tensorrt":
        from g4rt.plugins.trt_plugins import TensorRTUnavailable, require_tensorrt
        try:
            require_tensorrt()
        except TensorRTUnavailable as e:
            raise BuildError(str(e)) from None


def build(model_spec: str | Path, backend: str, out_dir: str | Path, *, dtype: str | None = None,
          page_tokens: int = PAGE_TOKENS, progress: bool = True, limits: StepLimits | None = None,
          providers: list[str] | None = None, kv_dtype: str | None = None) -> Path:
    """Build an engine directory for `backend` and return its path. tensorrt needs `limits` (its
    optimization profile); onnxruntime records `providers` (its execution providers) in the manifest; `kv_dtype`
    (inductor only: the ONNX graph's arena holds the weights' dtype) the arena's dtype."""
    if kv_dtype is not None and backend != "inductor":
        raise BuildError(f"kv_dtype {kv_dtype!r}: only inductor engines take an arena dtype of their own; a {backend} "
                         f"engine's arena holds the weights' dtype (--dtype)")
    check_backend_available(backend)
    if backend == "tensorrt" and limits is None:
        raise BuildError("a tensorrt build needs step limits (max batched tokens, chunk, sequences, frames, model "
                         "length) for its optimization profile")
    dtype = dtype or {"onnxruntime": "float32"}.get(backend, "bfloat16")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = {"onnxruntime": 4, "inductor": 1, "tensorrt": 4}[backend]
    with tqdm(total=steps, desc="", disable=not progress, unit="step") as bar:
        if backend == "inductor":
            _tick(bar, "write inductor engine")
            write_inductor_engine(resolve_model_dir(model_spec), out, dtype=dtype, page_tokens=page_tokens,
                                  kv_dtype=kv_dtype)
        else:
            manifest = export_onnx(model_spec, out, dtype=dtype, page_tokens=page_tokens, backend=backend, bar=bar,
                                   limits=limits)
            if backend == "onnxruntime":
                _tick(bar, "optimize for ONNX Runtime")
                optimize_for_ort(out)
                manifest["files"]["ort_optimized"] = ORT_OPTIMIZED_FILE
                if providers:
                    manifest["execution_providers"] = list(providers)
            else:
                from .trt import build_trt_engine
                _tick(bar, "build and inspect the TensorRT engine")
                manifest.update(build_trt_engine(out, progress=progress))
            mf.write_manifest(out, manifest)
        if not bar.disable:
            bar.update(bar.total - bar.n)
    return out
