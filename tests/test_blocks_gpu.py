"""The arena stored by blocks (PageGeometry's `block`) with the kernels compiled for the GPU: the decode, prefill and
KV-write kernels read and write a block's frames unit by unit, and the tokens and logits are the bits of the arena a
frame a row. A model of the 31B's head dims (sliding 256, full 512) in bf16 and both arenas, so the decode runs the
tiles the engine runs. On CPU the interpreter runs the same comparison on a small model
(tests/test_runtime_equality.py). Skipped without CUDA (the GPU session runs it)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the triton extra is not installed")

from g4rt.models.checkpoint import load_model, write_random_checkpoint  # noqa: E402
from g4rt.models.config import Gemma4Config  # noqa: E402
from g4rt.plugins import launch  # noqa: E402
from g4rt.runtime.llm import LLM  # noqa: E402
from g4rt.runtime.sampling import SamplingParams  # noqa: E402
from g4rt.runtime.scheduler import SchedulerConfig  # noqa: E402

pytestmark = pytest.mark.skipif(
    launch.interpreting() or not torch.cuda.is_available(),
    reason="the compiled kernels on a CUDA GPU (the interpreter's run: test_runtime_equality.py)")

S, F = "sliding_attention", "full_attention"


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_blocks_give_the_bits_of_a_frame_a_row(tmp_path, kv_dtype):
    cfg = Gemma4Config(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=8,
                       num_key_value_heads=4, num_global_key_value_heads=1, attention_k_eq_v=True,
                       head_dim=256, global_head_dim=512, vocab_size=512, sliding_window=64,
                       layer_types=(S, S, F, S, S, F), eos_token_ids=(1,))
    model = load_model(write_random_checkpoint(cfg, tmp_path, seed=7), device="cuda", kernels="triton",
                       kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 130, 40, 300, 1, 77, 64, 200)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=t, seed=s)
              for n, t, s in ((40, 0.0, None), (25, 0.8, 5), (33, 0.0, None), (20, 1.0, 8))] * 2
    sched = SchedulerConfig(max_num_batched_tokens=128, chunk=64)
    outs = []
    for block in (1, 8, 0):  # 0: one block of all 128 frames, each layer's pages in a region of their own
        llm = LLM.paged(model, num_frames=128, frame_block=block or 128, config=sched, shuffle_seed=11,
                        record_logits=True)
        outs.append(llm.generate(prompts, params))
        assert llm.pool.num_free == 128 and llm.pool.reserved == 0, "pages leaked"
    for other in outs[1:]:
        for x, y in zip(outs[0], other):
            assert x.token_ids == y.token_ids
            assert all(torch.equal(a, b) for a, b in zip(x.logits, y.logits)), "logits differ"
