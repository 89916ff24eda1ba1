"""Rebuild the shipped tokenizer: `python services/mock_engine/tokenizer/build.py`.

Writes `tokenizer.json` and `tokenizer_config.json` next to this script, the two files a Hugging
Face tokenizer directory needs, so `dynamo_lite.routing.tokenizer.Tokenizer.load()` (and transformers'
`AutoTokenizer.from_pretrained`) can read it without a download.

Why a tokenizer of our own: the engine stand-in and the endpoint picker must agree token for token,
offline and without third-party model files. So this is a byte-level BPE in the shape of Llama 3's
(ByteLevel pre-tokenizer and decoder, `<|begin_of_text|>` prepended by a TemplateProcessing
post-processor, the Llama-3 chat template and special tokens), trained on this repository's own
Apache-2.0 Markdown. It is not a model's tokenizer: ids mean nothing outside this project.

The output is deterministic: the corpus files are read in a fixed order, BPE training breaks ties
by pair, and the JSON is written with fixed key order, so a rerun on the same corpus rewrites the
same bytes. A changed corpus (README.md edited) gives a different tokenizer; rebuild on purpose.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]  # services/mock_engine/tokenizer -> repository root

# The project's own prose (Apache-2.0, written here). Nothing vendored: not the Mooncake trace
# sample, not anything outside the repository.
CORPUS_GLOBS = ("README.md", "docs/*.md", "bench/*.md")

# Byte-level BPE size before the special tokens: 256 byte symbols + 3,840 merges. Small enough
# for a file of a few hundred KB, large enough that English prose averages ~4 characters a token.
BPE_VOCAB_SIZE = 4096
MIN_FREQUENCY = 2

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS = (BOS, EOS, START_HEADER, END_HEADER, EOT)

# Llama 3 Instruct's template in its usual Hugging Face form: BOS once, then one header + body +
# <|eot_id|> per message (content trimmed), and the assistant header as the generation prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)


def corpus_files(root: Path = ROOT) -> list[Path]:
    """The training files, sorted, so the order (and with it the output) never varies."""
    files: set[Path] = set()
    for pattern in CORPUS_GLOBS:
        files.update(p for p in root.glob(pattern) if p.is_file())
    if not files:
        raise SystemExit(f"no corpus files under {root} matching {CORPUS_GLOBS}")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def build_tokenizer(texts: list[str]) -> Tokenizer:
    """Train the byte-level BPE on `texts` and add Llama 3's special tokens and BOS processor."""
    tokenizer = Tokenizer(models.BPE())  # no unk token: every byte is in the alphabet
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=MIN_FREQUENCY,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    # Appended after training, as Llama 3 keeps its specials after the BPE ids (128000+).
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)
            for t in SPECIAL_TOKENS
        ]
    )
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A",
                pair=f"{BOS} $A {BOS}:1 $B:1",
                special_tokens=[(BOS, bos_id)],
            ),
        ]
    )
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer) -> dict[str, object]:
    """`tokenizer_config.json` as transformers writes it for Llama 3 Instruct (eos = <|eot_id|>)."""

    def added(token: str) -> dict[str, object]:
        return {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }

    return {
        "added_tokens_decoder": {str(tokenizer.token_to_id(t)): added(t) for t in SPECIAL_TOKENS},
        "bos_token": BOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOT,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def main() -> int:
    files = corpus_files()
    texts = [p.read_text(encoding="utf-8") for p in files]
    tokenizer = build_tokenizer(texts)
    (HERE / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    config = json.dumps(tokenizer_config(tokenizer), indent=2, ensure_ascii=False)
    (HERE / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
    names = ", ".join(p.relative_to(ROOT).as_posix() for p in files)
    print(f"trained on {names}: {tokenizer.get_vocab_size(with_added_tokens=True)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
