"""TensorRT engine build: the exported ONNX, rewritten for our plugins, built into `engine.plan`.

Written against the documented TensorRT >= 10.9 Python API; TensorRT cannot be installed on our
machines, so every TensorRT import is lazy and the build itself is UNTESTED here (DESIGN.md, "First
run on a TensorRT machine"). What it does, in order:

1. `tensorrt_graph`: `model.trt.onnx`, the export with every G4PagedAttention split into the split-K
   plugin pair (plugins/trt_plugins.py), weights still in `model.onnx.data`. Every custom node
   (any op of domain gemma4) must have a registered plugin, or the build stops naming it.
2. A strongly typed network (NetworkDefinitionCreationFlag.STRONGLY_TYPED): precision comes from
   the graph's own dtypes, so a bf16 export runs in bf16 (a weakly typed network may pick other
   precisions; TensorRT 11 is strongly typed only).
3. The parse must turn every custom node into a plugin layer (else TensorRT inlined a reference
   function: slow, and not what was tested).
4. One optimization profile from the manifest's `profiles` (models/profiles.py: the scheduler limits
   given to `g4rt build`).
5. The built plan is inspected (`arena_copies`): a copy or reformat layer touching the arena or any
   tensor of the KV-write chain means TensorRT copies the KV cache per step, and the build fails.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from g4rt.models import manifest as mf
from g4rt.models.profiles import profile_shapes
from g4rt.models.step import OUTPUTS
from g4rt.plugins import onnx_schemas as schemas
from g4rt.plugins.trt_plugins import PLUGIN_OPS, register_plugins, require_tensorrt, split_attention_nodes

from .onnx_export import DATA_FILE, MODEL_FILE, custom_nodes

PLAN_FILE = "engine.plan"
TIMING_CACHE = "timing.cache"
TRT_MODEL_FILE = "model.trt.onnx"
COPY_LAYER_WORDS = ("copy", "reformat")


class TrtBuildError(RuntimeError):
    pass


def tensorrt_graph(engine_dir: str | Path, manifest: dict, num_sms: int):
    """Write `model.trt.onnx` (split-K attention nodes, weights shared with `model.onnx.data`) and
    refuse a custom op that has no TensorRT plugin. Returns its path and the graph (no weights)."""
    import onnx

    out = Path(engine_dir)
    model = onnx.load(str(out / MODEL_FILE), load_external_data=False)
    cfg = mf.manifest_config(manifest)
    profiles = manifest["profiles"]
    split_attention_nodes(model, num_q_heads=cfg.num_attention_heads, num_sms=num_sms,
                          max_seqs=profiles["seqs"][2],
                          max_width=max(profiles["sliding_pages"][2], profiles["full_pages"][2]))
    unknown = sorted(set(custom_nodes(model)) - set(PLUGIN_OPS))
    if unknown:
        raise TrtBuildError(f"custom ops {', '.join(unknown)} (domain {schemas.DOMAIN}) have no TensorRT plugin in "
                            f"plugins/trt_plugins.py; TensorRT would inline their reference functions")
    path = out / TRT_MODEL_FILE
    onnx.save(model, str(path))  # initializers keep pointing at DATA_FILE next to it
    return path, model


def arena_tensors(model) -> set[str]:
    """Names of the tensors that are the KV arena at some point of a step: the graph's arena
    input/output and every arena input and output of a custom node that takes it."""
    names = {"arena", OUTPUTS[1]}
    for node in model.graph.node:
        if node.domain != schemas.DOMAIN:
            continue
        if node.op_type == schemas.KV_WRITE:
            names.update((node.input[0], node.output[0]))
        elif len(node.input) > 1 and node.input[1] in names:
            names.add(node.input[1])
    return names


def arena_copies(layers: list, arena_names: set[str], frame_elems: int) -> list[str]:
    """The layers of an engine inspector's JSON (`Layers`) that copy or reformat the arena: a copy
    or reformat layer (by type or name) one of whose tensors is an arena tensor by name or has the
    arena's shape [frames, frame_elems]."""
    found = []
    for layer in layers:
        if not isinstance(layer, dict):
            raise TrtBuildError("the engine inspector gave layer names only; build with "
                                "ProfilingVerbosity.DETAILED to inspect the arena's copies")
        kind = f"{layer.get('LayerType', '')} {layer.get('Name', '')}".lower()
        if not any(w in kind for w in COPY_LAYER_WORDS):
            continue
        for t in list(layer.get("Inputs", [])) + list(layer.get("Outputs", [])):
            dims = list(t.get("Dimensions", [])) if isinstance(t, dict) else []
            name = t.get("Name", "") if isinstance(t, dict) else str(t)
            if name in arena_names or (len(dims) == 2 and dims[1] == frame_elems):
                found.append(str(layer.get("Name", "?")))
                break
    return found


def _progress_monitor(trt):
    """A TensorRT build progress monitor printing each phase and step to stderr."""

    class Progress(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.totals = {}

        def phase_start(self, phase_name, parent_phase, num_steps):  # TensorRT's signature: parent unused
            self.totals[phase_name] = num_steps
            print(f"tensorrt: {phase_name} (0/{num_steps})", file=sys.stderr, flush=True)

        def step_complete(self, phase_name, step):
            print(f"tensorrt: {phase_name} ({step + 1}/{self.totals.get(phase_name, '?')})", file=sys.stderr,
                  flush=True)
            return True

        def phase_finish(self, phase_name):
            self.totals.pop(phase_name, None)

    return Progress()


def build_trt_engine(engine_dir: str | Path, progress: bool = True) -> dict:
    """Build and inspect `engine.plan` for an exported directory whose manifest has profiles.
    Returns the manifest additions (files, TensorRT version, SM count, inspection)."""
    import torch

    trt = require_tensorrt()
    register_plugins()
    out = Path(engine_dir)
    manifest = mf.read_manifest(out)
    if not manifest.get("profiles"):
        raise TrtBuildError(f"{out}: the manifest has no profiles; export with step limits (g4rt build sets them)")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    graph_path, graph = tensorrt_graph(out, manifest, num_sms)

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(graph_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise TrtBuildError(f"TensorRT could not parse {graph_path}: {errors}")
    plugin_layers = sum(network.get_layer(i).type == trt.LayerType.PLUGIN_V3 for i in range(network.num_layers))
    expected = sum(custom_nodes(graph).values())
    if plugin_layers != expected:
        raise TrtBuildError(f"the parser made {plugin_layers} plugin layers for {expected} custom nodes: the plugins "
                            f"were not picked (reference functions inlined instead?)")

    cfg = builder.create_builder_config()
    cfg.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    cfg.profiling_verbosity = trt.ProfilingVerbosity.DETAILED  # the inspector needs layer details
    if manifest["dtype"] == "float32" and hasattr(trt.BuilderFlag, "TF32"):
        cfg.clear_flag(trt.BuilderFlag.TF32)  # fp32 plans are checked against fp32 goldens at 1e-3
    if progress and hasattr(trt, "IProgressMonitor"):
        cfg.progress_monitor = _progress_monitor(trt)
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile_shapes(manifest["profiles"], manifest["geometry"]["frame_elems"]).items():
        profile.set_shape(name, lo, opt, hi)
    cfg.add_optimization_profile(profile)
    cache_path = out / TIMING_CACHE
    cache = cfg.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    cfg.set_timing_cache(cache, ignore_mismatch=False)
    plan = builder.build_serialized_network(network, cfg)
    if plan is None:
        raise TrtBuildError("TensorRT engine build failed (see the log above)")
    (out / PLAN_FILE).write_bytes(bytes(plan))
    cache_path.write_bytes(bytes(cfg.get_timing_cache().serialize()))

    inspection = inspect_plan(out / PLAN_FILE, graph, manifest["geometry"]["frame_elems"])
    files = dict(manifest.get("files", {}), plan=PLAN_FILE, timing_cache=TIMING_CACHE, trt_onnx=TRT_MODEL_FILE,
                 onnx_data=DATA_FILE)
    return {"files": files, "tensorrt_version": trt.__version__, "sm_count": num_sms, "inspection": inspection}


def inspect_plan(plan_path: Path, graph, frame_elems: int) -> dict:
    """Fail loudly if the plan copies the arena (copy/reformat layers on it, or `arena_out` not
    aliased to `arena`); returns what was checked."""
    trt = require_tensorrt()
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(plan_path.read_bytes())
    info = json.loads(engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON))
    layers = info.get("Layers", [])
    copies = arena_copies(layers, arena_tensors(graph), frame_elems)
    if copies:
        raise TrtBuildError(f"the plan copies the KV arena in {len(copies)} layer(s): {', '.join(copies[:8])}; "
                            f"every step would move the whole cache (aliased plugin I/O not honoured)")
    aliased = None
    if hasattr(engine, "get_aliased_input_tensor"):
        aliased = engine.get_aliased_input_tensor(OUTPUTS[1])
        if aliased != "arena":
            raise TrtBuildError(f"the plan's output {OUTPUTS[1]!r} is aliased to {aliased!r}, not to 'arena': "
                                f"TensorRT will not update the arena in place")
    return {"layers": len(layers), "arena_copies": 0, "arena_out_aliased_to": aliased}
