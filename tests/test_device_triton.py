"""The skinny matmul compiled for sm_90 by the GPU image's Triton (3.6, which `make test` installs beside the venv
into .venv/triton-device), not only the venv's: a kernel the newer Triton compiles can fail in the image's (a
constexpr held in a local became a runtime value in 3.6 and failed ConvertTritonToTritonGPU, found on the device).
Every form the ops launch, through bench.compile_report in a subprocess without TRITON_INTERPRET."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DEVICE_TRITON = Path(sys.prefix) / "triton-device"
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (DEVICE_TRITON / "triton").is_dir(),
                    reason="the image's Triton is not installed beside the venv (`make test` installs it)")
@pytest.mark.parametrize("n,k,form", [(5376, 21504, "plain"), (24576, 1536, "gelu"), (24576, 1536, "norm-gelu"),
                                      (20480, 2560, "norm-gelu")])
def test_the_image_triton_compiles_every_form_of_the_skinny_matmul(n, k, form):
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(DEVICE_TRITON), env.get("PYTHONPATH", "")])
    args = ["--gemv", str(n), str(k), "--form", form]
    r = subprocess.run([sys.executable, "-m", "g4rt.bench.compile_report", *args], capture_output=True, text=True,
                       env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["triton"] == "3.6.0" and got["form"] == form
    assert 0 < got["registers"] <= 255
