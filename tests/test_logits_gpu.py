"""The logits' softcap kernel (plugins/triton_norm.py `softcap_logits_`) compiled for the GPU: the bits eager
torch computes on the device, where the engines' greedy tokens are compared. On CPU the interpreter runs it against
the reference to one bf16 ulp (tests/test_plugins_norm.py). Skipped without CUDA (the GPU session runs it)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the triton extra is not installed")

from g4rt.models import blocks  # noqa: E402
from g4rt.plugins import launch  # noqa: E402
from g4rt.plugins import triton_norm as tn  # noqa: E402

pytestmark = pytest.mark.skipif(
    launch.interpreting() or not torch.cuda.is_available(),
    reason="the compiled kernel on a CUDA GPU (the interpreter's run: test_plugins_norm.py)")


@pytest.mark.parametrize("rows", [1, 64, 257])
def test_softcap_logits_has_the_bits_of_torch_on_the_device(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    shape = (rows, 262144)
    x = (torch.randn(shape, device="cuda", generator=g)
         * torch.exp(2 * torch.randn(shape, device="cuda", generator=g))).to(torch.bfloat16)
    out = torch.full(shape, float("nan"), device="cuda")
    tn.softcap_logits_(x, 30.0, out)
    want = blocks.softcap_logits(x, 30.0)
    differ = (out != want).sum().item()
    assert differ == 0, f"{differ} of {out.numel()} logits differ from torch's, e.g. {out[out != want][:4].tolist()}"
