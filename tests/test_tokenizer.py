"""dynamo_lite.routing.tokenizer: the shipped tokenizer, chat rendering as transformers does it, vLLM's
special-token rules, and the errors a bad directory, template or message list gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_lite.routing.tokenizer import Tokenizer, TokenizerError, shipped_tokenizer_dir

pytestmark = pytest.mark.unit

BOS = "<|begin_of_text|>"
EOT = "<|eot_id|>"

# Any Unicode text except lone surrogates, which are not valid text to encode.
unicode_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=200)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load()


def make_dir(tmp_path: Path, config: dict[str, object]) -> Path:
    """A tokenizer directory with the shipped tokenizer.json and the given config."""
    directory = tmp_path / "custom"
    directory.mkdir()
    shutil.copy(shipped_tokenizer_dir() / "tokenizer.json", directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def test_shipped_tokenizer_facts(tok: Tokenizer) -> None:
    assert tok.name == "tokenizer"
    assert 4000 <= tok.vocab_size <= 8000
    assert tok.bos_token == BOS and tok.eos_token == EOT
    assert tok.eos_token_id == tok.encode(EOT, add_special_tokens=False)[0]
    assert tok.bos_token_id is not None and tok.bos_token_id != tok.eos_token_id
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (shipped_tokenizer_dir() / name).stat().st_size < 400_000


@given(unicode_text)
@settings(max_examples=300)
def test_encode_decode_round_trip(text: str) -> None:
    tok = Tokenizer.load()
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.decode(tok.encode(text)) == text  # the BOS is skipped when decoding
    assert all(0 <= i < tok.vocab_size for i in tok.encode(text))


def test_prompt_ids_start_with_bos(tok: Tokenizer) -> None:
    ids = tok.prompt_token_ids("Route the request to the worker with the longest cached prefix.")
    assert ids[0] == tok.bos_token_id
    assert ids.count(tok.bos_token_id) == 1
    assert ids[1:] == tok.encode("Route the request to the worker with the longest cached prefix.",
                                 add_special_tokens=False)


def test_chat_ids_have_exactly_one_bos(tok: Tokenizer) -> None:
    ids = tok.chat_token_ids([{"role": "user", "content": "Hello"}])
    assert ids[0] == tok.bos_token_id
    assert ids.count(tok.bos_token_id) == 1
    assert ids.count(tok.eos_token_id) == 1


def test_render_two_turn_conversation(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "  You are terse.\n"},
        {"role": "user", "content": "Which worker?"},
        {"role": "assistant", "content": "Worker 2."},
        {"role": "user", "content": [{"type": "text", "text": "Why"}, {"type": "text", "text": "that one?"}]},
    ]
    assert tok.render_chat(messages) == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhich worker?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nWorker 2.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhy\nthat one?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert tok.render_chat(messages, add_generation_prompt=False).endswith("that one?<|eot_id|>")


def test_null_content_renders_empty(tok: Tokenizer) -> None:
    rendered = tok.render_chat([{"role": "assistant", "content": None}], add_generation_prompt=False)
    assert rendered == "<|begin_of_text|><|start_header_id|>assistant<|end_header_id|>\n\n<|eot_id|>"


@given(unicode_text, unicode_text, unicode_text)
@settings(max_examples=100)
def test_earlier_turn_ids_prefix_the_next_turn(user1: str, assistant1: str, user2: str) -> None:
    """What makes prefix caching work across turns: the special tokens at message boundaries stop
    BPE merges, so the first turn's ids (no generation prompt) begin the second turn's ids."""
    tok = Tokenizer.load()
    first = [{"role": "user", "content": user1}]
    second = [*first, {"role": "assistant", "content": assistant1}, {"role": "user", "content": user2}]
    prefix = tok.chat_token_ids(first, add_generation_prompt=False)
    full = tok.chat_token_ids(second)
    assert full[: len(prefix)] == prefix
    assert len(full) > len(prefix)


def test_chat_template_kwargs_and_tools_reach_the_template(tmp_path: Path) -> None:
    template = (
        "{% if tools %}{{ tools | tojson }}|{% endif %}{{ flavor }}|{{ messages[0]['content'] | tojson(indent=1) }}"
    )
    tok = Tokenizer.load(make_dir(tmp_path, {"chat_template": template}))
    rendered = tok.render_chat(
        [{"role": "user", "content": "é"}],
        tools=[{"type": "function", "function": {"name": "f"}}],
        chat_template_kwargs={"flavor": "x"},
    )
    # transformers' tojson: no ASCII escaping, no HTML escaping.
    assert rendered == '[{"type": "function", "function": {"name": "f"}}]|x|"é"'


def test_raise_exception_gives_tokenizer_error(tmp_path: Path) -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok"
    tok = Tokenizer.load(make_dir(tmp_path, {"chat_template": template, "bos_token": {"content": BOS}}))
    assert tok.bos_token == BOS  # an AddedToken dict as HF writes it
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "ok"
    with pytest.raises(TokenizerError, match="first message must be user"):
        tok.render_chat([{"role": "system", "content": "hi"}])


def test_template_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not compile"):
        Tokenizer.load(make_dir(tmp_path, {"chat_template": "{% for %}"}))
    (tmp_path / "custom" / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ messages.append(1) }}"}), encoding="utf-8"
    )
    tok = Tokenizer.load(tmp_path / "custom")
    with pytest.raises(TokenizerError, match="chat template failed"):  # the sandbox refuses it
        tok.render_chat([{"role": "user", "content": "hi"}])


def test_no_chat_template(tmp_path: Path) -> None:
    tok = Tokenizer.load(make_dir(tmp_path, {}))
    assert tok.prompt_token_ids("hi")[0] == tok.encode(BOS, add_special_tokens=False)[0]
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "hi"}])


def test_add_bos_token_false_overrides_the_post_processor(tmp_path: Path) -> None:
    tok = Tokenizer.load(make_dir(tmp_path, {"bos_token": BOS, "add_bos_token": False}))
    assert tok.prompt_token_ids("hi") == tok.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ({"role": "user", "content": "hi"}, "non-empty list"),
        ([], "non-empty list"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r"messages\[0\]\.role must be a string"),
        ([{"role": 1, "content": "hi"}], r"role must be a string"),
        ([{"role": "user", "content": 42}], r"messages\[0\]\.content must be a string"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
         r"content\[0\]\.type must be 'text'"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], r"content\[0\]\.text must be a string"),
        ([{"role": "user", "content": ["hi"]}], r"content\[0\] must be an object"),
    ],
)
def test_invalid_messages(tok: Tokenizer, messages: object, match: str) -> None:
    with pytest.raises(TokenizerError, match=match):
        tok.render_chat(messages)
    with pytest.raises(TokenizerError, match=match):
        tok.chat_token_ids(messages)


def test_invalid_tools_and_kwargs(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(TokenizerError, match="tools"):
        tok.render_chat(messages, tools={"a": 1})  # type: ignore[arg-type]
    with pytest.raises(TokenizerError, match="chat_template_kwargs"):
        tok.render_chat(messages, chat_template_kwargs=[1])  # type: ignore[arg-type]


def test_missing_directory_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(TokenizerError, match="not found") as info:
        Tokenizer.load(missing)
    assert str(missing) in str(info.value)


def test_missing_tokenizer_json_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no tokenizer.json") as info:
        Tokenizer.load(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_bad_files(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match="cannot read"):
        Tokenizer.load(tmp_path)
    directory = make_dir(tmp_path, {})
    (directory / "tokenizer_config.json").write_text("[1]", encoding="utf-8")
    with pytest.raises(TokenizerError, match="JSON object"):
        Tokenizer.load(directory)


def test_load_is_cached() -> None:
    shipped = Tokenizer.load()
    assert Tokenizer.load() is shipped
    assert Tokenizer.load(shipped_tokenizer_dir()) is shipped
    assert Tokenizer.load(str(shipped_tokenizer_dir())) is shipped


def test_tokenizer_error_is_a_value_error() -> None:
    assert issubclass(TokenizerError, ValueError)
