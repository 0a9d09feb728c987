"""Golden steps and the polygraphy check (`g4rt check`), profiles from scheduler limits, ORT execution
providers, and the TensorRT-free pieces of `make trt-engine`.

Every variant's tiny model is exported once (with its golden steps from the eager torch step); the
polygraphy ONNX Runtime comparison must pass on all four and fail when a golden is perturbed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("polygraphy")

from conftest import tiny_config  # noqa: E402

from g4rt.cli import check_engine, generation_parity, main  # noqa: E402
from g4rt.export.build import export_onnx  # noqa: E402
from g4rt.export.goldens import INPUTS_FILE, OUTPUTS_FILE, STEPS, TOLERANCES  # noqa: E402
from g4rt.models import manifest as mf  # noqa: E402
from g4rt.models.checkpoint import write_random_checkpoint  # noqa: E402
from g4rt.models.profiles import ProfileError, StepLimits, check_step, derive_profiles, step_sizes  # noqa: E402

PAGE = 4


VARIANTS = ("e2b", "e4b", "26b", "31b")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """variant -> (checkpoint dir, exported engine dir with goldens), each exported once per module."""
    done = {}

    def get(variant):
        if variant not in done:
            root = tmp_path_factory.mktemp(f"check_{variant}")
            ckpt = write_random_checkpoint(tiny_config(variant), root / "ckpt", seed=7, dtype="float32")
            export_onnx(ckpt, root / "engine", dtype="float32", page_tokens=PAGE)
            done[variant] = ckpt, root / "engine"
        return done[variant]
    return get


@pytest.fixture(scope="module")
def exported(exports):
    """The 31b-like export: enough for the tests of one engine."""
    return exports("31b")


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_polygraphy_check_passes_on_every_variant(exports, variant, report):
    _, out = exports(variant)
    r = check_engine(out)
    assert r["passed"], r
    assert [s["step"] for s in r["steps"]] == list(STEPS)
    worst = {name: max(s["outputs"][name]["max_abs"] for s in r["steps"]) for name in TOLERANCES["float32"]}
    report(f"{variant}: polygraphy ORT vs eager goldens, max |err| logits {worst['logits']:.1e}, "
           f"arena_out {worst['arena_out']:.1e}")


def _copy(out, tmp_path):
    """The engine directory with its own golden files (the weights linked, not copied)."""
    dst = tmp_path / "engine"

    def place(src, target):
        if "golden" in src or src.endswith(mf.MANIFEST):
            shutil.copyfile(src, target)
        else:
            os.symlink(src, target)
    shutil.copytree(out, dst, copy_function=place)
    return dst


@pytest.mark.parametrize("output,step", [("logits", 2), ("arena_out", 0)])
def test_check_fails_on_a_perturbed_golden(exported, tmp_path, output, step):
    _, out = exported
    from polygraphy.comparator import RunResults
    dst = _copy(out, tmp_path)
    results = RunResults.load(str(dst / OUTPUTS_FILE))
    (runner, iters), = results.items()
    arr = iters[step][output]
    arr.flat[arr.size // 2] += 10 * TOLERANCES["float32"][output]
    iters[step][output] = arr
    results.save(str(dst / OUTPUTS_FILE))
    r = check_engine(dst)
    assert not r["passed"]
    failed = [(s["step"], name) for s in r["steps"] for name, o in s["outputs"].items() if not o["passed"]]
    assert failed == [(STEPS[step], output)]
    assert main(["check", str(dst)]) == 1


def test_goldens_cover_prefill_mixed_decode(exported):
    _, out = exported
    from polygraphy.json import load_json
    feeds = load_json(str(out / INPUTS_FILE))
    shapes = [step_sizes(f) for f in feeds]
    assert [(s["tokens"], s["seqs"]) for s in shapes] == [(2 * PAGE + 3, 1), (PAGE + 2, 2), (2, 2)]
    # Decode reads the KV the earlier steps wrote; the oldest sliding page left the window (W = 8).
    assert feeds[2]["sliding_first"][0] >= 1 and feeds[2]["arena"].any()
    manifest = mf.read_manifest(out)
    assert manifest["golden"]["steps"] == list(STEPS)
    from polygraphy.comparator import RunResults
    (_, iters), = RunResults.load(str(out / OUTPUTS_FILE)).items()
    last = iters[-1]["arena_out"]
    assert (last == 0).all(axis=1).any()  # the spare frame: no step writes it


def test_polygraphy_cli_reads_the_goldens(exported):
    """The golden files are polygraphy's own format: `polygraphy run --onnxrt --load-inputs
    --load-outputs` compares the exported graph against them (DESIGN.md gives this command)."""
    _, out = exported
    polygraphy = Path(sys.executable).parent / "polygraphy"
    if not polygraphy.is_file():
        pytest.skip(f"no polygraphy script next to {sys.executable}")
    tol = TOLERANCES["float32"]
    cmd = [str(polygraphy), "run", "model.onnx", "--onnxrt", "--load-inputs", INPUTS_FILE, "--load-outputs",
           OUTPUTS_FILE, "--atol", *[f"{k}:{v}" for k, v in tol.items()], "--rtol", "0", "--check-error-stat", "max"]
    r = subprocess.run(cmd, cwd=out, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "PASSED" in r.stdout + r.stderr


def test_generation_parity_with_an_ort_engine(exported):
    """make trt-engine's last step (engine tokens against the eager engine), on the ORT engine."""
    ckpt, out = exported
    r = generation_parity(out, ckpt, [[2, 15, 7, 42, 9, 3, 11, 5, 8, 13, 21], [2, 99, 4]], 4)
    assert r["equal"] and r["first_difference"] is None and len(r["engine"][0]) == 4


def test_profiles_from_limits_and_refusal_by_name(exported, tmp_path):
    """Bounds come from the scheduler limits (not constants), and an engine whose manifest has
    profiles refuses a step outside them, naming the dimension and the build flag."""
    _, out = exported
    geometry = mf.manifest_geometry(mf.read_manifest(out))
    limits = StepLimits(max_batched_tokens=64, chunk=32, max_seqs=8, max_frames=40, max_model_len=1000)
    p = derive_profiles(limits, geometry)
    assert p["tokens"] == [1, 8, 64] and p["seqs"] == [1, 8, 8] and p["frames"] == [1, 40, 40]
    assert p["sliding_pages"][2] == geometry.sliding_pages_per_request(32)
    assert p["full_pages"][2] == min(geometry.pages_for("full", 1000), 40)
    long = derive_profiles(StepLimits(8192, 8192, 8, 1 << 14, 1 << 17), geometry)
    assert long["sliding_pages"][2] == geometry.sliding_pages_per_request(8192)  # the 8,192 chunk fits
    with pytest.raises(ValueError, match="chunk"):
        StepLimits(max_batched_tokens=16, chunk=32, max_seqs=8, max_frames=40, max_model_len=1000)
    with pytest.raises(ProfileError, match=r"tokens = 65.*--max-batched-tokens"):
        check_step(p, {"tokens": 65, "seqs": 2})
    # The ORT engine runs the check too when its manifest has profiles.
    from g4rt.export.onnx_export import example_batch
    from g4rt.runtime.engines import open_engine
    dst = _copy(out, tmp_path)
    m = mf.read_manifest(dst)
    m["profiles"] = dict(p, tokens=[1, 4, 6])
    (dst / mf.MANIFEST).unlink()
    mf.write_manifest(dst, m)
    with pytest.raises(ProfileError, match="tokens = 7"):
        open_engine(dst, 16).step(example_batch(geometry))


def test_ort_execution_providers_are_a_setting(exported):
    _, out = exported
    from g4rt.runtime.engines.onnxruntime import CPU, CUDA, default_providers, resolve_providers
    import onnxruntime as ort
    want = [CUDA, CPU] if CUDA in ort.get_available_providers() else [CPU]
    assert default_providers() == want
    manifest = mf.read_manifest(out)
    assert resolve_providers(manifest) == want
    assert resolve_providers({**manifest, "execution_providers": [CPU]}) == [CPU]
    if CUDA not in ort.get_available_providers():
        with pytest.raises(RuntimeError, match=f"{CUDA} not available here"):
            resolve_providers(manifest, [CUDA, CPU])
        with pytest.raises(SystemExit, match=CUDA):
            main(["check", str(out), "--ort-providers", CUDA])
    assert check_engine(out, providers=[CPU])["engine"] == f"onnxruntime ({CPU})"


def test_trt_engine_stops_at_prerequisites(tmp_path):
    """Where TensorRT is missing, `g4rt trt-engine` (what `make trt-engine` runs) names every missing
    prerequisite with its fix and writes nothing."""
    from g4rt.plugins.trt_plugins import prerequisites
    missing = prerequisites()
    try:
        import tensorrt  # noqa: F401
        has_trt = True
    except Exception:
        has_trt = False
    if has_trt and torch.cuda.is_available():
        pytest.skip("this machine can build TensorRT engines")
    assert missing
    with pytest.raises(SystemExit) as e:
        main(["trt-engine", "--model", "tiny", "--out", str(tmp_path / "trt")])
    msg = str(e.value)
    assert msg.startswith("trt-engine: this machine cannot build a TensorRT engine (nothing was written)")
    if not has_trt:
        assert "tensorrt >= 10.9 with tensorrt.plugin is not importable" in msg and "pip install 'g4rt[tensorrt]'" in msg
    if not torch.cuda.is_available():
        assert "no CUDA GPU visible" in msg
    assert all(m in msg for m in missing)
    assert not (tmp_path / "trt").exists()


def test_check_json_output(exported, capsys):
    _, out = exported
    assert main(["check", str(out), "--json", "--atol", "logits=5e-3"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["passed"] and r["tolerances"]["logits"] == 5e-3 and r["dtype"] == "float32"


def test_tensorrt_graph_splits_attention_and_refuses_unknown_ops(exported, tmp_path):
    """The graph TensorRT parses: each G4PagedAttention becomes the split-K pair (wired output to
    input, the original output name kept, the slow reference function dropped), every other custom
    node is kept, and a custom op without a TensorRT plugin stops the build by name."""
    import onnx

    from g4rt.export.onnx_export import MODEL_FILE, custom_nodes
    from g4rt.export.trt import TrtBuildError, arena_tensors, tensorrt_graph
    from g4rt.plugins.trt_plugins import SPLIT_ATTENTION, SPLIT_COMBINE

    dst = _copy(exported[1], tmp_path)
    manifest = mf.read_manifest(dst)
    geometry = mf.manifest_geometry(manifest)
    manifest["profiles"] = derive_profiles(StepLimits(64, 32, 8, 40, 1000), geometry)
    original = onnx.load(str(dst / MODEL_FILE), load_external_data=False)
    path, in_memory = tensorrt_graph(dst, manifest, num_sms=132)
    graph = onnx.load(str(path), load_external_data=False)
    assert graph == in_memory
    before, after = custom_nodes(original), custom_nodes(graph)
    n = before.pop("G4PagedAttention")
    assert after == {**before, SPLIT_ATTENTION: n, SPLIT_COMBINE: n}
    produced = {o: node for node in graph.graph.node for o in node.output}
    attention_outputs = [node.output[0] for node in original.graph.node if node.op_type == "G4PagedAttention"]
    for name in attention_outputs:
        combine = produced[name]
        assert combine.op_type == SPLIT_COMBINE
        split = produced[combine.input[0]]
        assert split.op_type == SPLIT_ATTENTION and list(combine.input[:3]) == list(split.output)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in split.attribute}
        assert attrs["plugin_namespace"] == b"gemma4" and attrs["workspace_rows"] >= 8
    assert "G4PagedAttention" not in {f.name for f in graph.functions}
    assert {f.name for f in graph.functions} >= {"G4KVWrite"}
    known = {i.name for i in graph.graph.input} | {i.name for i in graph.graph.initializer} | {""}
    for node in graph.graph.node:  # still topologically ordered
        assert set(node.input) <= known, node.name
        known.update(node.output)
    kv_outputs = {node.output[0] for node in graph.graph.node if node.op_type == "G4KVWrite"}
    assert kv_outputs | {"arena", "arena_out"} <= arena_tensors(graph)

    original.graph.node.append(onnx.helper.make_node("G4Unplugged", ["arena"], ["nowhere"], domain="gemma4"))
    (dst / MODEL_FILE).unlink()
    onnx.save(original, str(dst / MODEL_FILE))
    with pytest.raises(TrtBuildError, match="G4Unplugged"):
        tensorrt_graph(dst, manifest, num_sms=132)


@pytest.mark.slow
def test_bf16_export_writes_bf16_goldens(tmp_path):
    """The TensorRT build's default dtype: the golden arenas stay bfloat16 (torch tensors in
    polygraphy's JSON, which numpy cannot hold) and the logits float32, as the plan's I/O."""
    from polygraphy.comparator import RunResults
    from polygraphy.json import load_json
    ckpt = write_random_checkpoint(tiny_config("31b"), tmp_path / "ckpt", seed=7, dtype="float32")
    export_onnx(ckpt, tmp_path / "bf16", dtype="bfloat16", page_tokens=PAGE)
    feeds = load_json(str(tmp_path / "bf16" / INPUTS_FILE))
    (_, iters), = RunResults.load(str(tmp_path / "bf16" / OUTPUTS_FILE)).items()
    assert all(f["arena"].dtype == torch.bfloat16 for f in feeds)
    assert all(i["arena_out"].dtype == torch.bfloat16 and str(i["logits"].dtype) == "float32" for i in iters)
    assert torch.equal(feeds[1]["arena"], iters[0]["arena_out"])  # each step starts from the last one's arena
