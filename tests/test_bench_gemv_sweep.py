"""bench/gemv_sweep.py on CPU: the plans it sweeps for a shape are those the committed H200 sweep ran
(export/results/h200_s22_call2_gemv_sweep.jsonl), and hold the op's own plan where it is a swept split; its
--help explains it (the timing itself needs a GPU)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the triton extra is not installed")

from g4rt.bench import gemv_sweep  # noqa: E402
from g4rt.plugins import triton_gemv as tg  # noqa: E402

SWEEP = Path(__file__).resolve().parents[1] / "export" / "results" / "h200_s22_call2_gemv_sweep.jsonl"


def test_the_sweep_tries_the_plans_the_committed_run_tried():
    ran: dict[tuple, set] = {}
    for line in SWEEP.read_text().splitlines():
        r = json.loads(line)
        if r.get("stage") == "gemv_sweep":
            ran.setdefault(tuple(r["shape"]), set()).add((tuple(r["config"][:4]), r["config"][4]))
    assert sorted(ran) == [(1536, 6144), (2560, 2048), (2560, 10240), (20480, 2560)]
    for (n, k), plans in ran.items():
        assert set(gemv_sweep.plans(n, k)) == plans, (n, k)
    cpu = torch.device("cpu")
    assert tg.gemv_plan(20480, 2560, cpu) in ran[20480, 2560]
    # the E4B's and E2B's down_proj: cut in 9 and 16, splits the sweep does not try
    assert tg.gemv_plan(2560, 10240, cpu)[1] == 9 and tg.gemv_plan(1536, 6144, cpu)[1] == 16
    assert ((64, 128, 4, 4), 1) not in ran[2560, 10240]  # 40 programs: under the sweep's 100


def test_the_sweep_explains_itself():
    r = subprocess.run([sys.executable, "-m", "g4rt.bench.gemv_sweep", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "--shape N K" in r.stdout and "F.linear" in r.stdout


@pytest.mark.parametrize("form", gemv_sweep.FORMS)
def test_a_form_is_checked_against_the_torch_blocks_before_its_timing(monkeypatch, form):
    """form_record runs the op's plan with the step's epilogue (and prologue) and compares it with the torch blocks
    in fp64; a launch whose output is off by more than 16 ulps of its largest value gives no time."""
    timed = []
    monkeypatch.setattr(gemv_sweep, "graph_ms", lambda fn, reps: (fn(), timed.append(reps), 2.0)[2])
    g = torch.Generator().manual_seed(3)
    mats = [(torch.randn(64, 256, generator=g) / 16).to(torch.bfloat16) for _ in range(2)]
    x = torch.randn(1, 256, generator=g).to(torch.bfloat16)
    rec = gemv_sweep.form_record(form, x, mats, reps=5)
    assert rec["form"] == form and rec["shape"] == [64, 256] and rec["rel_err"] < 16 * torch.finfo(torch.bfloat16).eps
    assert rec["ms"] == 2.0 and rec["ms_a_launch"] == 1.0 and timed == [5]
    config, splits = tg.gemv_plan(64, 256, x.device, packed_gelu=True)
    assert rec["config"] == [*config, splits] and rec["plan"] and rec["programs"] is None
    # on programs an SM of its own: 132 of them on CPU (an H200's SMs), a program a block with 0
    launched, gemv = [], tg.gemv
    monkeypatch.setattr(gemv_sweep.tg, "gemv", lambda *a, programs=None, **kw: launched.append(programs) or
                        gemv(*a, programs=programs, **kw))
    for per_sm, want in ((1, 132), (0, None)):
        rec = gemv_sweep.form_record(form, x, mats, reps=5, per_sm=per_sm)
        assert rec["programs"] == want and not rec["plan"] and rec["same_bits"]
        # the timed launches on `want` programs; on fewer than a program a block, one more on a program a block
        assert launched == [want, *([None] if want else []), want, want]
        launched.clear()


@pytest.mark.parametrize("args,said", [(["--forms", "gelu,tanh"], "unknown ['tanh']"),
                                       (["--forms", "gelu", "--programs", "2,-1"], "0 or more, got [2, -1]"),
                                       (["--forms", "gelu", "--programs", "two"], "whole numbers expected")])
def test_an_unknown_form_or_program_count_is_refused_by_name(tmp_path, capsys, args, said):
    with pytest.raises(SystemExit):
        gemv_sweep.main(["--shape", "64", "256", *args, "--out", str(tmp_path)])
    assert said in capsys.readouterr().err


def test_fewer_programs_off_the_bits_of_a_program_a_block_give_no_time(monkeypatch):
    """A launch on fewer programs than column blocks whose output is within the bound but not the bits of a program
    a block is recorded without a time."""
    monkeypatch.setattr(gemv_sweep, "graph_ms", lambda fn, reps: 2.0)
    gemv = tg.gemv
    monkeypatch.setattr(gemv_sweep.tg, "gemv", lambda *a, programs=None, **kw: gemv(*a, **kw) * (
        1 if programs is None else 1 + torch.finfo(torch.bfloat16).eps))
    g = torch.Generator().manual_seed(5)
    mats = [(torch.randn(256, 256, generator=g) / 16).to(torch.bfloat16)]
    x = torch.randn(1, 256, generator=g).to(torch.bfloat16)
    monkeypatch.setattr(gemv_sweep.tg, "sm_count", lambda device: 1)  # 4 column blocks on 2 programs
    rec = gemv_sweep.form_record("gelu", x, mats, reps=5, per_sm=2)
    assert rec["programs"] == 2 and not rec["same_bits"] and rec["ms"] is None
    assert rec["rel_err"] < 16 * torch.finfo(torch.bfloat16).eps


def test_a_form_off_the_blocks_gives_no_time(monkeypatch):
    monkeypatch.setattr(gemv_sweep, "graph_ms", lambda fn, reps: 2.0)
    monkeypatch.setattr(gemv_sweep.tg, "gemv", lambda x, w, *a, **k: torch.zeros(x.shape[0], w.shape[0] // 2,
                                                                                   dtype=x.dtype))
    g = torch.Generator().manual_seed(4)
    mats = [(torch.randn(64, 256, generator=g) / 16).to(torch.bfloat16)]
    rec = gemv_sweep.form_record("gelu", torch.randn(1, 256, generator=g).to(torch.bfloat16), mats, reps=5)
    assert rec["rel_err"] == 1.0 and rec["ms"] is None and rec["ms_a_launch"] is None
