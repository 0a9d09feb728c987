"""The embedded "tiny" model: what `--model tiny` resolves to.

A Gemma 4 config (models/configs/tiny.json) small enough to generate quickly on a CPU, yet using
every feature of the four published sizes at once: 3:1 sliding/full pattern with different head dims
(32 / 64), window 8, k_eq_v full layers with fewer global KV heads, MoE beside the dense MLP, PLE,
KV sharing (layers 5-7 read layers 4 and 3) with double-wide MLPs, final softcap. Weights are seeded
random (see `checkpoint.write_random_checkpoint`); the tokenizer is a byte-level BPE trained on a
fixed embedded text, so the output is gibberish but deterministic and text prompts work.

`ensure_tiny()` builds it once into `$G4RT_HOME/tiny` (default `~/.cache/g4rt/tiny`). It is safe
against concurrent callers: the files are written into a temporary sibling directory that is renamed
into place, and a directory whose config or init stamp differs (an older build) is rebuilt.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from .checkpoint import hf_config_dict, write_random_checkpoint
from .config import CONFIG_DIR, load_config

TINY_CONFIG = CONFIG_DIR / "tiny.json"
SEED = 1234
# Bump when checkpoint._random_tensor's init rules change: a cached tiny model built under other
# rules has the same config but other weights, and would silently generate other tokens.
INIT_VERSION = 2
STAMP = "g4rt-tiny.json"
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # ids 0, 1, 2, 3 = pad, eos, bos as in Gemma
# Bump when the tokenizer files change (the weights do not depend on them): a cached tiny model is rebuilt.
TOKENIZER_VERSION = 1
# Gemma's turn format (system text folded into the first user turn, "model" for the assistant), so that
# chat completions on the tiny model exercise a real template; the markers are plain text to its BPE.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] in ['system', 'developer'] -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# Training text for the tokenizer: any fixed text works; this one is plain English prose and code.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A tiny model is a small model that runs fast.
Gemma is a family of open models. Each layer reads the residual stream, attends over its cache,
and writes its result back. Sliding layers see a short window; full layers see every position.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris.
Once upon a time there was a little engine that could. It said: I think I can, I think I can.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Dates: 2024-01-31. Prices: $3.50, 12%.
The cache holds keys and values. Pages hold positions. The scheduler batches requests.
"""


def default_tiny_dir() -> Path:
    home = os.environ.get("G4RT_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "g4rt") / "tiny"


def build_tokenizer(vocab_size: int):
    """A deterministic byte-level BPE with Gemma's special ids (pad 0, eos 1, bos 2) that prepends
    <bos>. Every byte is in the vocabulary, so any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", SPECIAL_TOKENS.index("<bos>"))])
    if tok.get_vocab_size() > vocab_size:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, model vocab is {vocab_size}")
    return tok


def tokenizer_config() -> dict:
    """tokenizer_config.json: the special tokens by name and the chat template."""
    pad, eos, bos, unk = SPECIAL_TOKENS
    return {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk, "chat_template": CHAT_TEMPLATE}


def _stamp() -> dict:
    return {"seed": SEED, "init_version": INIT_VERSION, "tokenizer_version": TOKENIZER_VERSION}


def _is_complete(d: Path, expected_config: dict) -> bool:
    try:
        ok = all((d / f).is_file() for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"))
        return (ok and json.loads((d / "config.json").read_text()) == expected_config
                and json.loads((d / STAMP).read_text()) == _stamp())
    except (OSError, json.JSONDecodeError):
        return False


def ensure_tiny(dir: str | Path | None = None) -> Path:
    """Return a directory holding the tiny model (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json), building it first if it is missing or stale."""
    target = Path(dir) if dir is not None else default_tiny_dir()
    cfg = load_config(TINY_CONFIG)
    expected = json.loads(json.dumps(hf_config_dict(cfg, cfg.dtype)))
    if _is_complete(target, expected):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        write_random_checkpoint(cfg, tmp, seed=SEED, dtype=cfg.dtype)
        build_tokenizer(cfg.vocab_size).save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=1) + "\n")
        (tmp / STAMP).write_text(json.dumps(_stamp()) + "\n")
        if target.exists():
            if _is_complete(target, expected):  # another process finished first
                return target
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target, expected):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_dir(spec: str | Path) -> Path:
    """What every `--model` flag accepts: 'tiny' (the embedded default, built on first use) or a
    directory holding a Hugging Face `config.json` and safetensors."""
    if str(spec) == "tiny":
        return ensure_tiny()
    path = Path(spec)
    if not (path / "config.json").is_file():
        from .config import PUBLISHED
        hint = (" (the published sizes ship no weights here: pass a checkpoint directory)"
                if str(spec).lower() in PUBLISHED else "")
        raise FileNotFoundError(f"--model: {spec!r} is not a model directory with a config.json (or 'tiny'){hint}")
    return path
