"""The sliding window is exactly W keys counting the current one (spec §3).

With a small W and prompts several windows long, g4rt matches HF; the same weights run with the
window set to W+1 or W-1 do not, so the agreement pins the boundary rather than tolerating it."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import hf_generate, load_hf, tiny_config, write_hf_checkpoint

from g4rt.models.checkpoint import load_model
from g4rt.models.linear_cache import LinearCache
from g4rt.models.model import Gemma4Model

W = 4
PROMPT_LEN, STEPS = 5 * W + 1, 3 * W


@torch.no_grad()
def run(model, prompt, fed):
    """All prefill logits and the decode logits for `fed`, concatenated [PROMPT_LEN + len(fed), V]."""
    cache = LinearCache()
    cache.begin_step([0], [len(prompt)])
    rows = [model.logits(model(torch.tensor(prompt), torch.arange(len(prompt)), cache))]
    for i, tok in enumerate(fed):
        cache.begin_step([0], [1])
        rows.append(model.logits(model(torch.tensor([tok]), torch.tensor([len(prompt) + i]), cache)))
    return torch.cat(rows)


def with_window(model: Gemma4Model, window: int) -> Gemma4Model:
    other = Gemma4Model(dataclasses.replace(model.config, sliding_window=window), dtype=model.dtype)
    other.load_state_dict(model.state_dict())
    return other.eval()


@pytest.mark.parametrize("variant", ["31b", "e2b"])
def test_window_is_exactly_w(variant, tmp_path, report):
    cfg = tiny_config(variant, sliding_window=W)
    path = write_hf_checkpoint(cfg, tmp_path, torch.float32, seed=3)
    hf, ours = load_hf(path, torch.float32), load_model(path, dtype=torch.float32)
    assert ours.layout.sliding.window == W
    prompt = torch.randint(3, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()
    hf_pre, hf_dec, fed = hf_generate(hf, prompt, STEPS)
    ref = torch.cat([hf_pre, hf_dec])
    scale = ref.abs().max().item()

    diff = {w: (run(m, prompt, fed) - ref).abs().max().item() / scale
            for w, m in [(W, ours), (W - 1, with_window(ours, W - 1)), (W + 1, with_window(ours, W + 1))]}
    report(f"window {variant}: max relative logit diff vs HF for window W-1, W, W+1: "
          f"{diff[W - 1]:.2e}, {diff[W]:.2e}, {diff[W + 1]:.2e}")
    assert diff[W] <= 1e-4
    assert diff[W - 1] > 1e-2 and diff[W + 1] > 1e-2
