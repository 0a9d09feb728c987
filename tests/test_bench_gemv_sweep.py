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
    assert rec["config"] == [*config, splits]


def test_an_unknown_form_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit):
        gemv_sweep.main(["--shape", "64", "256", "--forms", "gelu,tanh", "--out", str(tmp_path)])


def test_a_form_off_the_blocks_gives_no_time(monkeypatch):
    monkeypatch.setattr(gemv_sweep, "graph_ms", lambda fn, reps: 2.0)
    monkeypatch.setattr(gemv_sweep.tg, "gemv", lambda x, w, *a, **k: torch.zeros(x.shape[0], w.shape[0] // 2,
                                                                                   dtype=x.dtype))
    g = torch.Generator().manual_seed(4)
    mats = [(torch.randn(64, 256, generator=g) / 16).to(torch.bfloat16)]
    rec = gemv_sweep.form_record("gelu", torch.randn(1, 256, generator=g).to(torch.bfloat16), mats, reps=5)
    assert rec["rel_err"] == 1.0 and rec["ms"] is None and rec["ms_a_launch"] is None
