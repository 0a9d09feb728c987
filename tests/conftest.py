"""Shared test helpers: tiny Gemma 4 configs of each published variant, and an HF reference runner.

`tiny_config(variant, **overrides)` gives a small config of "e2b", "e4b", "26b" or "31b".
`write_hf_checkpoint` builds `transformers.Gemma4ForCausalLM` with random weights (norms, layer_scalar
and router scales perturbed away from their defaults so that a wrong formula shows) and saves it with
`save_pretrained`; `load_hf` / `hf_generate` run HF's with-cache path on those files.
"""
from __future__ import annotations

import pytest
import torch

from g4rt.models.config import FULL, SLIDING, Gemma4Config

S, F = SLIDING, FULL

_COMMON = dict(hidden_size=64, num_attention_heads=4, head_dim=32, global_head_dim=64, vocab_size=512,
               vocab_size_per_layer_input=512, sliding_window=8, max_position_embeddings=4096,
               hidden_size_per_layer_input=0, dtype="float32")

TINY_VARIANTS = {
    # 4:1 pattern, one KV head, PLE, last 4 layers KV-shared (sources 5 sliding / 4 full), double-wide MLP.
    "e2b": dict(intermediate_size=96, num_hidden_layers=10, num_key_value_heads=1, layer_types=(S, S, S, S, F) * 2,
                num_kv_shared_layers=4, use_double_wide_mlp=True, hidden_size_per_layer_input=16),
    # 5:1 pattern, two KV heads, PLE, KV sharing without the double-wide MLP.
    "e4b": dict(intermediate_size=96, num_hidden_layers=12, num_key_value_heads=2, layer_types=(S, S, S, S, S, F) * 2,
                num_kv_shared_layers=4, hidden_size_per_layer_input=16),
    # MoE + dense shared branch on every layer, k_eq_v full layers with fewer (global) KV heads.
    "26b": dict(intermediate_size=64, num_hidden_layers=6, num_key_value_heads=2, num_global_key_value_heads=1,
                attention_k_eq_v=True, enable_moe_block=True, num_experts=8, top_k_experts=2,
                moe_intermediate_size=32),
    # Dense, k_eq_v full layers.
    "31b": dict(intermediate_size=128, num_hidden_layers=6, num_key_value_heads=2, num_global_key_value_heads=1,
                attention_k_eq_v=True),
}

@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    """Every test (and every subprocess one starts) builds and finds the tiny model in a temporary
    cache, never in the user's home (`models.tiny.default_tiny_dir` reads G4RT_HOME)."""
    with pytest.MonkeyPatch.context() as mp:
        home = tmp_path_factory.mktemp("g4rt_home")
        mp.setenv("G4RT_HOME", str(home))
        yield home


def tiny_config(variant: str, **overrides) -> Gemma4Config:
    return Gemma4Config(**{**_COMMON, **TINY_VARIANTS[variant], **overrides})

@torch.no_grad()
def perturb_hf_model(model, seed: int = 0) -> None:
    """Move every default-initialised scale away from its default, and make logits spread."""
    g = torch.Generator().manual_seed(seed)
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if "inv_freq" in name or "embed_scale" in name:
            continue
        if name.endswith("layer_scalar"):
            p.copy_(torch.rand(p.shape, generator=g) * 0.5 + 0.5)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            # q.k with unit-RMS q, k and scale 1.0 has std sqrt(D); ~0.5 keeps random softmaxes soft.
            p.copy_(0.5 + 0.1 * torch.randn(p.shape, generator=g))
        elif "norm" in name or name.endswith("router.scale") or name.endswith("per_expert_scale"):
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        elif name.endswith("embed_tokens.weight"):
            p.copy_(torch.randn(p.shape, generator=g) * (4.0 / p.shape[1] ** 0.5))
        elif p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)

def write_hf_checkpoint(cfg: Gemma4Config, path, dtype: torch.dtype, seed: int = 0):
    """Random HF Gemma4ForCausalLM saved with save_pretrained into `path`; returns `path`."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    hf = Gemma4ForCausalLM(Gemma4TextConfig(**cfg.to_hf_text_config()))
    perturb_hf_model(hf, seed)
    hf.to(dtype).save_pretrained(path)
    return path

FP32_EAGER = "g4rt_fp32_eager"

def _register_fp32_eager() -> None:
    """HF's own eager attention (its mask, GQA repeat, softmax) run on fp32 copies of q/k/v, the
    output cast back. In fp32 this *is* HF eager; in bf16 it matches what g4rt's `attend` (and any
    real kernel) does: fp32 scores and accumulation. Plain bf16 eager rounds the scores to bf16 and
    SDPA's CPU kernel rounds probabilities to bf16, which a random tiny model amplifies into
    different greedy tokens, hiding real bugs behind rounding noise."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.gemma4.modeling_gemma4 import eager_attention_forward

    def fp32_eager(module, query, key, value, attention_mask, **kw):
        mask = attention_mask.float() if attention_mask is not None else None
        out, w = eager_attention_forward(module, query.float(), key.float(), value.float(), mask, **kw)
        return out.to(query.dtype), w

    AttentionInterface.register(FP32_EAGER, fp32_eager)
    AttentionMaskInterface.register(FP32_EAGER, eager_mask)

def load_hf(path, dtype: torch.dtype):
    """The HF reference: with-cache path, fp32-accumulating eager attention (see `_register_fp32_eager`)
    and the eager experts loop (HF's default grouped_mm sums experts in another order)."""
    from transformers import Gemma4ForCausalLM

    _register_fp32_eager()
    return Gemma4ForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=FP32_EAGER,
                                             experts_implementation="eager").eval()

@torch.no_grad()
def hf_generate(hf, prompt: list[int], steps: int, forced: list[int] | None = None):
    """Prefill then `steps` one-token decode steps through HF's with-cache path.

    Returns (prefill logits [S, V] fp32, decode logits [steps, V] fp32, the tokens fed/generated).
    Tokens are HF's greedy choices unless `forced` gives them.
    """
    out = hf(input_ids=torch.tensor([prompt]), use_cache=True)
    prefill = out.logits[0].float()
    cache, last, decode, tokens = out.cache, out.logits[0, -1], [], []
    for i in range(steps):
        tok = forced[i] if forced is not None else int(last.float().argmax())
        tokens.append(tok)
        out = hf(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True)
        cache, last = out.cache, out.logits[0, -1]
        decode.append(last.float())
    return prefill, torch.stack(decode), tokens


# ---- measured numbers --------------------------------------------------------------------------
# Tests that measure something (differences against HF, ORT, the compiled engine, export memory)
# record it with the `report` fixture; pytest prints every line in a "measured" section at the end
# of `make test`, so the numbers quoted in notes come from a committed command.
_MEASURED: list[str] = []


@pytest.fixture
def report():
    return _MEASURED.append


def pytest_terminal_summary(terminalreporter):
    if _MEASURED:
        terminalreporter.section("measured")
        for line in _MEASURED:
            terminalreporter.write_line(line)
