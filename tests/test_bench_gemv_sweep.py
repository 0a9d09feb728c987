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
