"""TensorRT engine build: parse the exported ONNX with our plugins registered, build `engine.plan`.

Written against the documented TensorRT >= 10.9 Python API (trt-onnx.md §1.3-§2.2 of the research
notes); nothing here can run on our CPU machines (TensorRT is not installable there), so every import
is lazy. UNTESTED against a real TensorRT: see export/README.md. The plugins themselves are
plugins/trt_plugins.py; the runner is runtime/engines/tensorrt.py.
"""
from __future__ import annotations

from pathlib import Path

from g4rt.models import manifest as mf
from g4rt.models.step import INPUTS, SYMBOLS, input_shape
from g4rt.plugins import onnx_schemas as schemas
from g4rt.plugins.trt_plugins import register_plugins, require_tensorrt

from .onnx_export import MODEL_FILE

PLAN_FILE = "engine.plan"
TIMING_CACHE = "timing.cache"
# Optimisation profile: (min, opt, max) per dynamic dim.
PROFILE = {"tokens": (1, 64, 8192), "seqs": (1, 16, 256), "sliding_pages": (1, 80, 160),
           "full_pages": (1, 256, 4096), "rows": (1, 16, 256), "frames": (1, 4096, 1 << 20)}


def _profile_shapes(frame_elems: int) -> dict[str, tuple]:
    """min/opt/max shape per graph input, from PROFILE and the step contract (models/step.py)."""
    assert set(PROFILE) == set(SYMBOLS), "PROFILE needs a range for every symbolic dim of the step"
    points = [{**{s: PROFILE[s][i] for s in SYMBOLS}, "frame_elems": frame_elems} for i in range(3)]
    return {name: tuple(input_shape(name, p) for p in points) for name in INPUTS}


def build_trt_engine(engine_dir: str | Path) -> dict:
    """Parse `model.onnx` with our plugins registered, check the parser picked them, build and write
    `engine.plan`. Returns manifest additions (files, profiles, TensorRT version)."""
    trt = require_tensorrt()
    register_plugins()
    out = Path(engine_dir)
    manifest = mf.read_manifest(out)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(out / MODEL_FILE)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {out / MODEL_FILE}: {errors}")
    plugin_layers = sum(network.get_layer(i).type == trt.LayerType.PLUGIN_V3 for i in range(network.num_layers))
    expected = sum(1 for _ in _custom_nodes(out))
    if plugin_layers != expected:
        raise RuntimeError(f"the parser made {plugin_layers} plugin layers for {expected} custom nodes: the plugins "
                           f"were not picked (reference functions inlined instead?)")
    cfg = builder.create_builder_config()
    cfg.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in _profile_shapes(manifest["geometry"]["frame_elems"]).items():
        profile.set_shape(name, lo, opt, hi)
    cfg.add_optimization_profile(profile)
    cache_path = out / TIMING_CACHE
    cache = cfg.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    cfg.set_timing_cache(cache, ignore_mismatch=False)
    plan = builder.build_serialized_network(network, cfg)
    if plan is None:
        raise RuntimeError("TensorRT engine build failed (see the log above)")
    (out / PLAN_FILE).write_bytes(bytes(plan))
    cache_path.write_bytes(bytes(cfg.get_timing_cache().serialize()))
    files = dict(manifest.get("files", {}), plan=PLAN_FILE, timing_cache=TIMING_CACHE)
    return {"files": files, "profiles": {k: list(v) for k, v in PROFILE.items()}, "tensorrt_version": trt.__version__}


def _custom_nodes(out: Path):
    import onnx
    model = onnx.load(str(out / MODEL_FILE), load_external_data=False)
    return [n for n in model.graph.node if n.domain == schemas.DOMAIN]


