"""bench.blas_algos: the matmuls a CUDA decode step runs (which its timings cover) and the candidates it times."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_config

from g4rt.bench.blas_algos import (CAP_REDUCTION_SCHEME_MASK, CAP_SPLITK_SUPPORT, candidates, config_key, main,
                                   step_roles)
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


class _FakeLt:
    """cuBLASLt's calls as `candidates` makes them: an algorithm is a dict (its configuration, split-K 1 unless
    set), the heuristic answers by workspace bound, and capability queries are counted, so the test sees what is
    asked again."""

    def __init__(self, answers: dict):
        self.answers, self.asked = answers, []

    def heuristic(self, m, n, k, count, bound):
        return [SimpleNamespace(algo=algo) for algo in self.answers[bound][:count]]

    def config(self, algo):
        return {"splitk": 1, "reduction": 0, **algo}

    def cap(self, algo, attr):
        self.asked.append(algo["algo_id"])
        return {CAP_SPLITK_SUPPORT: algo["algo_id"] == 66, CAP_REDUCTION_SCHEME_MASK: 1}[attr]

    def variant(self, algo, **changes):
        return {**algo, **changes}

    def checked(self, m, n, k, algo):
        return 1 << 20 if algo.get("splitk", 1) > 2 else 0  # the widest cut needs a workspace


def test_candidates_ask_each_answer_once_and_keep_each_bound_first_answer():
    """Algorithm 66 (split-K capable) answers first under 0 and 1 MiB, 7 first under 4 and 32 MiB: 66's capabilities
    and variants are asked for under its first bound only, every candidate is listed once with the bound and rank
    that first gave it (the unsplit variant is the answer itself), and each bound's first answer is recorded."""
    a66, a7 = {"algo_id": 66, "tile": 15}, {"algo_id": 7, "tile": 20}
    lt = _FakeLt({0: [a66], 1 << 20: [a66, a7], 4 << 20: [a7], 32 << 20: [a7, a66]})
    cands, firsts = candidates(lt, 64, 5376, 8192, SimpleNamespace(workspace=32 << 20, algos=8, splits=[1, 2, 4]))
    assert lt.asked == [66, 66, 7]
    assert [(need, where, cfg["algo_id"], cfg["splitk"]) for need, where, cfg in cands] == [
        (0, [0, 0], 66, 1), (0, [0, 0], 66, 2), (1 << 20, [0, 0], 66, 4), (0, [1 << 20, 1], 7, 1)]
    key66, key7 = config_key(lt.config(a66)), config_key(lt.config(a7))
    assert firsts == {0: key66, 1 << 20: key66, 4 << 20: key7, 32 << 20: key7}
    # a --workspace under 1 MiB: the bounds are 0 and itself, and the cut that needs 1 MiB is dropped
    lt = _FakeLt({0: [a66], 1 << 19: [a7]})
    cands, firsts = candidates(lt, 64, 5376, 8192, SimpleNamespace(workspace=1 << 19, algos=8, splits=[1, 2, 4]))
    assert [(cfg["algo_id"], cfg["splitk"]) for _, _, cfg in cands] == [(66, 1), (66, 2), (7, 1)]
    assert list(firsts) == [0, 1 << 19]


def test_rounds_and_layouts_are_checked_before_any_gpu_work(capsys):
    """A bad --rounds or --layouts stops the bench with a message naming both, whatever the machine (before the
    CUDA check), so a device call does not spend its start on a typo."""
    for argv in (["--rounds", "0"], ["--layouts", "separate,two"], ["--layouts", ","]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert "--rounds" in capsys.readouterr().err
