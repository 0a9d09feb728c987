"""`g4rt plan` against gemma4-spec.md §4/§5 arithmetic, and `g4rt generate` end to end."""
from __future__ import annotations

import json
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
    # a frame holds 16 sliding positions of 50 layers, or 160 full positions of 10 layers
    assert r["frame_bytes"] == 16 * 819_200 == 160 * 81_920
    text = run_cli(capsys, "plan", "--model", "31b", "--context", "262144", "--memory-gib", "141")
    assert "220.00 GiB" in text and "20.78 GiB" in text and "4 requests" in text


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
