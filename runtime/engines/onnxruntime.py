"""`OrtEngine`: the exported step graph under ONNX Runtime, behind the runtime's Engine protocol.

The graph is functional: it takes the arena and returns `arena_out`. ORT cannot alias the two, so
the engine simply adopts `arena_out` as its arena for the next step (no copy; the old buffer is
freed). The runtime only ever hands out frame indices, so swapping the buffer is invisible to it.

Execution providers are a setting: `providers=` (CLI `--ort-providers`), else the manifest's
`execution_providers` (what `g4rt build` recorded), else `default_providers()`: CUDA first when the
installed ONNX Runtime has it (onnxruntime-gpu), CPU otherwise. A named provider this ONNX Runtime
lacks is refused by name. With CUDA the engine loads `model.onnx` and lets ORT optimise for that
provider at load; the offline-optimised `model.ort.onnx` was optimised for CPU.

Feeds go through numpy, which has no bfloat16, so a bf16 engine directory is refused with a message
(export with `--dtype float32` or `float16`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from g4rt.models import manifest as mf
from g4rt.models.profiles import check_step, step_sizes
from g4rt.models.step import OUTPUTS, StepBatch

from ..arena import Arena

_NUMPY = {"float32": np.float32, "float16": np.float16}
CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"


def session_options(threads: int | None = None):
    ort = _onnxruntime()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3  # the reference functions trigger harmless shape-merge warnings
    return so


def default_providers() -> list[str]:
    """CUDA then CPU where this ONNX Runtime has the CUDA provider (onnxruntime-gpu), else CPU."""
    return [CUDA, CPU] if CUDA in _onnxruntime().get_available_providers() else [CPU]


def resolve_providers(manifest: dict, providers: Sequence[str] | None = None) -> list[str]:
    """The providers to run with: `providers`, else the manifest's, else the default; every one must
    be available here."""
    chosen = list(providers or manifest.get("execution_providers") or default_providers())
    available = _onnxruntime().get_available_providers()
    missing = [p for p in chosen if p not in available]
    if missing:
        raise RuntimeError(f"ONNX Runtime execution provider(s) {', '.join(missing)} not available here (available: "
                         f"{', '.join(available)}); install onnxruntime-gpu for {CUDA}, or pass --ort-providers")
    return chosen


def session(engine_dir: str | Path, manifest: dict, providers: Sequence[str], threads: int | None = None):
    """An InferenceSession of the engine directory's graph for `providers` (loaded by path so the
    external weight file resolves next to the model)."""
    files = manifest.get("files", {})
    key = "ort_optimized" if "ort_optimized" in files and CUDA not in providers else "onnx"
    model = mf.resolve_file(engine_dir, manifest, key)
    return _onnxruntime().InferenceSession(str(model), session_options(threads), providers=list(providers))


class OrtEngine:
    """Run `engine_dir` (manifest backend `onnxruntime`) with an arena of `num_frames` frames."""

    def __init__(self, engine_dir: str | Path, num_frames: int, *, threads: int | None = None,
                 providers: Sequence[str] | None = None):
        self.engine_dir = Path(engine_dir)
        self.manifest = mf.check_manifest(self.engine_dir, backend="onnxruntime")
        self.dtype = self.manifest["dtype"]
        if self.dtype not in _NUMPY:
            raise ValueError(f"{engine_dir}: the ONNX Runtime engine feeds numpy arrays and cannot run a {self.dtype} "
                             f"engine; export it with --dtype float32 (or float16)")
        self.geometry = mf.manifest_geometry(self.manifest)
        self.config = mf.manifest_config(self.manifest)
        self.profiles = self.manifest.get("profiles") or {}
        self.providers = resolve_providers(self.manifest, providers)
        self.session = session(self.engine_dir, self.manifest, self.providers, threads)
        self.arena = Arena.for_geometry(self.geometry, num_frames, "cpu")

    def step(self, batch: StepBatch, seq_ids: Sequence[int] = ()) -> torch.Tensor:
        feeds = {"arena": self.arena.tensor.numpy()}
        feeds.update((name, t.cpu().numpy()) for name, t in zip(StepBatch.names(), batch.tensors()))
        if self.profiles:
            check_step(self.profiles, step_sizes(feeds))
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
