"""The models package's contracts that no other test file owns: config values of the wrong kind, the
elementwise blocks' table, the greedy reference generation, and what the kernel source hash covers."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from g4rt.models import manifest as mf
from g4rt.models.config import CONFIG_DIR, ConfigError, config_from_dict, load_config


def _config_file(tmp_path: Path, **text) -> Path:
    raw = json.loads((CONFIG_DIR / "31b.json").read_text())
    raw["text_config"].update(text)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("key, value, kind", [
    ("rms_norm_eps", "abc", "a number"),
    ("final_logit_softcapping", "x", "a number"),
    ("rms_norm_eps", True, "a number"),  # JSON true is no number, though Python counts it as 1
    ("attention_k_eq_v", "no", "true or false"),  # a truthy string would turn k_eq_v on
    ("enable_moe_block", 1, "true or false"),
    ("tie_word_embeddings", "yes", "true or false"),
    ("hidden_activation", 3, "a string"),
    ("dtype", 16, "a string"),
    ("hidden_size", 5376.0, "an integer"),
    ("num_experts", False, "an integer"),
])
def test_a_value_of_the_wrong_kind_names_the_file_and_key(tmp_path, key, value, kind):
    path = _config_file(tmp_path, **{key: value})
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: key {key!r} must be {kind}, got {value!r}"


@pytest.mark.parametrize("text, message", [
    ({"layer_types": "sliding_attention"}, "key 'layer_types' must be a list of layer types"),
    ({"rope_parameters": {"full_attention": {"rope_theta": "1e6"}}},
     "key 'rope_parameters.full_attention.rope_theta' must be a number, got '1e6'"),
    ({"rope_parameters": {"sliding_attention": 10000.0}}, "key 'rope_parameters.sliding_attention' must be an object"),
    ({"eos_token_id": [1, "106"]}, "key 'eos_token_id' must be an integer or a list of integers"),
    ({"torch_dtype": 2}, "key 'torch_dtype' must be a string, got 2"),
])
def test_nested_values_of_the_wrong_kind_name_their_key(text, message):
    raw = {**json.loads((CONFIG_DIR / "31b.json").read_text())["text_config"], **text}
    raw.pop("dtype", None)
    with pytest.raises(ConfigError, match=f"^cfg.json: {message}"):
        config_from_dict(raw, "cfg.json")


def test_numbers_take_json_integers_and_configs_load_as_before():
    raw = json.loads((CONFIG_DIR / "31b.json").read_text())
    raw["text_config"].update(final_logit_softcapping=30, rms_norm_eps=1)
    cfg = config_from_dict(raw)
    assert (cfg.final_logit_softcapping, cfg.rms_norm_eps) == (30, 1)
    for name in ("e2b", "e4b", "26b-a4b", "31b", CONFIG_DIR / "tiny.json"):
        assert load_config(name).hidden_size > 0


def test_first_layers_keep_the_pattern_and_name_a_bad_count():
    whole = load_config("31b")
    half = whole.first_layers(30)
    assert (half.num_hidden_layers, half.layer_types) == (30, whole.layer_types[:30])
    assert [half.layer_head_dim(i) for i in range(30)] == [whole.layer_head_dim(i) for i in range(30)]
    assert load_config("e2b").first_layers(20).num_kv_shared_layers == 0  # no layer past the cut to share with
    for n in (0, 61):
        with pytest.raises(ConfigError, match=rf"n must be in \[1, num_hidden_layers = 60\], got {n}"):
            whole.first_layers(n)


@pytest.mark.parametrize("text, message", [
    ({"hidden_activation": "relu"}, "hidden_activation must be gelu_pytorch_tanh or gelu_tanh .*, got 'relu'"),
    ({"num_kv_shared_layers": 60}, r"num_kv_shared_layers must be in \[0, num_hidden_layers = 60\), got 60"),
    ({"enable_moe_block": True, "num_experts": 8},
     "enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size, got 8, None and None"),
    ({"layer_types": ["sliding_attention"] * 59 + ["global"]}, r"layer_types\[59\]: unknown layer type 'global'"),
])
def test_inconsistent_values_name_the_file_and_the_value(tmp_path, text, message):
    path = _config_file(tmp_path, **text)
    with pytest.raises(ConfigError, match=f"^{path}: {message}"):
        load_config(path)
    assert load_config("31b").hidden_activation == "gelu_pytorch_tanh"


def test_every_block_is_an_op_the_model_calls():
    """`blocks.REFERENCE` names the elementwise blocks the model runs through `block(...)`, each a `g4rt::` op
    with the Triton kernels; the residual step alone (`add_normed`) is part of the others, not an op."""
    from g4rt.models import blocks
    from g4rt.plugins import triton_gemv, triton_moe, triton_norm  # noqa: F401  (register the ops)

    assert "add_normed" not in blocks.REFERENCE and not hasattr(torch.ops.g4rt, "add_normed")
    assert all(hasattr(torch.ops.g4rt, name) for name in blocks.REFERENCE)
    source = (Path(blocks.__file__).parent / "model.py").read_text()
    assert {name for name in blocks.REFERENCE if f'block("{name}"' not in source} == set()


def test_generate_linear_takes_the_first_argmax_of_each_step():
    """The linear reference generates greedily: each token is the first argmax of the logits that chose it
    (the oracle the runtime's greedy tokens are compared with; sampling is runtime/sampling.py's)."""
    from conftest import tiny_config

    from g4rt.models import linear_cache
    from g4rt.models.model import Gemma4Model

    torch.manual_seed(0)
    model = Gemma4Model(tiny_config("31b"), torch.float32, "cpu")
    tokens, logits = linear_cache.generate_linear(model, [2, 5, 9], 4, return_logits=True)
    assert len(tokens) == 4 and tokens == logits.argmax(-1).tolist()


_SKIP = shutil.ignore_patterns("results", "__pycache__")


def test_kernel_source_hash_covers_what_a_plan_compiles_in(tmp_path):
    """A plan compiles in trt_kernels' wrappers, the kernels they import (transitively) and trt_plugins' launch
    parameters; editing any other plugin file (the sampler, the Gluon matmul, the ops) leaves every built plan
    valid, and a kernel moved into a new module is still hashed."""
    plugins = Path(mf.__file__).resolve().parent.parent / "plugins"
    sources = mf.plan_sources()
    assert {"trt_kernels.py", "trt_plugins.py", "triton_attention.py", "triton_kv_write.py"} <= set(sources)
    assert not {"triton_sampling.py", "gluon_gemv.py", "ops.py"} & set(sources)
    copy = tmp_path / "plugins"
    shutil.copytree(plugins, copy, ignore=_SKIP)
    want = mf.kernel_source_hash()
    assert mf.kernel_source_hash(copy) == want
    for name in ("triton_sampling.py", "gluon_gemv.py", "ops.py", "README.md"):
        (copy / name).write_text((copy / name).read_text() + "\n# an edit\n")
    assert mf.kernel_source_hash(copy) == want
    for name in sources:
        edited = tmp_path / name
        shutil.copytree(plugins, edited, ignore=_SKIP)
        (edited / name).write_text((edited / name).read_text() + "\n# an edit\n")
        assert mf.kernel_source_hash(edited) != want, name
    moved = tmp_path / "moved"  # the attention kernel's helpers in a module of their own, imported lazily
    shutil.copytree(plugins, moved, ignore=_SKIP)
    (moved / "attn_helpers.py").write_text("X = 1\n")
    attention = moved / "triton_attention.py"
    attention.write_text(attention.read_text() + "\n\ndef _later():\n    from .attn_helpers import X\n    return X\n")
    assert "attn_helpers.py" in mf.plan_sources(moved)
    before = mf.kernel_source_hash(moved)
    (moved / "attn_helpers.py").write_text("X = 2\n")
    assert mf.kernel_source_hash(moved) != before


@pytest.mark.parametrize("symbol, flags", [("tokens", "a larger --max-batched-tokens"),
                                           ("sliding_pages", "--chunk, --max-model-len and --max-frames"),
                                           ("full_pages", "--max-model-len and --max-frames")])
def test_a_step_outside_the_profile_names_every_flag_behind_its_bound(symbol, flags):
    """A sliding table's bound is the least of what the chunk, the model length and the arena allow
    (derive_profiles), so the refusal names all three, not only --chunk."""
    from g4rt.models.profiles import ProfileError, check_step

    with pytest.raises(ProfileError, match=f"{symbol} = 9, outside the engine's profile \\[1, 3\\]; .*{flags}"):
        check_step({symbol: [1, 2, 3]}, {symbol: 9})
