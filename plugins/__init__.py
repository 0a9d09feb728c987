"""The custom ops (see README.md): `paged_attention`, `kv_write` and `moe`, which every backend's step graph
shares, and `sample`, which the runtime calls on the graph's logits.

Importing this package registers `torch.ops.g4rt.{paged_attention, kv_write_, kv_write, kv_write_attention_, moe, sample}`;
the plain Python API is `plugins.ops`. `window_left(W)` is the one place Gemma's window W becomes the kernels'
inclusive distance W - 1.
"""
from .reference import attend, window_left
from . import ops

__all__ = ["attend", "window_left", "ops"]
