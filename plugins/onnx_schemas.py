"""ONNX op schemas for the g4rt plugin ops, in domain `gemma4`.

Why register schemas at all: onnxscript resolves `Opset("gemma4", 1).G4PagedAttention` through
`onnx.defs`, so the dynamo exporter's translations cannot even name the op without them, and the
full checker verifies our nodes against them. The op types are deliberately no ONNX builtin
(`Attention` is imported natively by recent TensorRT parsers), and every node carries
`plugin_namespace`/`plugin_version` so the TensorRT parser picks the registered plugin ahead of the
reference function shipped in the same file (trt-onnx.md §1.4 of the research notes).

Registration is idempotent: `register()` can be called from every entry point. The constants import
without onnx (engine manifests record SCHEMA_VERSION on machines without the export extra).
"""
from __future__ import annotations

DOMAIN = "gemma4"
OPSET_VERSION = 1
PLUGIN_NAMESPACE = "gemma4"
PLUGIN_VERSION = "1"
PAGED_ATTENTION = "G4PagedAttention"
KV_WRITE = "G4KVWrite"
MOE = "G4MoE"
# Bump when an op's inputs, attributes or semantics change: it is recorded in every manifest.
SCHEMA_VERSION = 2

_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]


def _attr(name: str, kind: str, doc: str, required: bool = True):
    """An attribute of kind "INT", "FLOAT" or "STRING"."""
    from onnx.defs import OpSchema
    return OpSchema.Attribute(name, getattr(OpSchema.AttrType, kind), doc, required=required)


def _plugin_attrs() -> list:
    return [
        _attr("plugin_namespace", "STRING", "TensorRT plugin namespace (makes the parser prefer the plugin)", False),
        _attr("plugin_version", "STRING", "TensorRT plugin version", False),
    ]


_TYPES = [("T", _FLOATS, "model dtype"), ("I", ["tensor(int32)"], "metadata")]


def _param(name: str, type_str: str, doc: str = ""):
    from onnx.defs import OpSchema
    return OpSchema.FormalParameter(name, type_str, doc)


def _page_attrs() -> list:
    """Where a layer's K/V blocks sit in a frame: both arena ops address it the same way."""
    return [
        _attr("k_offset", "INT", "element offset of the layer's K block inside a frame"),
        _attr("v_offset", "INT", "element offset of the layer's V block inside a frame"),
        _attr("page_size", "INT", "positions per page of this layer's group"),
    ]


def _plugin_schema(name: str, doc: str, inputs, outputs, attributes, types=_TYPES):
    """A plugin op of domain `gemma4`, carrying the plugin attributes TensorRT's parser matches on."""
    from onnx.defs import OpSchema
    return OpSchema(name, DOMAIN, OPSET_VERSION, doc=doc, inputs=inputs, outputs=outputs, type_constraints=types,
                    attributes=[*attributes, *_plugin_attrs()])


def paged_attention_schema():
    return _plugin_schema(
        PAGED_ATTENTION,
        doc="Varlen paged attention over the arena (plugins/README.md `paged_attention`).",
        inputs=[
            _param("q", "T", "[T, num_q_heads, head_dim]"),
            _param("arena", "T", "[num_frames, frame_elems]"),
            _param("cu_q", "I", "[B+1] cumulative query rows"),
            _param("kv_lens", "I", "[B] positions after this step's writes"),
            _param("page_table", "I", "[B, M] frame of logical page first_page[b] + j"),
            _param("first_page", "I", "[B] first resident logical page"),
        ],
        outputs=[_param("out", "T", "[T, num_q_heads, head_dim]")],
        attributes=[
            *_page_attrs(),
            _attr("num_kv_heads", "INT", "KV heads of this layer"),
            _attr("head_dim", "INT", "head dim (256 sliding / 512 full on Gemma 4)"),
            _attr("window_left", "INT", "inclusive left distance (W-1); -1 = no window"),
            _attr("scale", "FLOAT", "multiplies q.k"),
        ],
    )


def kv_write_schema():
    return _plugin_schema(
        KV_WRITE,
        doc="Functional KV page write: arena_out = arena with k/v rows scattered to slots (-1 skips).",
        inputs=[
            _param("arena", "T", "[num_frames, frame_elems]"),
            _param("k", "T", "[T, num_kv_heads, head_dim]"),
            _param("v", "T", "[T, num_kv_heads, head_dim]"),
            _param("slots", "I", "[T] frame * page_size + offset; -1 writes nothing"),
        ],
        outputs=[_param("arena_out", "T", "the updated arena (TensorRT aliases it to `arena`)")],
        attributes=_page_attrs(),
    )


def moe_schema():
    return _plugin_schema(
        MOE,
        doc="The chosen experts' gated-GELU MLPs, weighted and summed per token (plugins/README.md `moe`).",
        inputs=[
            _param("x", "T", "[T, H] normed hidden states"),
            _param("idx", "K", "[T, k] expert ids chosen by the router"),
            _param("w", "W", "[T, k] their weights"),
            _param("gate_up", "T", "[E, 2I, H] rows [0:I] gate, [I:2I] up"),
            _param("down", "T", "[E, H, I]"),
        ],
        outputs=[_param("out", "T", "[T, H]")],
        attributes=[],
        types=[("T", _FLOATS, "model dtype"), ("K", ["tensor(int32)", "tensor(int64)"], "expert ids"),
               ("W", _FLOATS, "router weights (float32)")],
    )


def _registered(name: str) -> bool:
    import onnx
    try:
        onnx.defs.get_schema(name, OPSET_VERSION, DOMAIN)
        return True
    except onnx.defs.SchemaError:
        return False


def register() -> None:
    """Register the schemas with `onnx.defs` once per process (safe to call repeatedly)."""
    import onnx
    for name, build in ((PAGED_ATTENTION, paged_attention_schema), (KV_WRITE, kv_write_schema), (MOE, moe_schema)):
        if not _registered(name):
            onnx.defs.register_schema(build())


def plugin_attrs() -> dict:
    """The attributes every custom node carries so TensorRT maps it to our plugin."""
    return {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION}
