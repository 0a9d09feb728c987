"""bench/gemv_sweep.py on CPU: the plans it sweeps stay in its bounds and hold the op's own plan for the shapes it
was run on; its --help explains it (the timing itself needs a GPU)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="the triton extra is not installed")

from g4rt.bench import gemv_sweep  # noqa: E402
from g4rt.plugins import triton_gemv as tg  # noqa: E402


@pytest.mark.parametrize("n,k", [(2560, 10240), (20480, 2560), (1536, 6144)])
def test_the_sweep_stays_in_its_bounds_and_holds_the_ops_plan(n, k):
    plans = list(gemv_sweep.plans(n, k))
    assert plans and len(set(plans)) == len(plans)
    for (bn, bk, warps, stages), splits in plans:
        programs = -(-n // bn) * min(splits, -(-k // bk))
        assert 100 <= programs <= 800 and bn * bk * 2 * stages <= 160 << 10
        assert (warps == 8) == (bn * bk >= 32768) and (splits == 1 or -(-k // bk) >= 2 * splits)
    op = tg.gemv_plan(n, k, torch.device("cpu"))
    assert op in plans or op[1] not in (1, 2, 4, 8)  # the E2B's down_proj is cut in 6: not a swept split


def test_the_sweep_explains_itself():
    r = subprocess.run([sys.executable, "-m", "g4rt.bench.gemv_sweep", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "--shape N K" in r.stdout and "F.linear" in r.stdout
