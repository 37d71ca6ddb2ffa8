"""Chat templates: OpenAI-style ``messages`` → prompt token ids, as ``transformers`` renders them.

* A Hugging Face folder: its template from ``chat_template.jinja``, ``chat_template.json`` or
  ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{name, template}`` where
  ``default`` wins), rendered like ``tokenizer.apply_chat_template``: a sandboxed jinja2
  environment with ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, transformers' ``tojson``,
  ``raise_exception`` and ``strftime_now``; the special tokens (``bos_token`` ...) as variables;
  the text is then encoded WITHOUT adding special tokens (the template writes them itself).
* The built-in byte-level models (``tiny``, ``demo``) and byte-tokenizer folders:
  :data:`TINY_CHAT_TEMPLATE`, encoded after BOS.

Pure apart from reading the folder once (:func:`load_chat_template`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from services.common.errors import InvalidArgument
from services.common.tokenizer import Tokenizer

# Role markers in plain text: the byte tokenizer has no special tokens but BOS/EOS/PAD.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@lru_cache(maxsize=16)
def _compile(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' override: no HTML escaping, json.dumps options exposed
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise InvalidArgument(f"the model's chat template does not compile: {exc.message} (line {exc.lineno})") from None


@dataclass(frozen=True)
class ChatTemplate:
    """One model's template and what it needs to render."""

    source: str
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as strings (template variables)
    add_special_tokens: bool  # whether encoding the rendered text adds BOS (the tiny model only)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """The prompt text (raises InvalidArgument when the template refuses the conversation)."""
        import jinja2

        try:
            return _compile(self.source).render(
                messages=messages, tools=None, documents=None,
                add_generation_prompt=add_generation_prompt, **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidArgument(f"chat template: {exc.message or exc}") from None

    def encode(self, messages: list[dict], tokenizer: Tokenizer, *, add_generation_prompt: bool = True) -> list[int]:
        """Prompt token ids of ``messages`` (as ``apply_chat_template(..., tokenize=True)``)."""
        text = self.render(messages, add_generation_prompt=add_generation_prompt)
        return tokenizer.encode(text, add_special_tokens=self.add_special_tokens)


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken as saved: {"content": "<s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _pick(template) -> str | None:
    """A template string from a string or a list of named templates (``default`` first)."""
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None


def load_chat_template(model: str) -> ChatTemplate:
    """The chat template of ``model`` ("tiny", "demo" or a folder). InvalidArgument when the folder has none."""
    if model in ("tiny", "demo"):  # the byte-level built-ins (the router names the demo model "demo")
        return ChatTemplate(TINY_CHAT_TEMPLATE, {}, add_special_tokens=True)
    folder = Path(model)
    config = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    if (folder / "tandem_tokenizer.json").is_file() and not (folder / "tokenizer.json").is_file():
        return ChatTemplate(TINY_CHAT_TEMPLATE, {}, add_special_tokens=True)  # a byte-tokenizer folder
    source = None
    if (folder / "chat_template.jinja").is_file():
        source = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif (folder / "chat_template.json").is_file():
        source = _pick(_read_json(folder / "chat_template.json").get("chat_template"))
    if source is None:
        source = _pick(config.get("chat_template"))
    if not source:
        raise InvalidArgument(f"model {model!r} has no chat template (tokenizer_config.json chat_template): use /v1/completions")
    special = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        text = _token_text(config.get(name))
        if text is not None:
            special[name] = text
    return ChatTemplate(source, special, add_special_tokens=False)


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Validated plain messages: a known role and string content (text parts joined)."""
    if not messages:
        raise InvalidArgument("messages must not be empty")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidArgument(f"messages[{i}].content[{j}]: only text parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content must be a string or a list of text parts")
        out.append({**{k: v for k, v in m.items() if k != "content"}, "role": role, "content": content})
    return out
