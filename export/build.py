"""`g4rt export` / `g4rt build`: turn a checkpoint into an engine directory for one backend.

Every engine directory holds a `manifest.json` (manifest.py) next to the backend's artifacts:

* onnxruntime: `model.onnx` + `model.onnx.data` (the step graph with reference functions) and
  `model.ort.onnx` (+ data), the graph ORT optimised offline, which `OrtEngine` loads first;
* inductor: manifest + a reference to the checkpoint + compile settings; `InductorEngine` compiles
  at load time with its compiler cache inside the directory (inductor.py);
* tensorrt: the ONNX export plus `engine.plan` built with our plugins (trt.py).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from g4rt.models.layout import KVLayout, PageGeometry

from . import manifest as mf
from .onnx_export import DATA_FILE, MODEL_FILE, export_step
from .ort_engine import OPTIMIZED_FILE, session_options

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_ALIGN = 16  # PageGeometry.build's default, the runtime's choice


class BuildError(RuntimeError):
    pass


def resolve_model_dir(spec: str | Path) -> Path:
    from g4rt.models.tiny import resolve_model_dir as resolve
    try:
        return resolve(spec)
    except FileNotFoundError as e:
        raise BuildError(str(e)) from None


def geometry_for(cfg, dtype: str, page_tokens: int, align: int = DEFAULT_ALIGN) -> PageGeometry:
    return PageGeometry.build(KVLayout.from_config(cfg, dtype), page_tokens, align)


def _manifest(cfg, geometry, model_dir: Path, backend: str, dtype: str, page_tokens: int, **kw) -> dict:
    return mf.build_manifest(cfg, geometry, backend=backend, dtype=dtype, page_tokens=page_tokens,
                             align=DEFAULT_ALIGN, name=model_dir.resolve().name, **kw)


def copy_tokenizer(model_dir: Path, out: Path) -> dict:
    """Copy the checkpoint's tokenizer.json, if any, so text prompts work with `--engine` alone;
    returns the manifest's `files` entry for it."""
    if not (model_dir / "tokenizer.json").is_file():
        return {}
    shutil.copyfile(model_dir / "tokenizer.json", out / "tokenizer.json")
    return {"tokenizer": "tokenizer.json"}


def export_onnx(model_spec: str | Path, out_dir: str | Path, *, dtype: str = "float32", page_tokens: int = 16,
                backend: str = "onnxruntime", bar: tqdm | None = None) -> dict:
    """Load the checkpoint once, export PagedStep(functional=True) to `out_dir`, write the manifest."""
    from g4rt.models.checkpoint import load_model
    from g4rt.models.paged import PagedStep

    model_dir = resolve_model_dir(model_spec)
    out = Path(out_dir)
    model = load_model(model_dir, dtype=DTYPES[dtype], device="cpu")
    cfg = model.config
    geometry = geometry_for(cfg, dtype, page_tokens)
    _tick(bar, "export ONNX")
    export_step(PagedStep(model, geometry, functional=True), geometry, out, DTYPES[dtype])
    del model
    files = {"onnx": MODEL_FILE, "onnx_data": DATA_FILE, **copy_tokenizer(model_dir, out)}
    manifest = _manifest(cfg, geometry, model_dir, backend, dtype, page_tokens, files=files)
    mf.write_manifest(out, manifest)
    return manifest


def optimize_for_ort(out_dir: str | Path) -> Path:
    """Let ORT run its graph optimisations once and save the result (inlined functions, fused ops),
    weights again as external data, so engine start-up skips that work."""
    import onnxruntime as ort
    out = Path(out_dir)
    so = session_options()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED  # portable across CPUs
    so.optimized_model_filepath = str(out / OPTIMIZED_FILE)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", OPTIMIZED_FILE + ".data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(out / MODEL_FILE), so, providers=["CPUExecutionProvider"])
    return out / OPTIMIZED_FILE


def _tick(bar: tqdm | None, what: str) -> None:
    """Finish the previous stage (if any) and name the next one on the progress bar."""
    if bar is None or bar.disable:
        return
    if getattr(bar, "g4_started", False):
        bar.update(1)
    bar.g4_started = True
    bar.set_description_str(what)


def check_backend_available(backend: str) -> None:
    """Fail before any work when this machine cannot build `backend`."""
    if backend == "onnxruntime":
        try:
            import onnxruntime  # noqa: F401
        except ImportError as e:
            raise BuildError(f"backend onnxruntime needs the export extra (pip install 'g4rt[export]'): {e}")
    elif backend == "inductor":
        if not torch.cuda.is_available():
            raise BuildError("backend inductor builds a CUDA-graph engine and needs a CUDA GPU; none is visible here")
    elif backend == "tensorrt":
        from .trt import require_tensorrt
        require_tensorrt()
    else:
        raise BuildError(f"unknown backend {backend!r}; choose one of {', '.join(mf.BACKENDS)}")


def build(model_spec: str | Path, backend: str, out_dir: str | Path, *, dtype: str | None = None,
          page_tokens: int = 16, progress: bool = True) -> Path:
    """Build an engine directory for `backend` and return its path."""
    check_backend_available(backend)
    dtype = dtype or {"onnxruntime": "float32"}.get(backend, "bfloat16")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = {"onnxruntime": 3, "inductor": 1, "tensorrt": 3}[backend]
    with tqdm(total=steps, desc="", disable=not progress, unit="step") as bar:
        if backend == "inductor":
            from .inductor import write_inductor_engine
            _tick(bar, "write inductor manifest")
            write_inductor_engine(resolve_model_dir(model_spec), out, dtype=dtype, page_tokens=page_tokens)
        else:
            manifest = export_onnx(model_spec, out, dtype=dtype, page_tokens=page_tokens, backend=backend, bar=bar)
            if backend == "onnxruntime":
                _tick(bar, "optimize for ONNX Runtime")
                optimize_for_ort(out)
                manifest["files"]["ort_optimized"] = OPTIMIZED_FILE
            else:
                from .trt import build_trt_engine
                _tick(bar, "build TensorRT engine")
                manifest.update(build_trt_engine(out))
            mf.write_manifest(out, manifest)
        if not bar.disable:
            bar.update(bar.total - bar.n)
    return out


def load_engine(engine_dir: str | Path, num_frames: int, **kw):
    """The runtime's entry point: open any engine directory as an Engine, by its manifest's backend."""
    backend = mf.read_manifest(engine_dir).get("backend")
    if backend == "onnxruntime":
        from .ort_engine import OrtEngine
        return OrtEngine(engine_dir, num_frames, **kw)
    if backend == "inductor":
        from .inductor import InductorEngine
        return InductorEngine.open(engine_dir, num_frames, **kw)
    if backend == "tensorrt":
        from .trt import TrtEngine
        return TrtEngine(engine_dir, num_frames, **kw)
    raise mf.ManifestError(f"{engine_dir}: manifest field 'backend' is {backend!r}, expected one of "
                           f"{', '.join(mf.BACKENDS)}")

