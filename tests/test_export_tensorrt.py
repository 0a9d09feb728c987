"""TensorRT backend: skipped where TensorRT is not importable (every CPU machine of this project);
on a TensorRT machine, builds a tiny engine and checks it against the ORT engine's step."""
from __future__ import annotations

import pytest
import torch

try:
    import tensorrt  # noqa: F401
    _why = ""
except Exception as e:  # ImportError, or a broken install without libnvinfer
    _why = repr(e)

if _why:
    pytest.skip(f"tensorrt not importable: {_why}", allow_module_level=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TensorRT engines need a CUDA GPU")
def test_tiny_trt_engine_builds_and_matches_ort(tmp_path):
    from conftest import tiny_config

    from g4rt.export.build import build
    from g4rt.runtime.engines import open_engine
    from g4rt.export.onnx_export import example_batch
    from g4rt.models.checkpoint import write_random_checkpoint

    ckpt = write_random_checkpoint(tiny_config("31b"), tmp_path / "ckpt", seed=1, dtype="float32")
    trt_dir = build(ckpt, "tensorrt", tmp_path / "trt", dtype="float32", page_tokens=4, progress=False)
    ort_dir = build(ckpt, "onnxruntime", tmp_path / "ort", dtype="float32", page_tokens=4, progress=False)
    trt_engine, ort_engine = open_engine(trt_dir, 16), open_engine(ort_dir, 16)
    batch = example_batch(trt_engine.geometry)
    got = trt_engine.step(batch).cpu()
    want = ort_engine.step(batch)
    assert (got - want).abs().max().item() < 1e-2
    assert torch.equal(trt_engine.arena.tensor.cpu(), ort_engine.arena.tensor)
