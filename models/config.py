"""Gemma 4 text configuration, read from a Hugging Face `config.json`.

One frozen dataclass holds exactly the keys the text decoder uses. It accepts the multimodal
wrapper (`Gemma4ForConditionalGeneration`, keys under `text_config`) and a text-only file alike.
Unknown keys are ignored (the checkpoints carry many vision/audio keys); a missing required key or a
value of the wrong kind is an error that names the key.
"""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"
PUBLISHED = {"e2b": "e2b.json", "e4b": "e4b.json", "26b-a4b": "26b-a4b.json", "31b": "31b.json"}

SLIDING = "sliding_attention"
FULL = "full_attention"


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Gemma4Config:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int = 262144
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    attention_k_eq_v: bool = False
    sliding_window: int = 512
    layer_types: tuple[str, ...] = ()
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 262144
    enable_moe_block: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    max_position_embeddings: int = 131072
    rope_local_base: float = 10000.0
    rope_global_base: float = 1000000.0
    rope_global_partial_factor: float = 0.25
    final_logit_softcapping: float | None = 30.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    hidden_activation: str = "gelu_pytorch_tanh"
    pad_token_id: int = 0
    bos_token_id: int = 2
    eos_token_ids: tuple[int, ...] = (1,)
    dtype: str = "bfloat16"

    def __post_init__(self):
        if not self.layer_types:
            # HF's default pattern: every sixth layer is full, and the last layer is always full.
            types = [SLIDING if (i + 1) % 6 else FULL for i in range(self.num_hidden_layers)]
            types[-1] = FULL
            object.__setattr__(self, "layer_types", tuple(types))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}")
        for i, t in enumerate(self.layer_types):
            if t not in (SLIDING, FULL):
                raise ConfigError(f"layer_types[{i}]: unknown layer type {t!r}; expected {SLIDING!r} or {FULL!r}")
        if self.enable_moe_block and not (self.num_experts and self.top_k_experts and self.moe_intermediate_size):
            raise ConfigError(f"enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size, got "
                              f"{self.num_experts!r}, {self.top_k_experts!r} and {self.moe_intermediate_size!r}")
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ConfigError(f"hidden_activation must be gelu_pytorch_tanh or gelu_tanh (both the tanh-approximated "
                              f"GELU, the one activation the model computes), got {self.hidden_activation!r}")
        if not 0 <= self.num_kv_shared_layers < self.num_hidden_layers:
            raise ConfigError(f"num_kv_shared_layers must be in [0, num_hidden_layers = {self.num_hidden_layers}), got "
                              f"{self.num_kv_shared_layers}")

    # ---- derived facts, named once --------------------------------------------------------
    @property
    def has_ple(self) -> bool:
        return self.hidden_size_per_layer_input > 0

    @property
    def first_kv_shared_layer(self) -> int:
        """Index of the first layer that reads another layer's K/V (== num layers when none do)."""
        return self.num_hidden_layers - self.num_kv_shared_layers

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def layer_head_dim(self, layer: int) -> int:
        return self.head_dim if self.is_sliding(layer) else self.global_head_dim

    def layer_k_eq_v(self, layer: int) -> bool:
        return self.attention_k_eq_v and not self.is_sliding(layer)

    def layer_kv_heads(self, layer: int) -> int:
        if self.layer_k_eq_v(layer) and self.num_global_key_value_heads:
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    def layer_intermediate(self, layer: int) -> int:
        wide = self.use_double_wide_mlp and self.num_kv_shared_layers > 0 and layer >= self.first_kv_shared_layer
        return self.intermediate_size * (2 if wide else 1)

    def kv_source(self, layer: int) -> int:
        """The layer whose cache `layer` attends over: itself, or for a KV-shared layer the last
        layer of the same type before the shared block (HF `kv_shared_layer_index`)."""
        first = self.first_kv_shared_layer
        if self.num_kv_shared_layers == 0 or layer < first:
            return layer
        same = [i for i in range(first) if self.layer_types[i] == self.layer_types[layer]]
        if not same:
            raise ConfigError(f"layer {layer} is KV-shared but no earlier {self.layer_types[layer]} layer owns a cache")
        return same[-1]

    def first_layers(self, n: int) -> "Gemma4Config":
        """The first `n` layers as a model of their own (the layer pattern kept, no KV-shared layers): a
        shallower model of the same layer shapes, for a bench on a card too small for the whole one (the
        31B at batch 256 on an 80 GB H100), whose per-layer costs are the whole model's."""
        if not 1 <= n <= self.num_hidden_layers:
            raise ConfigError(f"first_layers: n must be in [1, num_hidden_layers = {self.num_hidden_layers}], got {n}")
        return replace(self, num_hidden_layers=n, layer_types=self.layer_types[:n], num_kv_shared_layers=0)

    def to_hf_text_config(self) -> dict:
        """The HF `text_config` dict that reproduces this config (used to write checkpoints)."""
        d = {k: v for k, v in asdict(self).items() if k not in ("eos_token_ids", "rope_local_base", "rope_global_base",
                                                                   "rope_global_partial_factor")}
        d["layer_types"] = list(self.layer_types)
        d["eos_token_id"] = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        d["rope_parameters"] = {
            SLIDING: {"rope_type": "default", "rope_theta": self.rope_local_base},
            FULL: {"rope_type": "proportional", "rope_theta": self.rope_global_base,
                   "partial_rotary_factor": self.rope_global_partial_factor},
        }
        d["model_type"] = "gemma4_text"
        return d


# The kind each scalar key must have, from the field's annotation ("int | None" -> "int"). JSON has one
# number type, so an integer is a float too; a boolean is never a number (Python counts True as 1).
_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}
_KEY_KINDS = {f.name: f.type.removesuffix(" | None") for f in fields(Gemma4Config)
              if f.type.removesuffix(" | None") in _KINDS}


def _is_kind(value, kind: str) -> bool:
    if isinstance(value, bool):
        return kind == "bool"
    return isinstance(value, {"int": int, "float": (int, float), "bool": (), "str": str}[kind])


def _rope_number(rope: dict, layer_type: str, key: str, default: float, source: str) -> float:
    value = rope[layer_type].get(key, default)
    if not _is_kind(value, "float"):
        raise ConfigError(f"{source}: key 'rope_parameters.{layer_type}.{key}' must be a number, got {value!r}")
    return float(value)


_REQUIRED = [f.name for f in fields(Gemma4Config) if f.default is MISSING and f.default_factory is MISSING]


def _per_layer_overrides(text: dict, kw: dict, source: str) -> dict:
    """Read `global_head_dim` / `num_global_key_value_heads` back from HF's `per_layer_config`.

    transformers >= 5.2x pops those two keys into `per_layer_config` (one entry per full layer,
    keys may be zero-padded strings like "05") and `save_pretrained` writes only that. Published
    5.5.0 checkpoints carry the flat keys, which win when present.
    """
    per_layer = text.get("per_layer_config")
    if not isinstance(per_layer, dict) or not per_layer:
        return {}
    entries = {int(k): v for k, v in per_layer.items() if isinstance(v, dict)}
    out = {}
    head_dims = {v["head_dim"] for v in entries.values() if "head_dim" in v}
    if "global_head_dim" not in kw and head_dims:
        if len(head_dims) != 1:
            raise ConfigError(f"{source}: per_layer_config has several head_dim values {sorted(head_dims)}")
        out["global_head_dim"] = head_dims.pop()
    kv = {v["num_key_value_heads"] for v in entries.values() if "num_key_value_heads" in v}
    if "num_global_key_value_heads" not in kw and kv:
        if len(kv) != 1:
            raise ConfigError(f"{source}: per_layer_config has several num_key_value_heads values {sorted(kv)}")
        heads = kv.pop()
        if heads != kw.get("num_key_value_heads") and not kw.get("attention_k_eq_v"):
            raise ConfigError(f"{source}: per_layer_config overrides num_key_value_heads without attention_k_eq_v")
        out["num_global_key_value_heads"] = heads
    return out


def config_from_dict(raw: dict, source: str = "config") -> Gemma4Config:
    """Build a config from a HF config dict (multimodal wrapper or text-only)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: text_config must be an object")
    missing = [k for k in _REQUIRED if text.get(k) is None]
    if missing:
        raise ConfigError(f"{source}: missing required key(s) {', '.join(missing)}")
    known = {f.name for f in fields(Gemma4Config)}
    kw = {k: v for k, v in text.items() if k in known and v is not None}
    for k, kind in _KEY_KINDS.items():
        if k in kw and not _is_kind(kw[k], kind):
            raise ConfigError(f"{source}: key {k!r} must be {_KINDS[kind]}, got {kw[k]!r}")
    if "layer_types" in kw:
        if not isinstance(kw["layer_types"], list):
            raise ConfigError(f"{source}: key 'layer_types' must be a list of layer types, got {kw['layer_types']!r}")
        kw["layer_types"] = tuple(kw["layer_types"])
    kw.update(_per_layer_overrides(text, kw, source))
    rope = text.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{source}: key 'rope_parameters' must be an object, got {rope!r}")
    for layer_type in (SLIDING, FULL):
        if not isinstance(rope.get(layer_type, {}), dict):
            raise ConfigError(f"{source}: key 'rope_parameters.{layer_type}' must be an object, got "
                              f"{rope[layer_type]!r}")
    if SLIDING in rope:
        kw["rope_local_base"] = _rope_number(rope, SLIDING, "rope_theta", 10000.0, source)
    if FULL in rope:
        kw["rope_global_base"] = _rope_number(rope, FULL, "rope_theta", 1e6, source)
        kw["rope_global_partial_factor"] = _rope_number(rope, FULL, "partial_rotary_factor", 0.25, source)
        if rope[FULL].get("rope_type", "proportional") != "proportional":
            raise ConfigError(f"{source}: rope_parameters.full_attention.rope_type must be 'proportional', got "
                              f"{rope[FULL]['rope_type']!r}")
    eos = raw.get("eos_token_id", text.get("eos_token_id", 1))
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    if not eos_ids or not all(_is_kind(i, "int") for i in eos_ids):
        raise ConfigError(f"{source}: key 'eos_token_id' must be an integer or a list of integers, got {eos!r}")
    kw["eos_token_ids"] = eos_ids
    if "dtype" not in kw and text.get("torch_dtype") is not None:
        if not _is_kind(text["torch_dtype"], "str"):
            raise ConfigError(f"{source}: key 'torch_dtype' must be a string, got {text['torch_dtype']!r}")
        kw["dtype"] = text["torch_dtype"]
    try:
        return Gemma4Config(**kw)
    except (TypeError, ConfigError) as e:
        raise ConfigError(f"{source}: {e}") from None


def load_config(path_or_name: str | Path) -> Gemma4Config:
    """Load from a model directory, a config.json path, or a published size name (e2b, e4b, 26b-a4b, 31b)."""
    key = str(path_or_name).lower()
    if key in PUBLISHED:
        p = CONFIG_DIR / PUBLISHED[key]
    else:
        p = Path(path_or_name)
        if p.is_dir():
            p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"no config.json at {p} (and {path_or_name!r} is not one of {', '.join(PUBLISHED)})")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({e})") from None
    return config_from_dict(raw, str(p))
