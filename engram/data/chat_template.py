"""A tokenizer's chat template, rendered exactly as transformers' `apply_chat_template` does.

Where the template comes from (`load_chat_template`): `data.chat_template` when set (a `.jinja`
file, or a `tokenizer_config.json` holding `chat_template`), else the files next to the
tokenizer.json: `chat_template.jinja` (transformers >= 4.50 saves it there; it wins over the
config entry, as in transformers), then `tokenizer_config.json`'s `chat_template` (a string, or
a list of named templates of which "default" is taken). The shipped debug tokenizer's template
is engram/data/assets/tokenizer_config.json.

Rendering copies transformers 5 (utils/chat_template_utils.py, `_cached_compile_jinja_template`
and `render_jinja_template`): jinja2 >= 3.1.6 in an `ImmutableSandboxedEnvironment(trim_blocks,
lstrip_blocks)` (templates are untrusted code: the sandbox stays), the `loopcontrols` extension
and a `{% generation %}` block that renders its body, a `tojson` filter that does not escape
HTML, the globals `raise_exception`, `strftime_now`, `dict` and `namespace`, and the variables
`messages`, `tools`, `documents`, `add_generation_prompt` plus the tokenizer's named special
tokens (`bos_token`, `eos_token`, ... from tokenizer_config.json), overridden by the template
kwargs. Messages are normalised the same way (keys whose value is None dropped, reasoning
aliased), so the ids equal transformers' (tests/test_data_chat.py checks two templates).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# What transformers passes from the tokenizer (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"


class ChatTemplateError(ValueError):
    """A chat template that cannot be found, compiled or rendered; the message names the fix."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks the span;
    the target mask here comes from incremental rendering, so the tag only has to parse)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` without attribute access to the type (as transformers' TemplateDict)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` refusing underscore names (as transformers' TemplateNamespace)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"got {name!r}"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached by its text), in transformers' environment."""
    major_minor_patch = tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3])
    if major_minor_patch < (3, 1, 6):
        raise ChatTemplateError(
            f"jinja2 {jinja2.__version__} has known sandbox escapes and chat templates are "
            "untrusted code: pip install 'jinja2>=3.1.6'"
        )
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def normalise_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What transformers does to messages before rendering: drop keys whose value is None (a
    parquet struct column fills missing fields with None) and alias reasoning fields."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class ChatTemplate:
    """A template's text, where it came from, and the special tokens it renders with."""

    source: str
    origin: str
    special_tokens: dict[str, str] = field(default_factory=dict)

    @functools.cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()[:16]

    @functools.cached_property
    def variables(self) -> frozenset[str]:
        """Names the template reads from its context (jinja2.meta, as transformers)."""
        import jinja2.meta

        env = compile_template(self.source).environment
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(self.source)))

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
        where: str = "",
    ) -> str:
        """The rendered text (transformers' `apply_chat_template(..., tokenize=False)`)."""
        try:
            template = compile_template(self.source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"the chat template ({self.origin}) does not compile: line {e.lineno}: {e.message}."
                " Fix it, or set data.chat_template to another one"
            ) from None
        try:
            return template.render(
                messages=normalise_messages(messages),
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **(kwargs or {})},
            )
        except Exception as e:  # whatever the template raised: jinja's error, or a Python one
            raise ChatTemplateError(
                f"{where or 'a conversation'}: the chat template ({self.origin}) failed to render "
                f"it: {type(e).__name__}: {e}. Fix the record, or use a template that accepts it "
                "(data.chat_template)"
            ) from None


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ChatTemplateError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(config, dict):
        raise ChatTemplateError(f"{path}: not a JSON object")
    return config


def _config_template(config: dict[str, Any], path: Path) -> str | None:
    value = config.get("chat_template")
    if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            raise ChatTemplateError(
                f"{path}: chat_template holds the named templates {sorted(named)} and no "
                "'default': set data.chat_template to a .jinja file with the one to use"
            )
        value = named["default"]
    if value is not None and not isinstance(value, str):
        raise ChatTemplateError(f"{path}: chat_template must be a string")
    return value


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(name))
        if text is not None:
            out[name] = text
    return out


def load_chat_template(tokenizer: Any, override: str = "") -> ChatTemplate | None:
    """The chat template of `tokenizer` (an engram Tokenizer, found next to its file) or of
    `override` (data.chat_template: a .jinja file or a tokenizer_config.json); None if none."""
    folder = Path(tokenizer.source).parent if getattr(tokenizer, "source", "") else None
    config_path = folder / CONFIG_FILE if folder is not None else None
    config = _read_config(config_path) if config_path and config_path.is_file() else {}
    tokens = _special_tokens(config)
    if override:
        path = Path(override)
        if not path.is_file():
            raise ChatTemplateError(
                f"data.chat_template = {override!r} does not exist: set it to a .jinja file or a "
                "tokenizer_config.json holding chat_template, or leave it empty for the template "
                "next to the tokenizer"
            )
        if path.suffix == ".json":
            other = _read_config(path)
            source = _config_template(other, path)
            if source is None:
                raise ChatTemplateError(f"{path} has no chat_template entry")
            return ChatTemplate(source, str(path), {**tokens, **_special_tokens(other)})
        return ChatTemplate(path.read_text(encoding="utf-8"), str(path), tokens)
    if folder is None:
        return None
    jinja_file = folder / TEMPLATE_FILE
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(encoding="utf-8"), str(jinja_file), tokens)
    source = _config_template(config, config_path) if config_path else None
    return None if source is None else ChatTemplate(source, str(config_path), tokens)


def missing_template_error(tokenizer: Any, where: str) -> ChatTemplateError:
    folder = Path(tokenizer.source).parent if getattr(tokenizer, "source", "") else "<in-memory>"
    return ChatTemplateError(
        f"{where}: a conversation needs a chat template, and tokenizer {tokenizer.source or '?'} "
        f"has none (no {TEMPLATE_FILE} and no chat_template in {CONFIG_FILE} in {folder}): set "
        "data.chat_template to a .jinja file (or a tokenizer_config.json holding one), or give "
        "the records as prompt / completion strings or text"
    )


def chat_template_fields(tokenizer: Any, override: str = "") -> tuple[dict[str, Any], list[int]]:
    """What an export adds to tokenizer_config.json so transformers renders as training did:
    `chat_template` and the special tokens the template reads (e.g. Llama 3's `bos_token`; the
    export otherwise names eos as bos), plus the ids generation should also stop at: the
    template's end-of-turn token (its tokenizer_config eos_token, e.g. <|im_end|>) when it is not
    the tokenizer's eos. ({}, []) without a template."""
    template = load_chat_template(tokenizer, override)
    if template is None:
        return {}, []
    fields: dict[str, Any] = {"chat_template": template.source}
    for name in SPECIAL_TOKEN_NAMES:
        if name in template.variables and name in template.special_tokens:
            fields[name] = template.special_tokens[name]
    stops = []
    end_of_turn = template.special_tokens.get("eos_token")
    turn_id = tokenizer.hf.token_to_id(end_of_turn) if end_of_turn else None
    if turn_id is not None and turn_id != tokenizer.eos_id:
        stops.append(turn_id)
    return fields, stops
