"""`TrtEngine`: a TensorRT plan (export/trt.py) behind the Engine protocol, with execute_async_v3.

UNTESTED against a real TensorRT (not installable on our machines); see plugins/trt_plugins.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from g4rt.models import manifest as mf
from g4rt.models.step import OUTPUTS, StepBatch
from g4rt.plugins.trt_plugins import register_plugins, require_tensorrt

from ..arena import Arena


class TrtEngine:
    """Run `engine.plan` with execute_async_v3; the arena input and `arena_out` share one buffer."""

    def __init__(self, engine_dir: str | Path, num_frames: int, device: str = "cuda"):
        trt = require_tensorrt()
        register_plugins()
        self.engine_dir = Path(engine_dir)
        self.manifest = mf.check_manifest(self.engine_dir, backend="tensorrt", check_kernels=True)
        self.geometry = mf.manifest_geometry(self.manifest)
        self.config = mf.manifest_config(self.manifest)
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(
            mf.resolve_file(self.engine_dir, self.manifest, "plan").read_bytes())
        self.context = self.engine.create_execution_context()
        self.arena = Arena.for_geometry(self.geometry, num_frames, device)
        self.stream = torch.cuda.Stream(device=self.arena.device)

    def step(self, batch, seq_ids: Sequence[int] = ()) -> torch.Tensor:
        dev = self.arena.device
        b = batch.to(dev)
        tensors = {"arena": self.arena.tensor, **dict(zip(StepBatch.names(), b.tensors()))}
        for name, t in tensors.items():
            t = t.contiguous()
            tensors[name] = t
            self.context.set_input_shape(name, tuple(t.shape))
            self.context.set_tensor_address(name, t.data_ptr())
        vocab = self.geometry.layout.config.vocab_size
        logits = torch.empty(b.logits_rows.shape[0], vocab, dtype=torch.float32, device=dev)
        self.context.set_tensor_address(OUTPUTS[0], logits.data_ptr())
        self.context.set_tensor_address(OUTPUTS[1], self.arena.tensor.data_ptr())  # aliased in place
        self.stream.wait_stream(torch.cuda.current_stream(dev))
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        torch.cuda.current_stream(dev).wait_stream(self.stream)
        return logits

    def release(self, seq_id: int) -> None:
        """Nothing to do: the runtime owns the pages."""
