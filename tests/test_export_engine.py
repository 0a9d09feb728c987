"""Export -> ONNX Runtime engine -> paged generation through the runtime, against the eager engine.

For a tiny config of each published variant (E2B-like KV sharing + PLE, E4B-like, 26B-like MoE +
k_eq_v, 31B-like k_eq_v) the ORT engine must produce the same greedy tokens as the eager paged
engine under the same scheduler, with logits within float32 rounding of the reference functions.
Also: the manifest refuses mismatches, and exporting a mid-size model keeps the weights in memory once.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import hf_generate, load_hf, tiny_config

from g4rt.export.build import build
from g4rt.export.onnx_export import MODEL_FILE, custom_nodes
from g4rt.models import manifest as mf
from g4rt.models.checkpoint import load_model, write_random_checkpoint
from g4rt.models.layout import KVLayout, PageGeometry
from g4rt.models.profiles import check_step
from g4rt.runtime.admission import promise_for
from g4rt.runtime.engines import open_engine
from g4rt.runtime.llm import LLM
from g4rt.runtime.sampling import SamplingParams
from g4rt.runtime.scheduler import SchedulerConfig

PAGE = 4
NEW_TOKENS = 6
PROMPTS = [[2, 15, 7, 42, 9, 3, 11, 5, 8, 13, 21], [2, 99, 4]]  # the first spans several windows (W = 8)
SCHED = SchedulerConfig(max_num_batched_tokens=16, chunk=8)  # chunked prefill mixed with decode


@pytest.fixture(scope="module", params=["e2b", "e4b", "26b", "31b"])
def built(request, tmp_path_factory):
    variant = request.param
    root = tmp_path_factory.mktemp(f"export_{variant}")
    ckpt = write_random_checkpoint(tiny_config(variant), root / "ckpt", seed=5, dtype="float32")
    engine_dir = build(ckpt, "onnxruntime", root / "engine", dtype="float32", page_tokens=PAGE, progress=False)
    return variant, ckpt, engine_dir


def geometry_for(cfg, page_tokens: int) -> PageGeometry:
    return PageGeometry.build(KVLayout.from_config(cfg, "float32"), page_tokens)


def _frames(geometry) -> int:
    return sum(promise_for(geometry, len(p), NEW_TOKENS, SCHED.chunk).frames for p in PROMPTS)


def _generate(llm):
    return llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS))


@pytest.mark.slow
def test_ort_engine_matches_eager(built, report):
    variant, ckpt, engine_dir = built
    model = load_model(ckpt, dtype=torch.float32)
    geometry = geometry_for(model.config, PAGE)
    frames = _frames(geometry)
    eager = LLM.paged(model, num_frames=frames, page_tokens=PAGE, config=SCHED, shuffle_seed=3, record_logits=True)
    engine = open_engine(engine_dir, frames)
    assert engine.geometry == geometry
    ort_llm = LLM(engine, frames, SCHED, eos_ids=(), shuffle_seed=3, record_logits=True)
    want, got = _generate(eager), _generate(ort_llm)
    worst = 0.0
    for a, b in zip(want, got):
        assert len(b.token_ids) == NEW_TOKENS
        assert a.token_ids == b.token_ids, f"{variant}: greedy tokens differ"
        for la, lb in zip(a.logits, b.logits):
            worst = max(worst, (la - lb).abs().max().item())
    report(f"{variant}: ORT vs eager max |logit diff| = {worst:.2e}")
    assert worst < 2e-3  # fp32 summation-order noise is ~5e-4 on logits of magnitude ~10
    # And the peer: HF transformers on the same files, each prompt on its own, greedy.
    hf = load_hf(ckpt, torch.float32)
    for prompt, b in zip(PROMPTS, got):
        assert hf_generate(hf, prompt, NEW_TOKENS)[2] == b.token_ids, f"{variant}: ORT tokens differ from HF"


@pytest.mark.slow
def test_export_graph_contract(built):
    variant, ckpt, engine_dir = built
    import onnx
    model = onnx.load(str(engine_dir / MODEL_FILE), load_external_data=False)
    names = [i.name for i in model.graph.input]
    assert names == ["arena"] + list(mf.io_contract()["inputs"][1:])
    assert [o.name for o in model.graph.output] == ["logits", "arena_out"]
    cfg = load_model(ckpt, dtype=torch.float32).config
    owners = sum(1 for i in range(cfg.num_hidden_layers) if cfg.kv_source(i) == i)
    moe = {"G4MoE": cfg.num_hidden_layers} if cfg.enable_moe_block else {}
    assert custom_nodes(model) == {"G4KVWrite": owners, "G4PagedAttention": cfg.num_hidden_layers, **moe}
    assert {f.name for f in model.functions} >= {"G4KVWrite", "G4PagedAttention", "G4MoE"}
    assert (engine_dir / "model.onnx.data").stat().st_size > 0  # weights stored externally


@pytest.mark.slow
def test_manifest_refuses_mismatch(built, tmp_path):
    variant, ckpt, engine_dir = built
    cfg = load_model(ckpt, dtype=torch.float32).config
    mf.check_manifest(engine_dir, backend="onnxruntime", dtype="float32", config=cfg,
                      geometry=geometry_for(cfg, PAGE))
    with pytest.raises(mf.ManifestError, match="'dtype'"):
        mf.check_manifest(engine_dir, dtype="bfloat16")
    with pytest.raises(mf.ManifestError, match="'backend'"):
        mf.check_manifest(engine_dir, backend="tensorrt")
    with pytest.raises(mf.ManifestError, match="geometry.page_tokens"):
        mf.check_manifest(engine_dir, geometry=geometry_for(cfg, 2 * PAGE))
    other = tiny_config(variant, vocab_size=cfg.vocab_size + 1)
    with pytest.raises(mf.ManifestError, match="config_hash"):
        mf.check_manifest(engine_dir, config=other)
    # A manifest from another op-schema version is refused when the engine is opened.
    stale = tmp_path / "stale"
    stale.mkdir()
    m = json.loads((engine_dir / mf.MANIFEST).read_text())
    m["op_schema_version"] += 1
    mf.write_manifest(stale, m)
    with pytest.raises(mf.ManifestError, match="op_schema_version"):
        open_engine(stale, 4)


_RSS_SCRIPT = textwrap.dedent("""
    import json, sys, threading, time
    import torch, onnx, onnxruntime, onnxscript  # baseline includes every library the export uses
    import g4rt.export.build as b, g4rt.export.onnx_export, g4rt.models.paged, g4rt.models.checkpoint

    def anon():  # anonymous resident memory: materialised tensors, not the mmap'd safetensors pages
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    peak, done = [anon()], []
    def poll():
        while not done:
            peak[0] = max(peak[0], anon())
            time.sleep(0.002)
    base = anon()
    t = threading.Thread(target=poll); t.start()
    b.export_onnx(sys.argv[1], sys.argv[2], dtype="float32", page_tokens=4)
    done.append(1); t.join()
    print(json.dumps({"base": base, "peak": max(peak[0], anon())}))
""")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_export_keeps_weights_once(tmp_path, report):
    """~300 MiB of float32 weights, no tensor over 5% of them (each is copied once, briefly, while it is written): the peak of anonymous RSS over the import baseline (sampled every
    2 ms; ru_maxrss would carry the pytest parent's peak across exec) must stay under 1.6x the
    weights: a second full copy, e.g. initializers serialised in memory, would exceed 2x."""
    cfg = tiny_config("31b", hidden_size=512, intermediate_size=8192, vocab_size=4096, vocab_size_per_layer_input=4096,
                      num_attention_heads=4, head_dim=64, global_head_dim=128)
    ckpt = write_random_checkpoint(cfg, tmp_path / "ckpt", seed=0, dtype="float32")
    weight_bytes = (ckpt / "model.safetensors").stat().st_size
    res = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(ckpt), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    grown = r["peak"] - r["base"]
    report(f"weights {weight_bytes / 2**20:.0f} MiB, export peak over baseline {grown / 2**20:.0f} MiB "
          f"({grown / weight_bytes:.2f}x)")
    assert weight_bytes > 250 * 2**20
    assert grown < 1.6 * weight_bytes


def test_tensorrt_build_error_is_clear_when_absent(tmp_path):
    """Where TensorRT is missing, `g4rt build --backend tensorrt` must say so before doing any work."""
    try:
        import tensorrt  # noqa: F401
        pytest.skip("tensorrt is importable here")
    except Exception:
        pass
    from g4rt.export.build import BuildError
    with pytest.raises(BuildError, match="tensorrt not importable"):
        build("does-not-matter", "tensorrt", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_inductor_engine_directory_is_complete(tmp_path):
    """An inductor engine directory (written here without a GPU: the compile happens at load) holds its
    weights and cache under relative paths, carries the tokenizer so `generate --engine DIR --prompt
    TEXT` works, and its manifest passes the runtime's check."""
    from g4rt.export.build import write_inductor_engine
    from g4rt.models.tiny import ensure_tiny

    model_dir = ensure_tiny()
    out = tmp_path / "eng"
    out.mkdir()
    manifest = write_inductor_engine(model_dir, out, dtype="bfloat16", page_tokens=16)
    assert (out / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    assert manifest["files"]["tokenizer"] == "tokenizer.json"
    assert (out / manifest["files"]["compile_cache"]).is_dir()
    m = mf.check_manifest(out, backend="inductor")
    weights = mf.resolve_file(out, m, "weights")
    assert weights.parent == out and (weights / "model.safetensors").read_bytes() == \
        (model_dir / "model.safetensors").read_bytes()
    assert (weights / "config.json").is_file()
    assert load_model(weights).config == load_model(model_dir).config
    # `profiles` means step bounds ({symbol: [min, opt, max]}); nothing bounds an inductor engine's steps, and
    # its compile notes live under `compile`.
    assert m["profiles"] == {} and m["compile"]["batch_buckets"]
    check_step(m["profiles"], {"tokens": 4096, "seqs": 256})


def test_a_build_carries_the_models_tokenizer_and_generation_config(tmp_path):
    """copy_tokenizer: the tokenizer files and generation_config.json (the sampling defaults `g4rt serve` applies)
    go into the engine directory, each where the checkpoint has it; the manifest names the tokenizer only when
    there is one."""
    from g4rt.export.build import copy_tokenizer

    src, out = tmp_path / "model", tmp_path / "eng"
    src.mkdir()
    out.mkdir()
    (src / "generation_config.json").write_text('{"top_k": 64}')
    assert copy_tokenizer(src, out) == {}
    assert (out / "generation_config.json").read_text() == '{"top_k": 64}' and not (out / "tokenizer.json").exists()
    (src / "tokenizer.json").write_text("{}")
    assert copy_tokenizer(src, out) == {"tokenizer": "tokenizer.json"} and (out / "tokenizer.json").is_file()
