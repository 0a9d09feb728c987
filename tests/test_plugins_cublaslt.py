"""plugins/cublaslt.py: a serving-batch matmul by the cuBLASLt algorithm its table names for the GPU and shape.

On CPU: the table's entries are well formed and name shapes the models' decode steps run, and nothing off CUDA
takes the path. On a CUDA GPU: an algorithm rebuilt from its configuration computes the product (against fp64 on
fresh random inputs), the same bits every call and in a CUDA graph, and every entry of the package's table for
this GPU does too."""
from __future__ import annotations

import json

import pytest
import torch

from g4rt.bench.blas_algos import step_roles
from g4rt.models.config import load_config
from g4rt.models.model import Gemma4Model
from g4rt.plugins import cublaslt

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt runs on a CUDA GPU")


def test_the_package_table_names_shapes_the_models_run():
    shapes = set()
    for name in ("e2b", "e4b", "26b-a4b", "31b"):
        shapes |= {s for _, s in step_roles(Gemma4Model(load_config(name), dtype=torch.bfloat16, device="meta"))}
    for gpu_name, entries in cublaslt.read_algos().items():
        for e in entries:
            assert (e["n"], e["k"]) in shapes, (gpu_name, e)
            assert e["rows"] > 0 and set(e["algo"]) == {name for name, _, _ in cublaslt.CONFIG}, (gpu_name, e)


def test_off_cuda_nothing_takes_the_path():
    x, w = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    assert cublaslt.tuned_linear(x, w) is None


@pytest.fixture
def table_at(monkeypatch):
    """Point the plugin at another table file; its caches emptied now and after the test."""
    def point(path):
        monkeypatch.setattr(cublaslt, "ALGOS_FILE", path)
        cublaslt._table.cache_clear()
        cublaslt._tuned.cache_clear()
    yield point
    cublaslt._table.cache_clear()
    cublaslt._tuned.cache_clear()


def _check_product(x, w):
    y = cublaslt.tuned_linear(x, w)
    assert y is not None
    want = x.double() @ w.double().T
    assert ((y.double() - want).abs().max() / want.abs().max()).item() < 1e-2
    assert torch.equal(cublaslt.tuned_linear(x, w), y)  # the same bits every call
    graph, static = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        static = cublaslt.tuned_linear(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, y)


@gpu
@pytest.mark.parametrize("splitk", [1, 4])
def test_an_algorithm_rebuilt_from_its_configuration_computes_the_product(tmp_path, table_at, splitk):
    m, n, k = 64, 1024, 4096
    lt = cublaslt.lt()
    algo = lt.heuristic(m, n, k, 8, 32 << 20)[0].algo
    if not lt.cap(algo, cublaslt.CAP_SPLITK_SUPPORT):
        pytest.skip("the heuristic's first algorithm takes no split-K setting")
    red = next(r for r in cublaslt.REDUCTIONS if r & lt.cap(algo, cublaslt.CAP_REDUCTION_SCHEME_MASK))
    algo = lt.variant(algo, splitk=splitk, reduction=red if splitk > 1 else 0)  # the heuristic's own may be cut
    config = lt.config(algo)
    assert config["splitk"] == splitk
    path = tmp_path / "algos.json"
    path.write_text(json.dumps({torch.cuda.get_device_name(): [{"rows": m, "n": n, "k": k, "algo": config}]}))
    table_at(path)
    g = torch.Generator(device="cuda").manual_seed(splitk)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5
    _check_product(x, w)
    assert cublaslt.tuned_linear(x[:32].contiguous(), w) is None  # rows the table does not name


@gpu
def test_every_entry_for_this_gpu_computes_the_product():
    entries = cublaslt.read_algos().get(torch.cuda.get_device_name(), [])
    if not entries:
        pytest.skip(f"the table names no algorithm for {torch.cuda.get_device_name()}")
    g = torch.Generator(device="cuda").manual_seed(0)
    for e in entries:
        x = torch.randn(e["rows"], e["k"], device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(e["n"], e["k"], device="cuda", dtype=torch.bfloat16, generator=g) * e["k"] ** -0.5
        _check_product(x, w)
