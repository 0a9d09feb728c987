"""Export the step graph (`PagedStep(functional=True)`) to ONNX with the dynamo exporter.

The graph's contract is models/step.py's: inputs `INPUTS` (the arena, then the StepBatch fields, all
metadata int32), outputs `OUTPUTS`: `logits` (float32 [R, V]) and `arena_out` (the arena after this
step's KV writes; TensorRT aliases it to `arena`, ORT returns a new buffer that the runner feeds
back). Its symbolic dims become the export's dynamic shapes; frame_elems and every weight are fixed.

Custom ops become `gemma4::G4PagedAttention` / `G4KVWrite` / `G4MoE` nodes through a
`custom_translation_table` (needs the schemas of plugins/onnx_schemas.py), and their reference bodies from
plugins/onnx_functions.py ride along as model-local functions so ONNX Runtime can run the file.

Memory: the exporter traces with fake tensors and keeps each initializer as a reference to the
module's parameter, and `ONNXProgram.save(external_data=True)` writes them one at a time, so the
weights exist once (in the module) during export; `tests/test_export_engine.py` measures this.
"""
from __future__ import annotations

import logging
from pathlib import Path

import onnx
import torch

import g4rt.plugins.ops  # noqa: F401  (registers torch.ops.g4rt.*, which the step graph calls)
from g4rt.models.layout import PageGeometry
from g4rt.models.step import INPUTS, OUTPUTS, StepBatch, dim_symbol
from g4rt.plugins import onnx_functions as functions
from g4rt.plugins import onnx_schemas as schemas

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
OPSET = 18

log = logging.getLogger(__name__)


# ---- custom op translations --------------------------------------------------------------------
_g4 = None


def _opset():
    global _g4
    if _g4 is None:
        import onnxscript
        schemas.register()  # onnxscript resolves op types through onnx.defs
        _g4 = onnxscript.values.Opset(schemas.DOMAIN, schemas.OPSET_VERSION)
    return _g4


# `kernels` (which implementation traced the graph) is not part of the plugin node: see plugins/ops.py.
def _paged_attention(q, arena, cu_q, kv_lens, page_table, first_page, k_offset: int, v_offset: int,
                     page_size: int, num_kv_heads: int, window_left: int, scale: float, kernels: str):
    return _opset().G4PagedAttention(
        q, arena, cu_q, kv_lens, page_table, first_page, k_offset=k_offset, v_offset=v_offset,
        page_size=page_size, num_kv_heads=num_kv_heads, head_dim=int(q.shape[-1]), window_left=window_left,
        scale=float(scale), **schemas.plugin_attrs())


def _kv_write(arena, k, v, slots, k_offset: int, v_offset: int, page_size: int, kernels: str):
    return _opset().G4KVWrite(arena, k, v, slots, k_offset=k_offset, v_offset=v_offset, page_size=page_size,
                              **schemas.plugin_attrs())


def _moe(x, idx, w, gate_up, down, kernels: str):
    return _opset().G4MoE(x, idx, w, gate_up, down, **schemas.plugin_attrs())


def translation_table() -> dict:
    """torch op overload -> onnxscript translation, for `torch.onnx.export(custom_translation_table=)`."""
    return {torch.ops.g4rt.paged_attention.default: _paged_attention,
            torch.ops.g4rt.kv_write.default: _kv_write,
            torch.ops.g4rt.moe.default: _moe}


# ---- tracing inputs ----------------------------------------------------------------------------
def example_batch(geometry: PageGeometry) -> StepBatch:
    """A small, valid step (prefill chunk + decode + short chunk) whose every dynamic size differs,
    so the tracer cannot unify two dims by accident: T=7, B=3 (B+1=4), Ms=5, Mf=6, R=2, frames=16."""
    i32 = dict(dtype=torch.int32)
    q_lens, kv_lens = (4, 1, 2), (4, 9, 6)
    positions = torch.cat([torch.arange(k - q, k) for q, k in zip(q_lens, kv_lens)]).to(torch.int32)
    cu_q = torch.tensor([0, 4, 5, 7], **i32)
    seq_of = torch.repeat_interleave(torch.arange(3), torch.tensor(q_lens))
    ps, pf = geometry.page_tokens["sliding"], geometry.page_tokens["full"]
    sliding_table = torch.arange(15, dtype=torch.int32).reshape(3, 5) % 16
    full_table = (torch.arange(18, dtype=torch.int32).reshape(3, 6) + 5) % 16
    s_page = positions // ps
    f_page = positions // pf
    sliding_slots = sliding_table[seq_of, s_page.clamp(max=4)] * ps + positions % ps
    full_slots = full_table[seq_of, f_page.clamp(max=5)] * pf + positions % pf
    return StepBatch(
        token_ids=torch.tensor([2, 15, 7, 42, 9, 3, 11], **i32), positions=positions, cu_q=cu_q,
        kv_lens=torch.tensor(kv_lens, **i32), sliding_table=sliding_table,
        sliding_first=torch.zeros(3, **i32), sliding_slots=sliding_slots.to(torch.int32),
        full_table=full_table, full_slots=full_slots.to(torch.int32),
        logits_rows=torch.tensor([3, 6], **i32))


EXAMPLE_FRAMES = 16


# Export-time bounds of the symbolic dims (models/step.py); engines may narrow them (TensorRT profiles).
DIM_MAX = {"frames": 1 << 24, "tokens": 1 << 16, "seqs": 1 << 12, "sliding_pages": 1 << 16,
           "full_pages": 1 << 16, "rows": 1 << 16}


def dynamic_shapes() -> tuple:
    """One `{axis: Dim}` per input, from the contract's symbolic dims (static dims are left out)."""
    from torch.export import Dim
    dims = {name: Dim(name, min=1, max=hi) for name, hi in DIM_MAX.items()}
    shapes = []
    for name, axes in INPUTS.items():
        spec = {}
        for axis, dim in enumerate(axes):
            sym, plus = dim_symbol(dim)
            if sym in dims:
                spec[axis] = dims[sym] + plus if plus else dims[sym]
        shapes.append(spec)
    return tuple(shapes)


# ---- export ------------------------------------------------------------------------------------
def export_step(step: torch.nn.Module, geometry: PageGeometry, out_dir: str | Path, dtype: torch.dtype) -> Path:
    """Trace `step` (forward `(arena, *StepBatch.tensors()) -> (logits, arena_out)`), write
    `model.onnx` + `model.onnx.data` into `out_dir`, attach the reference functions, check, and
    return the model path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    step.eval()
    batch = example_batch(geometry)
    arena = torch.zeros(EXAMPLE_FRAMES, geometry.frame_elems, dtype=dtype)
    with torch.no_grad():
        prog = torch.onnx.export(
            step, (arena, *batch.tensors()), dynamo=True, external_data=True, opset_version=OPSET,
            input_names=list(INPUTS), output_names=list(OUTPUTS),
            dynamic_shapes=dynamic_shapes(), custom_translation_table=translation_table(), optimize=True)
    path = out / MODEL_FILE
    for stale in (path, out / DATA_FILE):
        stale.unlink(missing_ok=True)
    prog.save(str(path), external_data=True)
    del prog
    _finish(path)
    return path


def _finish(path: Path) -> None:
    """Attach the reference functions to the saved graph (weights stay in the data file, untouched)
    and run the full checker by path (works past the 2 GB protobuf limit)."""
    model = onnx.load(str(path), load_external_data=False)
    _name_external_data(model, path)
    _int64_nd_indices(model.graph)
    functions.attach(model)
    onnx.save(model, str(path))
    onnx.checker.check_model(str(path), full_check=True)


def _name_external_data(model: onnx.ModelProto, path: Path) -> None:
    """The exporter names the data file after the model file; insist on the contract's name."""
    for init in model.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location" and entry.value != DATA_FILE:
                raise RuntimeError(f"{path}: initializer {init.name} stored in {entry.value}, expected {DATA_FILE}")


def _int64_nd_indices(graph: onnx.GraphProto) -> None:
    """The exporter lowers `x[int32_index]` to GatherND with int32 indices, which the ONNX spec
    (and so the checker and ORT) refuse: cast those indices to int64 (a no-op when already int64)."""
    nodes = []
    for node in graph.node:
        if node.op_type in ("GatherND", "ScatterND") and node.domain in ("", "ai.onnx"):
            cast_out = f"{node.input[1]}__as_int64_{len(nodes)}"
            nodes.append(onnx.helper.make_node("Cast", [node.input[1]], [cast_out], to=onnx.TensorProto.INT64,
                                               name=f"{node.name}__index_cast"))
            node.input[1] = cast_out
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


def custom_nodes(model: onnx.ModelProto) -> dict[str, int]:
    """How many nodes of each custom op the main graph holds (a sanity check for exports and builds)."""
    counts: dict[str, int] = {}
    for node in model.graph.node:
        if node.domain == schemas.DOMAIN:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts
