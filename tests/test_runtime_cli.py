"""`g4rt plan` against gemma4-spec.md §4/§5 arithmetic, and `g4rt generate` end to end."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from g4rt.models.config import Gemma4Config, load_config
from g4rt.cli import main
from g4rt.runtime.plan import parameter_counts
from g4rt.runtime.sampling import SamplingParams

# gemma4-spec.md §4 (bf16): B/token total, and per request at 262,144 positions, (a) every position
# kept and (b) sliding layers keeping a window (W slots: W-1 old positions + the decode token).
SPEC_KV = {
    "e2b": (18_432, 4_831_838_208, 1_616_904_192),
    "e4b": (57_344, 15_032_385_536, 4_315_938_816),
    "26b-a4b": (225_280, 59_055_800_320, 5_578_424_320),
    "31b": (901_120, 236_223_201_280, 22_313_697_280),
}
# gemma4-spec.md §5: total in checkpoint, and the unused KV-shared k/v.
SPEC_PARAMS = {"e2b": (4_647_449_891, 18_880_512), "e4b": (7_518_069_034, 55_055_616),
               "26b-a4b": (25_233_141_790, 0), "31b": (30_697_345_340, 0)}


def run_cli(capsys, *argv) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_plan_matches_spec_kv_arithmetic(capsys):
    rows = json.loads(run_cli(capsys, "plan", "--context", "262144", "--json"))
    assert [r["model"] for r in rows] == list(SPEC_KV)
    for r in rows:
        per_token, all_pos, windowed = SPEC_KV[r["model"]]
        assert r["bytes_per_token"] == per_token == r["sliding"]["bytes_per_token"] + r["full"]["bytes_per_token"]
        assert r["request_bytes_all_positions"] == all_pos
        assert r["request_bytes_sliding_window"] == windowed
        assert r["parameters"] == SPEC_PARAMS[r["model"]][0]
        assert r["weight_bytes"] == 2 * SPEC_PARAMS[r["model"]][0]
    r31 = rows[-1]
    assert (r31["sliding"]["layers"], r31["full"]["layers"], r31["sliding"]["window"]) == (50, 10, 1024)


def test_plan_capacity_in_a_budget(capsys):
    (r,) = json.loads(run_cli(capsys, "plan", "--model", "31b", "--context", "262144", "--memory-gib", "141",
                              "--json"))
    assert r["kv_budget_bytes"] == 141 * 2**30 - 2 * 30_697_345_340
    assert r["frames_in_budget"] == r["kv_budget_bytes"] // r["frame_bytes"]
    assert r["requests_fit"] == r["frames_in_budget"] // r["request_frames"] == 4
    # a frame holds 16 sliding positions of 50 layers, or 160 full positions of 10 layers (12.5 MiB), padded to
    # 802 granules of 16 KiB (frame_stride): 6,849 frames, 4 requests of 1,704
    pages = {g: r[g]["page_tokens"] * r[g]["bytes_per_token"] for g in ("sliding", "full")}
    assert pages == {"sliding": 200 * 65_536, "full": 200 * 65_536} and r["frame_bytes"] == 802 * 16_384
    text = run_cli(capsys, "plan", "--model", "31b", "--context", "262144", "--memory-gib", "141")
    assert "220.00 GiB" in text and "20.78 GiB" in text and "4 requests" in text


def test_plan_with_a_one_byte_kv_holds_twice_the_positions(capsys):
    """`plan --kv-dtype float8_e4m3fn`: half the KV bytes a position, the same page positions in half the frame, so
    a budget holds twice the frames; the weights stay bf16."""
    args = ["plan", "--model", "31b", "--context", "262144", "--memory-gib", "141", "--json"]
    (bf16,) = json.loads(run_cli(capsys, *args))
    (fp8,) = json.loads(run_cli(capsys, *args, "--kv-dtype", "float8_e4m3fn"))
    assert (fp8["dtype"], fp8["kv_dtype"], bf16["kv_dtype"]) == ("bfloat16", "float8_e4m3fn", "bfloat16")
    assert 2 * fp8["bytes_per_token"] == bf16["bytes_per_token"] and 2 * fp8["frame_bytes"] == bf16["frame_bytes"]
    assert fp8["weight_bytes"] == bf16["weight_bytes"] and fp8["request_frames"] == bf16["request_frames"]
    assert fp8["frames_in_budget"] // 2 == bf16["frames_in_budget"]  # twice, or one more where a half frame is left
    assert fp8["requests_fit"] == 8 and bf16["requests_fit"] == 4
    assert "KV float8_e4m3fn" in run_cli(capsys, *args[:-1], "--kv-dtype", "float8_e4m3fn")
    with pytest.raises(SystemExit):
        main(["plan", "--kv-dtype", "int8"])
    assert "--kv-dtype" in capsys.readouterr().err


def test_parameter_counts_from_config():
    for name, (total, unused) in SPEC_PARAMS.items():
        p = parameter_counts(load_config(name))
        assert (p.total, p.unused_shared_kv) == (total, unused)
    assert parameter_counts(load_config("31b")).total - parameter_counts(load_config("31b")).embed == 29_288_059_196


def test_plan_rejects_bad_model(capsys):
    with pytest.raises(SystemExit, match="--model"):
        main(["plan", "--model", "no-such-size"])
    with pytest.raises(SystemExit):
        main(["plan", "--context", "-3"])
    assert "--context" in capsys.readouterr().err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from g4rt.models.checkpoint import write_random_checkpoint

    cfg = Gemma4Config(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, global_head_dim=32, vocab_size=128, sliding_window=8,
                       layer_types=("sliding_attention", "sliding_attention", "full_attention"), dtype="float32")
    return write_random_checkpoint(cfg, tmp_path_factory.mktemp("cli_model"), seed=1, dtype="float32")


def test_generate_json_paged_equals_reference(capsys, model_dir):
    """`generate --json` on the paged engine and on the linear reference (--reference): the same greedy
    tokens for a prompt spanning several windows and a short one, and a summary that adds up."""
    args = ["generate", "--model", str(model_dir), "--token-ids", "2,15,7,9,11,3,4,5,6,7", "--token-ids", "2,40",
            "--max-new-tokens", "5", "--page-tokens", "4", "--chunk", "4", "--json"]
    paged = json.loads(run_cli(capsys, *args))
    reference = json.loads(run_cli(capsys, *args, "--reference"))
    assert (paged["engine"], reference["engine"]) == ("eager paged", "linear reference")
    assert [o["token_ids"] for o in paged["outputs"]] == [o["token_ids"] for o in reference["outputs"]]
    for out in (paged, reference):
        assert len(out["outputs"]) == 2
        for o in out["outputs"]:
            assert len(o["token_ids"]) <= 5 and o["finish_reason"] in ("length", "stop")
            assert all(0 <= t < 128 for t in o["token_ids"])
        assert out["tokens"] == sum(len(o["token_ids"]) for o in out["outputs"]) and out["tokens_per_s"] > 0


def test_generate_takes_what_its_flags_leave_out_from_the_generation_config(capsys, model_dir, tmp_path):
    """`generate --generation-config auto` (the default): the model directory's generation_config.json supplies
    temperature / top_k / top_p / max_new_tokens the command line leaves out (the same tokens as those flags
    given with `none`; greedy without the file's do_sample, as HF's generate), a flag wins over the file, its
    eos_token_id ends a sequence, a bad file stops naming the flag, the file and the key."""
    d = tmp_path / "model"
    shutil.copytree(model_dir, d)
    gen = {"temperature": 30.0, "top_k": 20, "max_new_tokens": 4}  # far from greedy
    (d / "generation_config.json").write_text(json.dumps({**gen, "do_sample": True}))
    prompt = ["--token-ids", "2,15,7", "--token-ids", "2,40", "--seed", "5", "--json"]

    def tokens(*argv):
        return [o["token_ids"] for o in json.loads(run_cli(capsys, "generate", "--model", str(d), *prompt,
                                                           *argv))["outputs"]]

    from_file = tokens()
    assert from_file == tokens("--generation-config", "none", "--temperature", "30", "--top-k", "20",
                               "--max-new-tokens", "4")
    assert tokens("--temperature", "0") == tokens("--generation-config", "none", "--max-new-tokens", "4")
    greedy = tokens("--generation-config", "none")
    (d / "generation_config.json").write_text(json.dumps(gen))
    assert tokens() == tokens("--generation-config", "none", "--max-new-tokens", "4") != from_file
    assert all(len(t) <= 4 for t in from_file) and len(greedy[1]) > 4
    end = greedy[1][2]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [127, end]}))
    ended = json.loads(run_cli(capsys, "generate", "--model", str(d), *prompt))["outputs"][1]
    assert ended["token_ids"] == greedy[1][:greedy[1].index(end) + 1] and ended["finish_reason"] == "stop"
    for bad, key in (({"top_k": -2}, "top_k"), ({"eos_token_id": "1"}, "eos_token_id"),
                     ({"do_sample": 1}, "do_sample")):
        (d / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(SystemExit) as stop:
            main(["generate", "--model", str(d), *prompt])
        assert "--generation-config auto" in str(stop.value) and f"generation_config.json: {key}" in str(stop.value)


def test_generate_with_a_one_byte_kv_arena(capsys, model_dir, tmp_path):
    """`generate --kv-dtype float8_e4m3fn`: the paged engine and the linear reference store K/V as e4m3 alike and
    give the same greedy tokens; a built engine or tensor-parallel ranks refuse the flag by name."""
    args = ["generate", "--model", str(model_dir), "--token-ids", "2,15,7,9,11,3,4,5,6,7", "--max-new-tokens", "5",
            "--page-tokens", "4", "--chunk", "4", "--kv-dtype", "float8_e4m3fn", "--json"]
    paged = json.loads(run_cli(capsys, *args))
    reference = json.loads(run_cli(capsys, *args, "--reference"))
    assert [o["token_ids"] for o in paged["outputs"]] == [o["token_ids"] for o in reference["outputs"]]
    assert len(paged["outputs"][0]["token_ids"]) >= 1
    for extra in (["--engine", str(tmp_path)], ["--tensor-parallel", "2"]):
        argv = [a for a in args if a not in ("--model", str(model_dir))] if extra[0] == "--engine" else args
        with pytest.raises(SystemExit, match="--kv-dtype applies to --model on one device"):
            main(argv + extra)


def test_generate_tiny_console_script():
    exe = Path(sys.executable).parent / "g4rt"  # the console script of this environment
    assert exe.is_file(), f"console script g4rt not installed at {exe}"
    r = subprocess.run([exe, "generate", "--model", "tiny", "--token-ids", "2,15,7", "--max-new-tokens", "4",
                        "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["outputs"][0]["token_ids"]) >= 1


def test_generate_with_a_built_engine_matches_eager(capsys, model_dir, tmp_path):
    """`g4rt build` (ONNX Runtime) then `generate --engine`: the same greedy tokens as the eager engine."""
    from g4rt.export.build import build
    engine_dir = build(model_dir, "onnxruntime", tmp_path / "ort", dtype="float32", page_tokens=4, progress=False)
    capsys.readouterr()  # the exporter's own chatter
    args = ["--token-ids", "2,15,7,9,11,3,4,5,6,7", "--token-ids", "2,40", "--max-new-tokens", "5", "--chunk", "4",
            "--json"]
    eager = json.loads(run_cli(capsys, "generate", "--model", str(model_dir), "--page-tokens", "4", *args))
    built = json.loads(run_cli(capsys, "generate", "--engine", str(engine_dir), *args))
    assert built["engine"] == "onnxruntime engine"
    assert [o["token_ids"] for o in built["outputs"]] == [o["token_ids"] for o in eager["outputs"]]
    # An engine directory is relocatable: copied elsewhere, with the original gone, it runs the same.
    moved = shutil.copytree(engine_dir, tmp_path / "elsewhere" / "ort")
    shutil.rmtree(engine_dir)
    again = json.loads(run_cli(capsys, "generate", "--engine", str(moved), *args))
    assert [o["token_ids"] for o in again["outputs"]] == [o["token_ids"] for o in eager["outputs"]]
    engine_dir = moved
    with pytest.raises(SystemExit, match="exactly one of --model"):
        main(["generate", "--model", str(model_dir), "--engine", str(engine_dir), "--token-ids", "2"])
    with pytest.raises(SystemExit, match="--engine"):
        main(["generate", "--engine", str(tmp_path), "--token-ids", "2"])


def test_generate_bad_input_names_the_flag(capsys, model_dir):
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(model_dir), "--token-ids", "2,x"])
    assert "--token-ids" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="top_p"):
        main(["generate", "--model", str(model_dir), "--token-ids", "2", "--top-p", "0", "--reference"])
    with pytest.raises(SystemExit, match="--model"):
        main(["generate", "--model", str(model_dir / "missing"), "--token-ids", "2"])
    with pytest.raises(SystemExit, match="token id 4096 is outside the vocabulary .0, 128."):
        main(["generate", "--model", str(model_dir), "--token-ids", "2,4096"])


def test_help_and_docstring_name_every_command():
    import g4rt.cli as cli
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(sub.choices) == ["generate", "serve", "bench", "plan", "export", "build", "check", "trt-engine"]
    first_line = cli.__doc__.splitlines()[0]
    for name in sub.choices:
        assert name in parser.description and name in first_line, name


def _args(*argv):
    from g4rt.cli import build_parser
    return build_parser().parse_args(["generate", "--token-ids", "2", *argv])


def test_scheduler_flags_default_to_the_devices_settings(capsys):
    """Without flags the scheduler runs SchedulerConfig.for_device's settings (CUDA's measured ones on
    CUDA); a flag wins; the budget is at least the chunk, and a default chunk at most a budget given."""
    from g4rt.cli import _scheduler_config
    from g4rt.runtime.scheduler import SchedulerConfig

    for device in ("cuda", "cuda:1", "cpu"):
        assert _scheduler_config(_args(), "generate", device, None) == SchedulerConfig.for_device(device)
    cfg = _scheduler_config(_args("--max-batched-tokens", "512"), "generate", "cuda", None)
    assert (cfg.chunk, cfg.max_num_batched_tokens, cfg.max_num_seqs) == (512, 512, 256)
    cfg = _scheduler_config(_args("--chunk", "4096", "--max-num-seqs", "8"), "generate", "cuda", None)
    assert (cfg.chunk, cfg.max_num_batched_tokens, cfg.max_num_seqs) == (4096, 4096, 8)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "2048 on CUDA, 256 elsewhere" in text and "raised to --chunk when smaller" in text


@pytest.fixture(scope="module")
def limited_engine(model_dir, tmp_path_factory):
    """An ONNX Runtime engine built for 2 sequences, 8 tokens a step, chunks of 4, 40 frames, 64 positions
    (its profile: every step is checked against it)."""
    from g4rt.export.build import export_onnx
    from g4rt.models.profiles import StepLimits
    out = tmp_path_factory.mktemp("limited") / "ort"
    export_onnx(model_dir, out, dtype="float32", page_tokens=4,
                limits=StepLimits(max_batched_tokens=8, chunk=4, max_seqs=2, max_frames=40, max_model_len=64))
    return out


def test_a_built_engines_limits_are_the_schedulers_defaults_and_bounds(capsys, limited_engine):
    """`generate --engine` schedules within the limits the engine was built for (the defaults would ask
    for steps of 256 tokens, which its profile refuses, failing every request), and refuses a flag that
    asks for more, naming the flag and the limit."""
    from g4rt.cli import _open_llm
    from g4rt.runtime.scheduler import SchedulerConfig

    llm, _ = _open_llm(_args("--engine", str(limited_engine)), "generate", limited_engine, lambda *a: 1000)
    assert llm.scheduler.config == SchedulerConfig(max_num_batched_tokens=8, chunk=4, max_num_seqs=2,
                                                   max_model_len=64)
    assert llm.pool.num_frames == 40  # the engine's max_frames caps the default arena
    out = json.loads(run_cli(capsys, "generate", "--engine", str(limited_engine), "--token-ids",
                             "2,15,7,9,11,3,4,5,6,7", "--token-ids", "2,40", "--token-ids", "3,4,5",
                             "--max-new-tokens", "5", "--json"))
    assert [o["finish_reason"] for o in out["outputs"]] != ["error"] * 3
    assert all(o["finish_reason"] in ("length", "stop") for o in out["outputs"]), out["outputs"]
    for flag, value, limit in [("--max-num-seqs", "3", "max_seqs 2"), ("--chunk", "5", "chunk 4"),
                               ("--max-batched-tokens", "16", "max_batched_tokens 8"),
                               ("--max-model-len", "65", "max_model_len 64"), ("--num-frames", "41", "max_frames 40")]:
        with pytest.raises(SystemExit, match=f"generate: {flag} {value} exceeds .*\\({limit}\\).*--{limit.split()[0]}"
                                             .replace("_", "[-_]")):
            main(["generate", "--engine", str(limited_engine), "--token-ids", "2", flag, value])
    llm, _ = _open_llm(_args("--engine", str(limited_engine), "--max-num-seqs", "1", "--chunk", "2"), "generate",
                       limited_engine, lambda *a: 10)
    assert (llm.scheduler.config.max_num_seqs, llm.scheduler.config.chunk, llm.pool.num_frames) == (1, 2, 10)


def test_ort_providers_reach_the_onnxruntime_engine(limited_engine):
    from g4rt.cli import _open_llm

    llm, _ = _open_llm(_args("--engine", str(limited_engine), "--ort-providers", "CPUExecutionProvider"), "generate",
                       limited_engine, lambda *a: 8)
    assert llm.engine.providers == ["CPUExecutionProvider"]
    with pytest.raises(SystemExit, match="NoSuchExecutionProvider not available"):
        main(["generate", "--engine", str(limited_engine), "--token-ids", "2", "--ort-providers",
              "NoSuchExecutionProvider"])
    with pytest.raises(SystemExit, match="--ort-providers applies to onnxruntime engines, not to --model"):
        main(["generate", "--model", "tiny", "--token-ids", "2", "--ort-providers", "CPUExecutionProvider"])
    with pytest.raises(SystemExit, match="--device cuda does not apply to an onnxruntime engine"):
        main(["generate", "--engine", str(limited_engine), "--token-ids", "2", "--device", "cuda"])


@pytest.fixture(scope="module")
def inductor_dir(model_dir, tmp_path_factory):
    from g4rt.export.build import write_inductor_engine
    out = tmp_path_factory.mktemp("inductor") / "eng"
    write_inductor_engine(model_dir, out, dtype="float32", page_tokens=4)
    return out


def test_an_inductor_engine_built_with_a_one_byte_arena(model_dir, tmp_path):
    """`build --kv-dtype`: an inductor engine's manifest records the arena's dtype, whose geometry (half the frame
    bytes, the same positions) the runtime rebuilds and checks; a manifest without the field keeps the weights'
    dtype; other backends and tensor-parallel ranks refuse it by name."""
    from g4rt.export.build import BuildError, build, write_inductor_engine
    from g4rt.models import manifest as mf

    plain = write_inductor_engine(model_dir, tmp_path / "bf16", dtype="bfloat16", page_tokens=4)
    fp8 = write_inductor_engine(model_dir, tmp_path / "fp8", dtype="bfloat16", page_tokens=4, kv_dtype="float8_e4m3fn")
    assert (plain["kv_dtype"], fp8["kv_dtype"], fp8["dtype"]) == ("bfloat16", "float8_e4m3fn", "bfloat16")
    g_plain, g_fp8 = mf.manifest_geometry(plain), mf.manifest_geometry(fp8)
    assert g_fp8.layout.dtype == "float8_e4m3fn" and g_fp8.page_tokens == g_plain.page_tokens
    assert 2 * g_fp8.frame_bytes() == g_plain.frame_bytes()
    older = {k: v for k, v in plain.items() if k != "kv_dtype"}
    assert mf.manifest_kv_dtype(older) == "bfloat16" and mf.manifest_geometry(older) == g_plain
    with pytest.raises(BuildError, match="kv_dtype 'float8_e4m3fn': only inductor engines"):
        build(model_dir, "onnxruntime", tmp_path / "ort", kv_dtype="float8_e4m3fn", progress=False)
    with pytest.raises(SystemExit, match="--tensor-parallel: the engine in .* has a float8_e4m3fn arena"):
        main(["generate", "--engine", str(tmp_path / "fp8"), "--token-ids", "2", "--tensor-parallel", "2"])


def test_the_device_and_kernels_reach_a_built_engine(monkeypatch, inductor_dir):
    """--device goes to the backends that take one (inductor, tensorrt; default CUDA, where they run),
    --kernels too for inductor; the scheduler defaults are that device's."""
    import g4rt.runtime.engines as engines

    opened = []

    def fake_open(engine_dir, num_frames, **kw):
        opened.append(kw)
        raise RuntimeError("not opened in this test")
    monkeypatch.setattr(engines, "open_engine", fake_open)
    for extra, want in [((), {"device": "cuda"}), (("--device", "cuda:1", "--kernels", "reference"),
                                                   {"device": "cuda:1", "kernels": "reference"}),
                        (("--device", "cpu"), {"device": "cpu"})]:
        with pytest.raises(SystemExit, match="generate: --engine: not opened in this test"):
            main(["generate", "--engine", str(inductor_dir), "--token-ids", "2", *extra])
        assert opened.pop() == want


def test_compile_cache_env(monkeypatch, inductor_dir, tmp_path):
    """The engine directory's compile cache, unless the variable is set already (kept, as the user's)."""
    from g4rt.models import manifest as mf
    from g4rt.runtime.engines.inductor import use_compile_cache

    manifest = mf.read_manifest(inductor_dir)
    cache = mf.resolve_file(inductor_dir, manifest, "compile_cache")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "shared"))
    assert use_compile_cache(inductor_dir, manifest) == {"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
                                                         "TRITON_CACHE_DIR": str(tmp_path / "shared")}
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "inductor")


def test_tensor_parallel_ranks_of_an_engine_dir_compile_into_its_cache(monkeypatch, inductor_dir):
    """The ranks are spawned with this process's environment: it names the directory's cache before."""
    import g4rt.runtime.engines.parallel as parallel
    from g4rt.models import manifest as mf

    seen = []

    class FakeParallelEngine:
        def __init__(self, spec):
            seen.append((spec, {v: os.environ.get(v) for v in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}))
            raise RuntimeError("not started in this test")
    monkeypatch.setattr(parallel, "ParallelEngine", FakeParallelEngine)
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit, match="not started in this test"):
        main(["generate", "--engine", str(inductor_dir), "--token-ids", "2", "--tensor-parallel", "2"])
    cache = mf.resolve_file(inductor_dir, mf.read_manifest(inductor_dir), "compile_cache")
    (spec, env), = seen
    assert env == {"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton")}
    assert spec.device == "cuda" and spec.backend == "inductor"


def test_build_takes_the_limit_flags_generate_and_serve_spell():
    """`g4rt build` names its limits as the scheduler does (--max-seqs, --max-batched-tokens) and takes the
    spellings generate and serve use for the same settings (--max-num-seqs, --max-num-batched-tokens)."""
    from g4rt.cli import build_parser

    base = ["build", "--model", "tiny", "--backend", "onnxruntime", "--out", "x"]
    args = build_parser().parse_args(base + ["--max-num-seqs", "3", "--max-num-batched-tokens", "16"])
    assert (args.max_seqs, args.max_batched_tokens) == (3, 16)
    args = build_parser().parse_args(base + ["--max-seqs", "5", "--max-batched-tokens", "32"])
    assert (args.max_seqs, args.max_batched_tokens) == (5, 32)


def test_serve_refuses_a_generation_config_it_cannot_use_before_starting_the_engine(tmp_path, capsys):
    """`serve --generation-config auto` (the default) reads the model directory's generation_config.json; a bad
    value stops the start naming the flag, the file and the key, before the engine process is built. --help
    says where the defaults come from."""
    from g4rt.models.tiny import ensure_tiny

    d = tmp_path / "model"
    shutil.copytree(ensure_tiny(), d)
    (d / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(SystemExit) as stop:
        main(["serve", "--model", str(d), "--port", "0", "--num-frames", "8"])
    assert "--generation-config auto" in str(stop.value) and "generation_config.json: top_p" in str(stop.value)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "generation_config.json (temperature, top_k, top_p, max_new_tokens as max_tokens; its eos_token_id" in \
        " ".join(capsys.readouterr().out.split())
