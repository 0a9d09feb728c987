"""`TrtEngine`: a TensorRT plan (export/trt.py) behind the Engine protocol, with execute_async_v3.

The arena input and `arena_out` are bound to one buffer (the KV-write plugins alias them), so a step
updates the cache in place. Every step is checked against the plan's optimization profile (the
manifest's `profiles`, models/profiles.py) first, so a step the plan cannot run is refused by the
name of the dimension and the `g4rt build` flag that bounds it instead of failing inside TensorRT;
the arena's frame count is checked once, when the engine opens.

UNTESTED against a real TensorRT (not installable on our machines); see plugins/trt_plugins.py and
DESIGN.md "First run on a TensorRT machine".
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from g4rt.models import manifest as mf
from g4rt.models.profiles import check_step, step_sizes
from g4rt.models.step import OUTPUTS, StepBatch
from g4rt.plugins.trt_plugins import register_plugins, require_tensorrt

from ..arena import Arena


def load_plan(engine_dir: str | Path, manifest: dict):
    """Deserialize the directory's plan (plugins registered first); returns (runtime, engine)."""
    trt = require_tensorrt()
    register_plugins()
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(mf.resolve_file(engine_dir, manifest, "plan").read_bytes())
    if engine is None:
        raise RuntimeError(f"{engine_dir}: TensorRT could not deserialize the plan (built by another TensorRT "
                           f"version or for another GPU? manifest says {manifest.get('tensorrt_version')}, "
                           f"sm_count {manifest.get('sm_count')})")
    return runtime, engine


def polygraphy_runner(engine_dir: str | Path, manifest: dict):
    """polygraphy's TrtRunner over the plan (plugins registered), for `g4rt check`; it binds
    `arena_out` to the arena input's buffer where the plan reports the alias."""
    from polygraphy.backend.common import BytesFromPath
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    require_tensorrt()
    register_plugins()
    plan = mf.resolve_file(engine_dir, manifest, "plan")
    return TrtRunner(EngineFromBytes(BytesFromPath(str(plan))), name="tensorrt")


class TrtEngine:
    """Run `engine.plan` with execute_async_v3; the arena input and `arena_out` share one buffer."""

    def __init__(self, engine_dir: str | Path, num_frames: int, device: str = "cuda"):
        self.engine_dir = Path(engine_dir)
        self.manifest = mf.check_manifest(self.engine_dir, backend="tensorrt", check_kernels=True)
        self.geometry = mf.manifest_geometry(self.manifest)
        self.config = mf.manifest_config(self.manifest)
        self.profiles = self.manifest["profiles"]
        check_step(self.profiles, {"frames": num_frames})
        self.runtime, self.engine = load_plan(self.engine_dir, self.manifest)
        self.context = self.engine.create_execution_context()
        self.arena = Arena.for_geometry(self.geometry, num_frames, device)
        self.stream = torch.cuda.Stream(device=self.arena.device)

    def step(self, batch: StepBatch, seq_ids: Sequence[int] = ()) -> torch.Tensor:
        dev = self.arena.device
        b = batch.to(dev)
        tensors = {"arena": self.arena.tensor, **dict(zip(StepBatch.names(), b.tensors()))}
        check_step(self.profiles, step_sizes(tensors))
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
