"""`manifest.json`: what an engine directory was built from, checked before anything runs it.

An engine bakes in facts that the runtime must agree with byte for byte: the model config, the dtype,
where every layer's K/V block sits inside a frame (page geometry), the step graph's inputs, the op
schemas and (for TensorRT) the kernels compiled into it. Running an engine against a runtime that
disagrees on any of them silently produces garbage, so `check_manifest` refuses a mismatch and names
the field.

Paths under `files` are relative to the engine directory, so a directory can be copied or moved
as a whole (`resolve_file`).
"""
from __future__ import annotations

import ast
import hashlib
import json
import time
from pathlib import Path

from g4rt.plugins import onnx_schemas as schemas

from .config import Gemma4Config, config_from_dict
from .layout import KVLayout, PageGeometry
from .step import INPUTS, IO_CONTRACT_VERSION, OUTPUTS

MANIFEST = "manifest.json"
FORMAT_VERSION = 2  # 2: files are relative paths inside the engine directory
BACKENDS = ("onnxruntime", "inductor", "tensorrt")
_PLUGINS_DIR = Path(__file__).resolve().parent.parent / "plugins"
# Where a TensorRT plan's plugin code starts: the AOT wrappers and launch arithmetic (trt_kernels) and the
# plugins' registration, whose launch parameters the plan keeps (trt_plugins). `plan_sources` adds every plugin
# module they import, transitively, so a kernel's source can move between modules without the hash missing it.
PLAN_ROOTS = ("trt_kernels.py", "trt_plugins.py")


class ManifestError(ValueError):
    pass


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def config_hash(cfg: Gemma4Config) -> str:
    return _sha256(_canonical(cfg.to_hf_text_config()))[:16]


def plan_sources(plugins_dir: Path = _PLUGINS_DIR) -> list[str]:
    """The plugin files a TensorRT plan compiles in: PLAN_ROOTS and the package-relative imports they reach
    (`from .x import`, `from . import x`, lazy ones inside functions too), sorted."""
    plugins_dir, seen, todo = Path(plugins_dir), set(), list(PLAN_ROOTS)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for node in ast.walk(ast.parse((plugins_dir / name).read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                modules = [node.module] if node.module else [a.name for a in node.names]
                todo += [f"{m}.py" for m in modules if (plugins_dir / f"{m}.py").is_file()]
    return sorted(seen)


def kernel_source_hash(plugins_dir: Path = _PLUGINS_DIR) -> str:
    """Hash of the plugin sources a TensorRT plan compiles in (`plan_sources`, under `plugins_dir`): editing any
    other plugin file (the sampler, the Gluon matmul, the ops' registration) leaves every built plan valid."""
    h = hashlib.sha256()
    for name in plan_sources(plugins_dir):
        h.update(name.encode() + b"\0" + (Path(plugins_dir) / name).read_bytes())
    return h.hexdigest()[:16]


def geometry_record(geometry: PageGeometry, page_tokens: int, align: int) -> dict:
    """Both groups' page sizes, frame size and every owning layer's (k_offset, v_offset)."""
    offsets = {str(k): list(v) for k, v in sorted(geometry.offsets.items())}
    return {
        "page_tokens_arg": page_tokens, "align": align,
        "page_tokens": dict(geometry.page_tokens), "frame_elems": geometry.frame_elems,
        "offsets": offsets, "offsets_hash": _sha256(_canonical(offsets))[:16],
    }


def io_contract() -> dict:
    return {"version": IO_CONTRACT_VERSION, "inputs": list(INPUTS), "outputs": list(OUTPUTS),
            "metadata_dtype": "int32"}


def build_manifest(cfg: Gemma4Config, geometry: PageGeometry, *, backend: str, dtype: str, page_tokens: int,
                   align: int, name: str, profiles: dict | None = None, files: dict | None = None,
                   extra: dict | None = None) -> dict:
    if backend not in BACKENDS:
        raise ManifestError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return {
        "format": FORMAT_VERSION,
        "model": {"name": name, "config_hash": config_hash(cfg), "config": cfg.to_hf_text_config()},
        "backend": backend,
        "dtype": dtype,
        "geometry": geometry_record(geometry, page_tokens, align),
        "io_contract": io_contract(),
        "profiles": profiles or {},
        "op_schema_version": schemas.SCHEMA_VERSION,
        "kernel_source_hash": kernel_source_hash(),
        "files": files or {},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **(extra or {}),
    }


def resolve_file(engine_dir: str | Path, manifest: dict, key: str) -> Path:
    """The file `files[key]` of an engine directory, which must be a relative path inside it."""
    rel = manifest.get("files", {}).get(key)
    if rel is None:
        raise ManifestError(f"{engine_dir}: manifest field 'files.{key}' is missing")
    path = Path(rel)
    if path.is_absolute() or ".." in path.parts:
        raise ManifestError(f"{engine_dir}: manifest field 'files.{key}' is {rel!r}; engine files must be relative "
                            f"paths inside the directory (rebuild the engine with `g4rt build`)")
    return Path(engine_dir) / path


def write_manifest(engine_dir: str | Path, manifest: dict) -> Path:
    path = Path(engine_dir) / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return path


def read_manifest(engine_dir: str | Path) -> dict:
    path = Path(engine_dir) / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{engine_dir}: no {MANIFEST} (not an engine directory; build one with `g4rt build`)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: not valid JSON ({e})") from None


def manifest_config(manifest: dict) -> Gemma4Config:
    return config_from_dict(manifest["model"]["config"], "manifest.json model.config")


def manifest_kv_dtype(manifest: dict) -> str:
    """The engine's arena dtype: its `kv_dtype` (an inductor engine built with one), else its weights' `dtype`."""
    return manifest.get("kv_dtype") or manifest["dtype"]


def manifest_geometry(manifest: dict) -> PageGeometry:
    """Rebuild the engine's PageGeometry from its config, KV dtype and page settings, and insist that it is the
    geometry the engine was built with (layout code may have changed since)."""
    g = manifest["geometry"]
    geometry = PageGeometry.build(KVLayout.from_config(manifest_config(manifest), manifest_kv_dtype(manifest)),
                                  g["page_tokens_arg"], g["align"])
    _compare("geometry", geometry_record(geometry, g["page_tokens_arg"], g["align"]), g)
    return geometry


def _compare(field: str, want, found) -> None:
    if isinstance(want, dict) and isinstance(found, dict):
        for key in want:
            _compare(f"{field}.{key}", want[key], found.get(key))
        return
    if want != found:
        raise ManifestError(f"engine manifest field '{field}' is {found!r}, but this runtime expects {want!r}; "
                            f"rebuild the engine (g4rt build) or run it with matching settings")


def check_manifest(engine_dir: str | Path, *, backend: str | None = None, config: Gemma4Config | None = None,
                   dtype: str | None = None, geometry: PageGeometry | None = None,
                   check_kernels: bool = False) -> dict:
    """Read `engine_dir/manifest.json` and refuse it (ManifestError naming the field) unless it matches
    this code (format, I/O contract, op schema version, optionally the kernel sources) and every
    expectation given. Returns the manifest."""
    m = read_manifest(engine_dir)
    _compare("format", FORMAT_VERSION, m.get("format"))
    _compare("io_contract", io_contract(), m.get("io_contract", {}))
    _compare("op_schema_version", schemas.SCHEMA_VERSION, m.get("op_schema_version"))
    if check_kernels:
        _compare("kernel_source_hash", kernel_source_hash(), m.get("kernel_source_hash"))
    if backend is not None:
        _compare("backend", backend, m.get("backend"))
    if dtype is not None:
        _compare("dtype", dtype, m.get("dtype"))
    if config is not None:
        _compare("model.config_hash", config_hash(config), m.get("model", {}).get("config_hash"))
    if geometry is not None:
        g = m.get("geometry", {})
        _compare("geometry.page_tokens", dict(geometry.page_tokens), g.get("page_tokens"))
        _compare("geometry.frame_elems", geometry.frame_elems, g.get("frame_elems"))
        rec = geometry_record(geometry, g.get("page_tokens_arg", 0), g.get("align", 0))
        _compare("geometry.offsets_hash", rec["offsets_hash"], g.get("offsets_hash"))
    return m

