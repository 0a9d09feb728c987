"""`OrtEngine`: the exported step graph under ONNX Runtime (CPU EP), behind the runtime's Engine protocol.

The graph is functional: it takes the arena and returns `arena_out`. ORT cannot alias the two, so
the engine simply adopts `arena_out` as its arena for the next step (no copy; the old buffer is
freed). The runtime only ever hands out frame indices, so swapping the buffer is invisible to it.

ORT's CPU kernels cover float32 and float16; bfloat16 arithmetic is not supported there, so a bf16
engine directory is refused with a message (export with `--dtype float32`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from g4rt.models import manifest as mf
from g4rt.models.step import OUTPUTS, StepBatch

from ..arena import Arena

_NUMPY = {"float32": np.float32, "float16": np.float16}


def session_options(threads: int | None = None):
    ort = _onnxruntime()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3  # the reference functions trigger harmless shape-merge warnings
    return so


class OrtEngine:
    """Run `engine_dir` (manifest backend `onnxruntime`) with an arena of `num_frames` frames."""

    def __init__(self, engine_dir: str | Path, num_frames: int, *, threads: int | None = None):
        ort = _onnxruntime()
        self.engine_dir = Path(engine_dir)
        self.manifest = mf.check_manifest(self.engine_dir, backend="onnxruntime")
        self.dtype = self.manifest["dtype"]
        if self.dtype not in _NUMPY:
            raise ValueError(f"{engine_dir}: ONNX Runtime on CPU cannot run a {self.dtype} engine; "
                             f"export it with --dtype float32 (or float16)")
        self.geometry = mf.manifest_geometry(self.manifest)
        self.config = mf.manifest_config(self.manifest)
        files = self.manifest.get("files", {})
        model = mf.resolve_file(self.engine_dir, self.manifest, "ort_optimized" if "ort_optimized" in files else "onnx")
        # Load by path so the external weight file resolves next to the model.
        self.session = ort.InferenceSession(str(model), session_options(threads), providers=["CPUExecutionProvider"])
        self.arena = Arena.for_geometry(self.geometry, num_frames, "cpu")

    def step(self, batch: StepBatch, seq_ids: Sequence[int] = ()) -> torch.Tensor:
        feeds = {"arena": self.arena.tensor.numpy()}
        feeds.update((name, t.cpu().numpy()) for name, t in zip(StepBatch.names(), batch.tensors()))
        logits, arena_out = self.session.run(list(OUTPUTS), feeds)
        self.arena.tensor = torch.from_numpy(arena_out)
        return torch.from_numpy(logits)

    def release(self, seq_id: int) -> None:
        """Nothing to do: the runtime owns the pages."""


def _onnxruntime():
    try:
        import onnxruntime
    except ImportError as e:
        raise RuntimeError(f"an onnxruntime engine needs the export extra (pip install 'g4rt[export]'): {e}") from None
    return onnxruntime
