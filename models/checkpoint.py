"""Load Hugging Face Gemma 4 safetensors checkpoints into `Gemma4Model`, and write seeded random ones.

Accepted layouts: one `model.safetensors`, or shards listed in `model.safetensors.index.json`.
Tensor names are HF's, under `model.language_model.` (the multimodal `Gemma4ForConditionalGeneration`
release) or `model.` (a text-only `Gemma4ForCausalLM` save). Silently skipped: vision/audio tensors,
and the dead k_proj/v_proj/k_norm of KV-shared layers. A tied `lm_head.weight`, if stored, must equal
`embed_tokens.weight`. Anything else that is missing, unexpected or mis-shaped is a `CheckpointError`
naming the tensor.

All names and shapes are checked from the safetensors headers before any data is read. The model is
built on the meta device, allocated once (`to_empty`) and filled one tensor at a time, so loading
never holds two copies of the weights.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import Gemma4Config, load_config
from ..plugins.ops import default_kernels
from .layout import torch_dtype
from .model import Gemma4Model

PREFIXES = ("model.language_model.", "model.")
IGNORED_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")
DEAD_SHARED = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight")


class CheckpointError(ValueError):
    pass


def to_dtype(dtype: str | torch.dtype | None, cfg: Gemma4Config) -> torch.dtype:
    """The weights' dtype: `dtype`, or the config's."""
    try:
        return torch_dtype(dtype or cfg.dtype)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def checkpoint_files(ckpt_dir: Path) -> dict[str, Path]:
    """tensor name -> shard file. Reads the index when present, else the single file's header."""
    index = ckpt_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map")
        files = {name: ckpt_dir / fn for name, fn in weight_map.items()}
        for p in set(files.values()):
            if not p.is_file():
                raise CheckpointError(f"{index}: shard {p.name} is missing")
        return files
    single = ckpt_dir / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{ckpt_dir}: neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def _dead_shared_names(cfg: Gemma4Config) -> set[str]:
    return {f"layers.{i}.{n}" for i in range(cfg.first_kv_shared_layer, cfg.num_hidden_layers) for n in DEAD_SHARED}


def _by_file(plan: dict) -> dict[Path, list[str]]:
    """Group model names by shard so each file is opened once."""
    out: dict[Path, list[str]] = {}
    for name, (path, _) in plan.items():
        out.setdefault(path, []).append(name)
    return out


def plan_load(cfg: Gemma4Config, files: dict[str, Path], expected: dict[str, tuple[int, ...]]):
    """Map checkpoint names to model names and check them against `expected` (name -> shape).

    Returns (model name -> (file, checkpoint name), stored lm_head location or None).
    """
    dead = _dead_shared_names(cfg)
    plan, lm_head, unexpected = {}, None, []
    for ck_name, path in files.items():
        if ck_name.startswith(IGNORED_PREFIXES):
            continue
        if ck_name == "lm_head.weight":
            lm_head = (path, ck_name)
            continue
        prefix = next((p for p in PREFIXES if ck_name.startswith(p)), None)
        name = ck_name[len(prefix):] if prefix else None
        if name in dead:
            continue
        if name not in expected or name in plan:
            unexpected.append(ck_name)
            continue
        plan[name] = (path, ck_name)
    if unexpected:
        raise CheckpointError(f"unexpected tensor(s) in checkpoint: {', '.join(sorted(unexpected))}")
    missing = sorted(set(expected) - set(plan))
    if missing:
        # Name them as this checkpoint would: with the prefix its other tensors use.
        prefix = next((ck[:-len(n)] for n, (_, ck) in plan.items()), PREFIXES[-1])
        raise CheckpointError(f"missing tensor(s) in checkpoint: {', '.join(prefix + n for n in missing)}")
    if lm_head is not None and not cfg.tie_word_embeddings:
        raise CheckpointError("lm_head.weight: untied output embeddings are not supported")
    for path, names in _by_file(plan).items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                found = tuple(f.get_slice(plan[name][1]).get_shape())
                if found != tuple(expected[name]):
                    raise CheckpointError(f"tensor {plan[name][1]}: expected shape {tuple(expected[name])}, "
                                          f"found {found}")
    return plan, lm_head


def model_shapes(cfg: Gemma4Config) -> dict[str, torch.Size]:
    """Every tensor of `Gemma4Model(cfg)` by name, in state-dict order, with its shape."""
    return {k: v.shape for k, v in Gemma4Model(cfg, device="meta").state_dict().items()}


def _allocate(model: Gemma4Model, device) -> dict[str, torch.Tensor]:
    """Allocate a meta-device model once on `device`; its tensors by name, to be filled in place."""
    model.to_empty(device=device)
    model.reset_rope()
    return dict(model.state_dict(keep_vars=True))


@torch.no_grad()
def load_model(ckpt_dir: str | Path, dtype: str | torch.dtype | None = None, device="cpu",
               kernels: str | None = None, kv_dtype: str | torch.dtype | None = None) -> Gemma4Model:
    """Build a `Gemma4Model` for `ckpt_dir/config.json` and fill it from the safetensors in `ckpt_dir`.
    `model.config` is the parsed `Gemma4Config`; `kernels` and `kv_dtype` as `Gemma4Model` takes them."""
    cfg = load_config(ckpt_dir)
    return load_into(Gemma4Model(cfg, dtype=to_dtype(dtype, cfg), device="meta", kv_dtype=kv_dtype), cfg, ckpt_dir,
                     device, kernels)


@torch.no_grad()
def load_into(model: Gemma4Model, cfg: Gemma4Config, ckpt_dir: str | Path, device, kernels: str | None,
              take=None) -> Gemma4Model:
    """Fill `model`, built on the meta device, from the checkpoint of `cfg` in `ckpt_dir`. Names and
    full shapes are checked from the headers before `model` is allocated on `device`. `take(name, t)`
    is the part of the full tensor `t` (a safetensors slice, which then reads only that part) that
    `model` holds: a tensor-parallel rank's (models/parallel.py); default the whole tensor."""
    ckpt_dir = Path(ckpt_dir)
    plan, lm_head = plan_load(cfg, checkpoint_files(ckpt_dir), model_shapes(cfg))
    targets = _allocate(model, device)

    def read(f, key, name):
        return f.get_tensor(key) if take is None else take(name, f.get_slice(key))

    for path, names in _by_file(plan).items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                targets[name].copy_(read(f, plan[name][1], name))
    if lm_head is not None:
        with safe_open(lm_head[0], framework="pt") as f:
            head = read(f, lm_head[1], "embed_tokens.weight")
        if head.shape != model.embed_tokens.weight.shape or not torch.equal(
                head.to(model.embed_tokens.weight), model.embed_tokens.weight):
            raise CheckpointError("lm_head.weight: stored, but differs from embed_tokens.weight (config says tied)")
    del targets  # the module alone holds its weights now: those packing replaces are freed (_ready)
    return _ready(model, device, kernels)


def _ready(model: Gemma4Model, device, kernels: str | None) -> Gemma4Model:
    """Eval mode, kernels for the final device; on CUDA, q/k/v and gate/up packed into one matmul each
    (Gemma4Model.pack_weights), which the eager and the compiled engine then share. The weights packing
    replaces must be held by the module alone (the loaders drop their own references first), so that
    they are freed as it goes (else the 31B's 35.9 GiB of them stay beside its packed copies: 93 GiB
    at the peak for a 57.2 GiB model), and go back to the device at once: torch's allocator would keep
    them cached, where the KV arena, allocated outside it (runtime/arena.py), cannot use them, so an
    arena sized to the memory left (the 31B's 48 GiB on an H200) would fail to allocate."""
    model.eval()
    model.set_kernels(kernels or default_kernels(device))
    if next(model.parameters()).is_cuda:
        model.pack_weights()
        torch.cuda.empty_cache()
    return model


# ---- random checkpoints --------------------------------------------------------------------------

INITS = ("default", "deep")
# The post-norms whose outputs are added to the residual stream: their weights set each branch's size.
BRANCH_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight",
                "post_per_layer_input_norm.weight")


def check_init(init: str) -> str:
    """`init` if it names a set of init rules (`INITS`), else a ValueError naming the field."""
    if init not in INITS:
        raise ValueError(f"init: {init!r} is not one of {', '.join(INITS)}")
    return init


def _random_tensor(name: str, shape: torch.Size, cfg: Gemma4Config, g: torch.Generator,
                   init: str = "default") -> torch.Tensor:
    """Init scales that keep activations sane and make bugs visible: norms and scales are perturbed
    away from 1 (a "1 + w" bug or a dropped scale changes the output), projections ~ 1/sqrt(fan_in),
    embeddings large enough that logits spread over a few units (clear greedy choices).

    `init="deep"` (DESIGN.md, "Random weights: two inits") changes five kinds of tensor so that a
    full-depth model is not chaotic: layer_scalar near 1 (the stream is not shrunk every layer), residual
    branches at 0.3 of the default (each layer turns the stream a little), softer q/k norms, a final
    norm centred on 0 (the stream keeps the token's own embedding, which a positive final norm and the
    tied lm_head would pick again at every step), and router logits spread over a few units (expert
    weights that differ, as a trained router's do)."""
    def normal(std, mean=0.0):
        return torch.randn(shape, generator=g, device=g.device) * std + mean

    def uniform(lo, hi):
        return torch.rand(shape, generator=g, device=g.device) * (hi - lo) + lo

    leaf = name.rsplit(".", 1)[-1]
    if init == "deep":
        if name.endswith("layer_scalar"):
            return uniform(0.97, 1.03)
        if name.endswith(BRANCH_NORMS):
            return normal(0.045, 0.3)
        if name == "norm.weight":
            return normal(1.0)
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            return normal(0.03, 0.3)
        if name.endswith("router.proj.weight"):
            # The router's input has norm ~1 (RMS-normed, times hidden_size**-0.5), so this gives logits
            # of std ~2: the top 8 of 128 experts carry ~60 % of the probability. The default's
            # 3/sqrt(fan_in) gives 0.06 at real width, 128 nearly equal probabilities and weights.
            return normal(2.0)
    if name.endswith("layer_scalar"):
        return uniform(0.5, 1.0)
    if name.endswith("router.per_expert_scale"):
        return uniform(0.5, 1.5)
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        # Unit-RMS q and k with scale 1.0 give q.k a spread of sqrt(head_dim) (16-22 at 256/512): a
        # near-argmax softmax in every layer, which makes a deep random model chaotic (any rounding
        # difference flips it). ~0.5 keeps random softmaxes soft, as trained q/k norms do.
        return normal(0.05, 0.5)
    if name.endswith("router.scale") or ("norm" in name and leaf == "weight"):
        return normal(0.15, 1.0)
    if name == "embed_tokens.weight":
        return normal(4.0 / cfg.hidden_size ** 0.5)
    if name == "embed_tokens_per_layer.weight":
        return normal(1.0 / cfg.hidden_size_per_layer_input ** 0.5)
    if name.endswith("router.proj.weight"):
        return normal(3.0 / shape[-1] ** 0.5)
    return normal(1.0 / shape[-1] ** 0.5)  # Linear [out, in] and expert [E, out, in]: fan_in last


def hf_config_dict(cfg: Gemma4Config, dtype: str) -> dict:
    """A text-only HF config.json (`Gemma4ForCausalLM`)."""
    d = cfg.to_hf_text_config()
    d["dtype"] = dtype
    d["architectures"] = ["Gemma4ForCausalLM"]
    return d


def write_random_checkpoint(cfg: Gemma4Config, out_dir: str | Path, seed: int = 0, dtype: str = "bfloat16",
                            init: str = "default") -> Path:
    """Write config.json + model.safetensors (HF text-only layout, names under `model.`) with seeded
    random weights. Deterministic for a given (cfg, seed, dtype, init). Meant for small configs."""
    check_init(init)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {f"model.{name}": _random_tensor(name, shape, cfg, g, init).to(torch_dtype(dtype)).contiguous()
               for name, shape in model_shapes(cfg).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg, dtype), indent=2) + "\n")
    return out


@torch.no_grad()
def random_model(cfg: Gemma4Config, dtype: torch.dtype = torch.bfloat16, device="cpu", seed: int = 0,
                 kernels: str | None = None, init: str = "default",
                 kv_dtype: str | torch.dtype | None = None) -> Gemma4Model:
    """A model with seeded random weights drawn directly on `device` (same init rules as
    `write_random_checkpoint`; `kv_dtype` as `Gemma4Model` takes it). GPU benchmarks of the published sizes use
    it: a 31B checkpoint file would be 61 GB written and read back for nothing."""
    return random_into(Gemma4Model(cfg, dtype=dtype, device="meta", kv_dtype=kv_dtype), cfg, device, seed, kernels,
                       init)


@torch.no_grad()
def random_into(model: Gemma4Model, cfg: Gemma4Config, device, seed: int, kernels: str | None, init: str,
                take=None) -> Gemma4Model:
    """Fill `model`, built on the meta device, with `random_model(cfg, ..., seed, init=init)`'s values:
    every full tensor drawn in order from one generator on `device`, one at a time, then `take(name, t)`
    of it (the part `model` holds, as for `load_into`; default the whole)."""
    check_init(init)
    targets = _allocate(model, device)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, shape in model_shapes(cfg).items():
        whole = _random_tensor(name, shape, cfg, g, init)
        targets[name].copy_(whole if take is None else take(name, whole))
    del targets, whole  # as in load_into
    return _ready(model, device, kernels)
