"""Checkpoint loading: HF layouts that must load, and broken ones that must fail naming the tensor."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import tiny_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from g4rt.models.checkpoint import CheckpointError, load_model, write_random_checkpoint
from g4rt.models.linear_cache import LinearCache


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """E2B-like (PLE, KV sharing) random checkpoint, fp32."""
    return write_random_checkpoint(tiny_config("e2b"), tmp_path_factory.mktemp("ckpt"), seed=0, dtype="float32")


def rewrite(src, dst, edit):
    """Copy checkpoint `src` to `dst` with its tensors passed through `edit(dict) -> dict`."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(edit(load_file(src / "model.safetensors")), str(dst / "model.safetensors"))
    return dst


def assert_matches_files(model, src):
    tensors = load_file(src / "model.safetensors")
    sd = model.state_dict()
    assert set(sd) == {k.removeprefix("model.") for k in tensors}
    for name, t in tensors.items():
        assert torch.equal(sd[name.removeprefix("model.")], t), name


def test_random_checkpoint_round_trips(ckpt, tmp_path):
    model = load_model(ckpt, dtype=torch.float32)
    assert_matches_files(model, ckpt)
    assert model.config == tiny_config("e2b")
    # Seeded and deterministic; another seed gives other weights.
    again = write_random_checkpoint(tiny_config("e2b"), tmp_path / "again", seed=0, dtype="float32")
    other = write_random_checkpoint(tiny_config("e2b"), tmp_path / "other", seed=1, dtype="float32")
    read = lambda d: (d / "model.safetensors").read_bytes()  # noqa: E731
    assert read(again) == read(ckpt) and read(other) != read(ckpt)
    # Scales are perturbed away from their defaults (so formula bugs show) but stay sane.
    ls = torch.stack([b for n, b in model.named_buffers() if n.endswith("layer_scalar")])
    assert ((ls >= 0.5) & (ls <= 1.0)).all() and ls.std() > 0
    assert not torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))


def test_hf_loads_random_checkpoint_and_agrees(ckpt):
    from transformers import Gemma4ForCausalLM

    hf, info = Gemma4ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager",
                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    model = load_model(ckpt, dtype=torch.float32)
    ids = torch.arange(3, 19)
    cache = LinearCache()
    cache.begin_step([0], [len(ids)])
    ours = model.logits(model(ids, torch.arange(len(ids)), cache))
    with torch.no_grad():
        ref = hf(input_ids=ids[None], use_cache=True).logits[0].float()
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_multimodal_prefix_ignored_tensors_and_tied_head(ckpt, tmp_path):
    """The published layout: `model.language_model.` names, vision/audio towers, dead k/v weights
    on KV-shared layers, and a stored (tied) lm_head."""
    cfg = tiny_config("e2b")
    shared = cfg.first_kv_shared_layer

    def edit(t):
        out = {k.replace("model.", "model.language_model.", 1): v for k, v in t.items()}
        out["model.vision_tower.encoder.weight"] = torch.zeros(2, 2)
        out["model.embed_audio.proj.weight"] = torch.zeros(2)
        out[f"model.language_model.layers.{shared}.self_attn.k_proj.weight"] = torch.zeros(32, 64)
        out[f"model.language_model.layers.{shared}.self_attn.k_norm.weight"] = torch.zeros(32)
        out["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
        return out

    d = rewrite(ckpt, tmp_path / "mm", edit)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({"architectures": ["Gemma4ForConditionalGeneration"],
                                               "model_type": "gemma4", "text_config": raw}))
    assert_matches_files(load_model(d, dtype=torch.float32), ckpt)


@pytest.mark.parametrize("case,needle", [
    ("missing", "model.layers.2.self_attn.q_norm.weight"),
    ("shape", "model.layers.1.mlp.up_proj.weight"),
    ("prefix", "transformer.embed_tokens.weight"),
    ("unexpected", "model.layers.0.self_attn.extra.weight"),
    ("untied_head", "lm_head.weight"),
])
def test_broken_checkpoints_name_the_tensor(ckpt, tmp_path, case, needle):
    def edit(t):
        if case == "missing":
            del t[needle]
        elif case == "shape":
            t[needle] = t[needle][:-1].clone()
        elif case == "prefix":
            t = {k.replace("model.", "transformer.", 1): v for k, v in t.items()}
        elif case == "unexpected":
            t[needle] = torch.zeros(3)
        elif case == "untied_head":
            t[needle] = t["model.embed_tokens.weight"] + 1.0
        return t

    d = rewrite(ckpt, tmp_path / case, edit)
    with pytest.raises(CheckpointError) as e:
        load_model(d, dtype=torch.float32)
    msg = str(e.value)
    assert needle in msg
    if case == "shape":
        up = tiny_config("e2b").layer_intermediate(1)
        assert f"({up}, 64)" in msg and f"({up - 1}, 64)" in msg


def test_sharded_index(ckpt, tmp_path):
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    d = tmp_path / "sharded"
    d.mkdir()
    shutil.copy(ckpt / "config.json", d / "config.json")
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fn = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(d / fn))
        weight_map.update({n: fn for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert_matches_files(load_model(d, dtype=torch.float32), ckpt)
    # A shard listed in the index but absent is named.
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002"):
        load_model(d)


def test_bf16_file_loads_as_requested_dtype(tmp_path):
    d = write_random_checkpoint(tiny_config("26b"), tmp_path, seed=4, dtype="bfloat16")
    with safe_open(d / "model.safetensors", framework="pt") as f:
        assert f.get_tensor("model.layers.0.experts.gate_up_proj").dtype == torch.bfloat16
    m32 = load_model(d, dtype=torch.float32)
    mdef = load_model(d)  # config dtype
    assert m32.layers[0].experts.gate_up_proj.dtype == torch.float32
    assert mdef.layers[0].experts.gate_up_proj.dtype == torch.bfloat16
    assert m32.sliding_inv_freq.dtype == torch.float32 and mdef.full_inv_freq.dtype == torch.float32
    assert torch.equal(m32.layers[0].experts.gate_up_proj.bfloat16(), mdef.layers[0].experts.gate_up_proj)


@pytest.mark.parametrize("variant", ["e2b", "31b"])
def test_packed_weights_keep_names_values_and_outputs(variant, tmp_path):
    """pack_weights (done on CUDA at load): q/k/v weights become views of one packed weight and gate/up
    of another, the state dict keeps HF's names and values, KV-shared and k_eq_v layers are handled,
    and the outputs agree."""
    src = write_random_checkpoint(tiny_config(variant), tmp_path, seed=1, dtype="float32")
    plain, packed = load_model(src), load_model(src)
    packed.pack_weights()
    assert_matches_files(packed, src)
    for before, layer in zip(plain.layers, packed.layers):
        mlp = layer.mlp
        assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_up_weight.untyped_storage().data_ptr()
        assert torch.equal(mlp.gate_up_weight, torch.cat([before.mlp.gate_proj.weight, before.mlp.up_proj.weight]))
        attn = layer.self_attn
        if attn.k_proj is None:  # KV-shared: q only, nothing to pack
            assert attn.qkv_weight is None
            continue
        assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
        assert attn.qkv_weight.shape[0] == sum(m.weight.shape[0] for m in (attn.q_proj, attn.k_proj, attn.v_proj)
                                               if m is not None)
    ids = torch.arange(3, 30)
    out = []
    for model in (plain, packed):
        cache = LinearCache()
        cache.begin_step([0], [len(ids)])
        with torch.inference_mode():
            out.append(model.logits(model(ids, torch.arange(len(ids)), cache)))
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loader", ["load_model", "random_model"])
def test_the_weights_packing_replaces_are_freed(loader, ckpt, monkeypatch):
    """When the loaders pack (on CUDA, `_ready`), the module alone holds the weights packing replaces, so
    they are freed (and the caller's empty_cache returns them to the device): any other reference to them,
    a loader's own table of them say, keeps them alive beside the packed copies (35.9 GiB on the 31B)."""
    import weakref

    from g4rt.models import checkpoint

    alive = []

    def ready_and_pack(model, device, kernels):
        mlp = model.layers[0].mlp
        originals = [weakref.ref(w) for w in (mlp.gate_proj.weight, mlp.up_proj.weight)]
        model.pack_weights()
        alive.extend(r() is not None for r in originals)  # still inside the loader, as on CUDA
        return model
    monkeypatch.setattr(checkpoint, "_ready", ready_and_pack)
    if loader == "load_model":
        model = checkpoint.load_model(ckpt)
    else:
        model = checkpoint.random_model(tiny_config("e2b"))
    assert model.layers[0].mlp.gate_up_weight is not None
    assert alive == [False, False], "a replaced weight is still referenced while the loader packs"
