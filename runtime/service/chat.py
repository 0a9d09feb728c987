"""Chat templates: the checkpoint's own, rendered with jinja2 in a sandbox (as transformers does).

The template comes from `chat_template.jinja` or the `chat_template` of `tokenizer_config.json` in
the model (or engine) directory; without one, chat completions are refused with a message saying so,
rather than guessing a format the model was not trained on.
"""
from __future__ import annotations

import json
from pathlib import Path

from .protocol import APIError


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise APIError(400, f"chat template: {message}", "messages")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_dir(cls, model_dir) -> "ChatTemplate | None":
        d = Path(model_dir)
        config = {}
        if (d / "tokenizer_config.json").is_file():
            config = json.loads((d / "tokenizer_config.json").read_text())
        source = (d / "chat_template.jinja").read_text() if (d / "chat_template.jinja").is_file() \
            else config.get("chat_template")
        if isinstance(source, list):  # transformers' list of named templates
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not source:
            return None

        def token(name):
            t = config.get(name) or ""
            return t.get("content", "") if isinstance(t, dict) else t
        return cls(source, token("bos_token"), token("eos_token"))

    def render(self, messages: list[dict], add_generation_prompt: bool, extra: dict | None = None) -> str:
        from jinja2 import TemplateError
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token, **(extra or {}))
        except TemplateError as e:
            raise APIError(400, f"chat template failed on these messages: {e}", "messages") from None
