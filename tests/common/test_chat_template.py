"""Chat templates render exactly as transformers' ``apply_chat_template`` does (text and ids)."""

from __future__ import annotations

import json

import pytest

from services.common.chat_template import TINY_CHAT_TEMPLATE, load_chat_template, normalize_messages
from services.common.errors import InvalidArgument
from services.common.tokenizer import ByteTokenizer, load_tokenizer

LLAMA3_STYLE = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{{- system_message }}{{- '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('roles must be user or assistant') }}{% endif %}\n"
    "    {%- if loop.index > 8 %}{% break %}{% endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}\n"
)
# trim_blocks/lstrip_blocks and transformers' tojson (no HTML escaping, non-ASCII kept)
JSON_STYLE = "{% for m in messages %}\n  {{ m | tojson }}\n{% endfor %}{{ eos_token }}"

SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def _write_folder(folder, template) -> None:
    """A byte-level BPE tokenizer (any text encodes) with Llama-3-like special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    bos = tok.token_to_id(SPECIALS[0])
    tok.post_processor = processors.TemplateProcessing(single=f"{SPECIALS[0]} $A", special_tokens=[(SPECIALS[0], bos)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SPECIALS[0], "eos_token": {"__type": "AddedToken", "content": "<|eot_id|>", "lstrip": False, "rstrip": False,
                      "normalized": False, "single_word": False, "special": True}, "chat_template": template,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))


MESSAGES = [
    {"role": "system", "content": "  You are terse. <b>&</b> "},
    {"role": "user", "content": "Grüße! What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And \"3+3\"?"},
]


@pytest.mark.parametrize("template", [LLAMA3_STYLE, JSON_STYLE])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_hf_folder_template_matches_transformers(tmp_path, template, add_generation_prompt):
    from transformers import AutoTokenizer

    _write_folder(tmp_path, template)
    reference = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = load_chat_template(str(tmp_path))
    text = ours.render(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert text == reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = reference.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=add_generation_prompt)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ours.encode(MESSAGES, load_tokenizer(tmp_path), add_generation_prompt=add_generation_prompt) == list(ids)


def test_the_template_file_wins_and_a_template_error_is_invalid_argument(tmp_path):
    _write_folder(tmp_path, JSON_STYLE)
    (tmp_path / "chat_template.jinja").write_text(LLAMA3_STYLE)
    ours = load_chat_template(str(tmp_path))
    assert ours.render(MESSAGES).startswith("<|begin_of_text|><|start_header_id|>system")
    with pytest.raises(InvalidArgument, match="roles must be user or assistant"):
        ours.render([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])


def test_folder_without_template_and_broken_template(tmp_path):
    _write_folder(tmp_path, None)
    with pytest.raises(InvalidArgument, match="no chat template"):
        load_chat_template(str(tmp_path))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(InvalidArgument, match="does not compile"):
        load_chat_template(str(tmp_path)).render(MESSAGES)


def test_tiny_template_and_message_normalization():
    tiny = load_chat_template("tiny")
    assert tiny.source == TINY_CHAT_TEMPLATE
    # the shipped demo model, as the router names it (`--model demo`), is byte-level too
    assert load_chat_template("demo").source == TINY_CHAT_TEMPLATE and load_chat_template("demo").add_special_tokens
    msgs = normalize_messages([{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "you"}]}])
    assert tiny.render(msgs) == "<|user|>\nHi you\n<|assistant|>\n"
    assert tiny.encode(msgs, ByteTokenizer())[0] == ByteTokenizer().bos_token_id
    for bad in ([], [{"role": "wizard", "content": "x"}], [{"role": "user", "content": [{"type": "image_url"}]}],
                [{"role": "user", "content": 5}]):
        with pytest.raises(InvalidArgument):
            normalize_messages(bad)
