"""Tokenization shared by the engine stand-in and the endpoint picker, so both count the same tokens.

The endpoint picker hashes a prompt's token blocks to ask the indexer which engine has them
cached; the engine stand-in publishes KV events for the blocks it "computes". Prefix-cache routing
only works when both sides turn the same request into the same token ids, so both go through this
module, which copies what a real vLLM + transformers stack does:

- a Hugging Face tokenizer directory (`tokenizer.json` for the Rust `tokenizers` package,
  `tokenizer_config.json` for the chat template and special tokens), read from disk only: nothing
  is downloaded at run time;
- the chat template rendered as transformers' `apply_chat_template` renders it (same jinja2
  sandbox, options, globals and `tojson` filter), so any model's template gives the same text;
- `/v1/chat/completions` encodes the rendered text *without* special tokens (the template
  already starts with the BOS), `/v1/completions` encodes the prompt *with* them, as vLLM does.

Without a directory, `Tokenizer.load()` reads the small byte-level BPE shipped in
`dynamo_lite.mock_engine/tokenizer/` (see its README.md).
"""

from __future__ import annotations

import functools
import importlib.resources
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

__all__ = ["Tokenizer", "TokenizerError", "shipped_tokenizer_dir"]


# Texts longer than this go through `encode_batch`, which releases the GIL (see `encode`).
GIL_FREE_CHARS = 4096


class TokenizerError(ValueError):
    """A tokenizer directory, chat template or message list that cannot be used.

    The message is meant for the API user: the HTTP layers answer it as a 400 `{"error": ...}`.
    """


def shipped_tokenizer_dir() -> Path:
    """The tokenizer directory installed with `dynamo_lite.mock_engine` (the default model's)."""
    return Path(str(importlib.resources.files("dynamo_lite.mock_engine") / "tokenizer"))


def _token_content(value: object) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict as HF saves it."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"special token must be a string or {{'content': ...}}, got {value!r}")


# --- transformers' jinja environment (the facts of `_compile_jinja_template`) -----------------


def _raise_exception(message: str) -> None:
    """`raise_exception(...)` in a template: the template's own refusal, e.g. a bad role order."""
    raise TokenizerError(f"chat template error: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' `tojson`: plain `json.dumps` (unicode kept, no HTML escaping, unlike jinja's)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    """transformers' `strftime_now` global (Llama 3.x templates print today's date with it)."""
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(f"chat template does not compile: {exc.message} (line {exc.lineno})") from exc


def _select_template(value: object) -> str | None:
    """`chat_template` is a string, or a list of {"name", "template"} (transformers uses "default")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, Mapping) and entry.get("name") == "default":
                template = entry.get("template")
                if isinstance(template, str):
                    return template
        raise TokenizerError("chat_template list has no 'default' template")
    raise TokenizerError("chat_template must be a string")


# --- message validation (what vLLM accepts for a text-only model) -----------------------------


def _normalize_messages(messages: object) -> list[dict[str, Any]]:
    """Check the OpenAI message list and give each message its content as one string.

    Content may be a string, null (rendered as ""), or a list of `{"type": "text", "text": ...}`
    parts joined with newlines, as vLLM flattens them for text-only models. Other keys (name,
    tool_calls, tool_call_id...) are passed on untouched for templates that use them.
    """
    if not isinstance(messages, list) or not messages:
        raise TokenizerError("messages must be a non-empty list")
    result: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise TokenizerError(f"{where} must be an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise TokenizerError(f"{where}.role must be a string")
        content = message.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            texts: list[str] = []
            for j, part in enumerate(content):
                if not isinstance(part, Mapping):
                    raise TokenizerError(f"{where}.content[{j}] must be an object")
                if part.get("type") != "text":
                    raise TokenizerError(
                        f"{where}.content[{j}].type must be 'text' (this model reads text only),"
                        f" got {part.get('type')!r}"
                    )
                if not isinstance(part.get("text"), str):
                    raise TokenizerError(f"{where}.content[{j}].text must be a string")
                texts.append(part["text"])
            text = "\n".join(texts)
        else:
            raise TokenizerError(f"{where}.content must be a string, null or a list of text parts")
        result.append({**message, "role": role, "content": text})
    return result


class Tokenizer:
    """A Hugging Face tokenizer directory: `tokenizer.json` plus `tokenizer_config.json`.

    Build one with `Tokenizer.load(directory)`, which caches per resolved path: the endpoint
    picker asks for each pool model's tokenizer on every request.
    """

    def __init__(self, directory: Path) -> None:
        """Read `directory` (prefer `Tokenizer.load`, which caches)."""
        self.directory = directory
        self.name = directory.name
        if not directory.is_dir():
            raise TokenizerError(f"tokenizer directory not found: {directory}")
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"no tokenizer.json in {directory}")
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises a bare Exception for any parse error
            raise TokenizerError(f"cannot read {tokenizer_file}: {exc}") from exc

        config: Mapping[str, Any] = {}
        config_file = directory / "tokenizer_config.json"
        if config_file.is_file():
            try:
                loaded = json.loads(config_file.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise TokenizerError(f"cannot read {config_file}: {exc}") from exc
            if not isinstance(loaded, Mapping):
                raise TokenizerError(f"{config_file} must hold a JSON object")
            config = loaded
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        # Recent transformers saves the template as chat_template.jinja and prefers it.
        template_file = directory / "chat_template.jinja"
        if template_file.is_file():
            try:
                self.chat_template: str | None = template_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise TokenizerError(f"cannot read {template_file}: {exc}") from exc
        else:
            self.chat_template = _select_template(config.get("chat_template"))
        self._template = _compile_template(self.chat_template) if self.chat_template else None

        self.bos_token_id = self._token_id(self.bos_token)
        self.eos_token_id = self._token_id(self.eos_token)
        # `add_bos_token` in the config overrides the post-processor, as transformers' Llama
        # tokenizers rebuild theirs from it. Absent (Llama 3), the post-processor decides.
        add_bos = config.get("add_bos_token")
        probe = self._tokenizer.encode("", add_special_tokens=True).ids
        adds_bos = bool(probe) and self.bos_token_id is not None and probe[0] == self.bos_token_id
        self._drop_bos = add_bos is False and adds_bos
        self._prepend_bos = add_bos is True and not adds_bos and self.bos_token_id is not None

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    @classmethod
    def load(cls, directory: str | Path | None = None) -> Tokenizer:
        """The tokenizer in `directory` (None: the shipped one), loaded once per resolved path."""
        path = shipped_tokenizer_dir() if directory is None else Path(directory)
        return _load_cached(path.expanduser().resolve())

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token covers (the longest vocabulary entry, at least
        1): a text of n characters has at least n / this many tokens, which tells a prompt far
        too long for a context without tokenizing it."""
        return max(1, max((len(token) for token in self._tokenizer.get_vocab(with_added_tokens=False)), default=1))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added special tokens included (every id `decode` accepts)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` runs the post-processor (the BOS).

        A long text is encoded through `encode_batch`, which releases the GIL while the Rust side
        works (`encode` holds it: 130 ms for 64,000 tokens during which no other thread ran):
        the picker tokenizes long prompts on a worker thread while its loop relays answers."""
        if len(text) > GIL_FREE_CHARS:
            ids = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self._drop_bos and ids and ids[0] == self.bos_token_id:
                ids = ids[1:]
            elif self._prepend_bos and self.bos_token_id is not None:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens are left out by default, as vLLM's detokenizer does."""
        try:
            return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError) as exc:
            raise TokenizerError(f"cannot decode token ids: {exc}") from exc

    def render_chat(
        self,
        messages: object,
        *,
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text `apply_chat_template(..., tokenize=False)` would give for `messages`.

        Template variables: `messages`, `bos_token`, `eos_token`, `add_generation_prompt`, `tools`,
        then `chat_template_kwargs` on top (vLLM lets them override the others, not `messages`).
        """
        if self._template is None:
            raise TokenizerError(f"tokenizer {self.name!r} has no chat template")
        conversation = _normalize_messages(messages)
        if tools is not None and not isinstance(tools, list):
            raise TokenizerError("tools must be a list")
        if chat_template_kwargs is None:
            chat_template_kwargs = {}
        elif not isinstance(chat_template_kwargs, Mapping) or not all(
            isinstance(k, str) for k in chat_template_kwargs
        ):
            raise TokenizerError("chat_template_kwargs must be an object")
        variables: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
            **chat_template_kwargs,
            "messages": conversation,
        }
        try:
            return self._template.render(**variables)
        except TokenizerError:
            raise
        except Exception as exc:  # any failure inside a (possibly user-chosen) template
            raise TokenizerError(f"chat template failed: {type(exc).__name__}: {exc}") from exc

    def chat_token_ids(
        self,
        messages: object,
        *,
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Prompt ids of a chat request, as vLLM's `/v1/chat/completions` computes them.

        The rendered text is encoded without special tokens: the template already wrote the BOS,
        and a second one would shift every block hash.
        """
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self.encode(text, add_special_tokens=False)

    def prompt_token_ids(self, prompt: str) -> list[int]:
        """Prompt ids of a `/v1/completions` text prompt: encoded with special tokens (the BOS)."""
        return self.encode(prompt, add_special_tokens=True)

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.directory)!r}, vocab_size={self.vocab_size})"


@functools.lru_cache(maxsize=64)
def _load_cached(path: Path) -> Tokenizer:
    return Tokenizer(path)
