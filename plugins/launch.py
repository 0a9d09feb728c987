"""How the step's kernels launch, shared by every kernel module: whether Triton interprets them (CPU tests),
whether the GPU takes dependent launches and tensor-memory copies (Hopper and later) and warpgroup MMA
(compute capability 9.x), the SM count, and the wait and trigger
of programmatic dependent launch in a kernel.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def hopper(device: torch.device) -> bool:
    """Whether `device` is a CUDA GPU of compute capability 9 or more: dependent launches and tensor-memory
    copies (looked up once)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def sm90(device: torch.device) -> bool:
    """Whether `device` is a CUDA GPU of compute capability 9.x: warpgroup matrix multiply-accumulate
    (`warpgroup_mma`, gluon_attention.py's kernel) exists there only; later GPUs have other tensor-core
    instructions (looked up once)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


@functools.cache
def pdl(device: torch.device) -> bool:
    """Whether the step's Triton kernels launch with programmatic dependent launch (Hopper and later;
    never under the interpreter, which has no grid dependency control). Such a launch may start while
    the kernel before it in the stream finishes; the kernel waits for it (`await_inputs`) before it
    reads anything a kernel wrote, so only the launch's latency and a kernel's start overlap the tail
    of the one before: the 31B's batch-1 decode step is about 800 kernels, most of a few microseconds."""
    return hopper(device) and not interpreting()


def pdl_launch(device: torch.device) -> dict:
    """The launch keywords of a kernel that takes `PDL`: its constexpr and the launch's flag, always the
    same value (a kernel launched with PDL that did not wait for its inputs would race the one before)."""
    on = pdl(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def await_inputs(PDL: tl.constexpr, LAUNCH_NEXT: tl.constexpr = True):
    """With PDL: wait until the kernels before this one have finished and their writes are visible, then
    let the next kernel launch. Every load of a kernel launched with PDL that reads what a kernel wrote
    comes after this call (a kernel's weights may be read before it: nothing writes them). LAUNCH_NEXT False:
    the kernel lets the next one launch itself, later (`launch_next`)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if LAUNCH_NEXT:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def launch_next(PDL: tl.constexpr):
    """With PDL: let the next kernel launch (at the latest it does when this one ends). A short kernel whose reads
    are its critical path calls it after them: the next kernel's programs start by reading their weights (a first
    tile, or gluon_gemv.py's whole slices), and reads queued behind those take that much longer (the norm kernel's
    launch on the H200: 3.3 -> 1.7 us with its reads in one round trip, export/results/README.md, "the norm in one
    round trip")."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's SM count, looked up once; off CUDA an H200's 132, so that CPU runs and tests take
    the launch choices the H200 takes."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
