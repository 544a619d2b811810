"""Tokenizer folders for the chat-template tests: the debug tokenizer plus the special tokens of
a Qwen2.5-style or Llama-3-style template (tests/fixtures/chat/*.jinja), written with a
tokenizer_config.json as a Hugging Face folder holds them."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from engram.data.tokenizer import DEBUG_TOKENIZER

FIXTURES = Path(__file__).parent / "fixtures" / "chat"
STYLES = {
    "qwen2_5": {
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "plain": ["<tool_call>", "</tool_call>"],  # added, not special (as in Qwen2.5)
        "config": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
        "end_of_turn": "<|im_end|>",
    },
    "llama3": {
        "special": [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        "plain": [],
        "config": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "end_of_turn": "<|eot_id|>",
    },
}

CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What is the capital of Kelbor?"},
    {"role": "assistant", "content": "Drusa"},
    {"role": "user", "content": "And its longest river? Ünïcode, café."},
    {"role": "assistant", "content": "The Tholk flows through it."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a fact up.",
            "parameters": {
                "type": "object",
                "properties": {"entity": {"type": "string"}},
                "required": ["entity"],
            },
        },
    }
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Who founded Kelbor?"},
    {
        "role": "assistant",
        "tool_calls": [
            {"type": "function", "function": {"name": "lookup", "arguments": {"entity": "Kelbor"}}}
        ],
    },
    {"role": "tool", "content": "founder: Ama Trel"},
    {"role": "assistant", "content": "Ama Trel founded it."},
]


def template_text(style: str) -> str:
    return (FIXTURES / f"{style}.jinja").read_text(encoding="utf-8")


def write_tokenizer_folder(folder: Path, style: str, with_template: bool = True) -> Path:
    """folder/tokenizer.json + tokenizer_config.json of `style`; returns folder."""
    spec = STYLES[style]
    tok = Tokenizer.from_file(str(DEBUG_TOKENIZER))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special"]])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["plain"]])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {k: v for k, v in spec["config"].items() if v is not None}
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if with_template:
        config["chat_template"] = template_text(style)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder
