"""g4rt's model vs Hugging Face `Gemma4ForCausalLM` (transformers' with-cache path) on tiny random
configs of every variant: E2B-like, E4B-like, 26B-like, 31B-like, and the embedded tiny model, which
combines all their features.

Both sides load the same `save_pretrained` files. HF runs its own eager attention on fp32 copies of
q/k/v (see conftest `load_hf`): in fp32 that is HF eager itself; in bf16 it rounds like g4rt's
attention and real kernels do (fp32 scores and accumulation), so everything else — norms, RoPE,
PLE, MoE, KV sharing, masks, bf16 residual — must match HF's rounding step for step.
"""
from __future__ import annotations

import pytest
import torch
from conftest import hf_generate, load_hf, tiny_config, write_hf_checkpoint

from g4rt.models.checkpoint import load_model
from g4rt.models.config import load_config
from g4rt.models.linear_cache import LinearCache, generate_linear
from g4rt.models.tiny import TINY_CONFIG

VARIANTS = ["e2b", "e4b", "26b", "31b", "tiny"]
PROMPT_LEN, STEPS = 20, 32


def variant_config(variant: str, dtype: str):
    if variant == "tiny":
        import dataclasses
        return dataclasses.replace(load_config(TINY_CONFIG), dtype=dtype)
    return tiny_config(variant, dtype=dtype)


def prompt_for(variant: str) -> list[int]:
    g = torch.Generator().manual_seed(sum(map(ord, variant)))
    return torch.randint(3, 512, (PROMPT_LEN,), generator=g).tolist()


@torch.no_grad()
def g4rt_logits(model, prompt: list[int], fed: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill logits of every prompt position, then one decode step per token of `fed`."""
    cache = LinearCache()
    cache.begin_step([0], [len(prompt)])
    prefill = model.logits(model(torch.tensor(prompt), torch.arange(len(prompt)), cache))
    decode = []
    for i, tok in enumerate(fed):
        cache.begin_step([0], [1])
        pos = torch.tensor([len(prompt) + i])
        decode.append(model.logits(model(torch.tensor([tok]), pos, cache))[0])
    return prefill, torch.stack(decode)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_logits_match_hf(variant, tmp_path, report):
    cfg = variant_config(variant, "float32")
    path = write_hf_checkpoint(cfg, tmp_path, torch.float32, seed=1)
    hf, ours = load_hf(path, torch.float32), load_model(path, dtype=torch.float32)
    prompt = prompt_for(variant)
    hf_pre, hf_dec, fed = hf_generate(hf, prompt, STEPS)
    pre, dec = g4rt_logits(ours, prompt, fed)
    scale = max(hf_pre.abs().max().item(), hf_dec.abs().max().item())
    d_pre = (pre - hf_pre).abs().max().item() / scale
    d_dec = (dec - hf_dec).abs().max().item() / scale
    report(f"HF parity {variant} fp32: max |logit diff| / max |logit|: prefill {d_pre:.2e}, decode ({STEPS} steps) {d_dec:.2e}")
    assert d_pre <= 1e-4 and d_dec <= 1e-4
    # Not vacuous: the logits vary across positions and vocab.
    assert hf_dec.std(dim=-1).min() > 0.5


@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_greedy_tokens_match_hf(variant, tmp_path, report):
    cfg = variant_config(variant, "bfloat16")
    path = write_hf_checkpoint(cfg, tmp_path, torch.bfloat16, seed=2)
    hf, ours = load_hf(path, torch.bfloat16), load_model(path, dtype=torch.bfloat16)
    assert ours.embed_tokens.weight.dtype == torch.bfloat16
    prompt = prompt_for(variant)
    _, hf_dec, hf_fed = hf_generate(hf, prompt, STEPS)
    hf_tokens = hf_fed + [int(hf_dec[-1].argmax())]  # fed[0] is the prefill's choice
    tokens, logits = generate_linear(ours, prompt, STEPS + 1, return_logits=True)
    diff = (logits[1:] - hf_dec).abs().max().item()
    report(f"HF parity {variant} bf16: {STEPS + 1} greedy tokens, first {tokens[:8]}..., max |logit diff| {diff:.3g}")
    assert tokens == hf_tokens
    assert len(set(tokens)) > 1  # a degenerate model that repeats one token would prove little


def test_tiny_uses_every_feature():
    cfg = load_config(TINY_CONFIG)
    sliding = {cfg.layer_head_dim(i) for i in range(cfg.num_hidden_layers) if cfg.is_sliding(i)}
    full = {cfg.layer_head_dim(i) for i in range(cfg.num_hidden_layers) if not cfg.is_sliding(i)}
    assert len(sliding) == len(full) == 1 and sliding != full
    assert cfg.has_ple and cfg.enable_moe_block and cfg.attention_k_eq_v and cfg.use_double_wide_mlp
    assert cfg.num_kv_shared_layers > 0 and cfg.num_global_key_value_heads != cfg.num_key_value_heads
    for v in ("e2b", "e4b", "26b", "31b"):
        c = tiny_config(v)
        assert c.head_dim != c.global_head_dim
