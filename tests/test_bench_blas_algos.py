"""bench.blas_algos' roles: the matmuls a CUDA decode step runs, which its timings cover."""
from __future__ import annotations

import torch
from conftest import tiny_config

from g4rt.bench.blas_algos import step_roles
from g4rt.bench.engine import decode_roles
from g4rt.models.model import Gemma4Model


def test_a_step_runs_every_weight_once_packed_where_the_engines_pack():
    """The tiny E2B: layers that own a cache pack q/k/v and every layer packs gate/up; the KV-shared layers' q_proj
    stays alone. Every Linear's elements are counted once, packed or not."""
    model = Gemma4Model(tiny_config("e2b"), dtype=torch.bfloat16, device="meta")
    roles, _ = decode_roles(model)
    step = step_roles(model)
    elems = lambda table: sum(n * k * layers for (_, (n, k)), layers in table.items())  # noqa: E731
    assert elems(step) == elems({key: len(ws) for key, ws in roles.items()})
    names = {role for role, _ in step}
    assert {"sliding.self_attn.qkv", "sliding.mlp.gate_up", "sliding.self_attn.q_proj", "lm_head"} <= names
    assert not names & {"sliding.mlp.gate_proj", "sliding.mlp.up_proj", "sliding.self_attn.k_proj"}
    shared = sum(not layer.owns_cache for layer in model.layout.layers if layer.sliding)
    assert shared > 0
    assert sum(n for (role, _), n in step.items() if role == "sliding.self_attn.q_proj") == shared

