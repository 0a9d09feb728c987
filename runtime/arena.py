"""The device arena: one 2-D tensor `[num_frames, frame_elems]` holding every KV page.

On CUDA the bytes come from cuda-python (`cudaMalloc`) and are wrapped zero-copy as a torch tensor
through `__cuda_array_interface__`, so the arena's lifetime is ours (freed on `close()`), not the
caching allocator's: an exported TensorRT engine and the eager torch path see the same pointer, and
the memory is not fragmented by or returned to torch's pool. On CPU it is an ordinary torch tensor.
cuda-python is imported only when a CUDA arena is made (it is not installed on CPU machines).
"""
from __future__ import annotations

import torch

from g4rt.models.layout import PageGeometry, torch_dtype


def frames_in_budget(budget_bytes: int, frame_bytes: int) -> int:
    """How many whole frames fit in `budget_bytes` (0 when none does)."""
    if frame_bytes <= 0:
        raise ValueError(f"frame_bytes must be positive, got {frame_bytes}")
    return max(0, int(budget_bytes) // frame_bytes)


class _CudaBuffer:
    """Raw device bytes from cudaMalloc, exposed through `__cuda_array_interface__` (as bytes)."""

    def __init__(self, nbytes: int, device_index: int):
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:  # older cuda-python layout
            try:
                from cuda import cudart  # type: ignore[no-redef]
            except ImportError as e:
                raise RuntimeError("a CUDA arena needs cuda-python (pip install 'g4rt[gpu]')") from e
        self._rt = cudart
        self._check(cudart.cudaSetDevice(device_index)[0], "cudaSetDevice")
        err, ptr = cudart.cudaMalloc(nbytes)
        self._check(err, f"cudaMalloc({nbytes} bytes)")
        self.ptr = int(ptr)
        self.nbytes = nbytes
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3, "strides": None}

    def _check(self, err, what: str) -> None:
        if int(err) != 0:
            raise RuntimeError(f"{what} failed: {err}")

    def free(self) -> None:
        if self.ptr:
            self._check(self._rt.cudaFree(self.ptr)[0], "cudaFree")
            self.ptr = 0


class Arena:
    """`tensor` is `[num_frames, frame_elems]` in `dtype`; page layout per `PageGeometry`."""

    def __init__(self, num_frames: int, frame_elems: int, dtype="float32", device="cpu"):
        if num_frames <= 0 or frame_elems <= 0:
            raise ValueError(f"num_frames and frame_elems must be positive, got {num_frames}, {frame_elems}")
        self.dtype = torch_dtype(dtype, kv=True)
        self.device = torch.device(device)
        self.num_frames, self.frame_elems = num_frames, frame_elems
        self._buffer: _CudaBuffer | None = None
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            self._buffer = _CudaBuffer(self.nbytes, index)
            raw = torch.as_tensor(self._buffer, device=self.device)  # zero-copy uint8 view
            raw.zero_()  # as bytes: every KV dtype's zero is all zero bits
            self.tensor = raw.view(self.dtype).view(num_frames, frame_elems)
        else:
            self.tensor = torch.zeros(num_frames, frame_elems, dtype=self.dtype, device=self.device)

    @classmethod
    def for_geometry(cls, geometry: PageGeometry, num_frames: int, device="cpu") -> "Arena":
        """An arena of `num_frames` frames of `geometry`, in its KV dtype."""
        return cls(num_frames, geometry.frame_elems, geometry.layout.dtype, device)

    @property
    def frame_bytes(self) -> int:
        return self.frame_elems * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.num_frames * self.frame_bytes

    def close(self) -> None:
        """Free the device bytes. The tensor must not be used afterwards (it is dropped here)."""
        self.tensor = None
        if self._buffer is not None:
            torch.cuda.synchronize(self.device)
            self._buffer.free()
            self._buffer = None

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
