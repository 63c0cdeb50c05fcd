"""A byte-level BPE tokenizer trained offline, for the seeded tiny checkpoints.

The training text is the Python standard library's own ``.py`` sources (always on disk, no download): a sorted,
size-capped subset, so training is deterministic and takes a few seconds. The result is written as a Hugging Face
tokenizer folder (``tokenizer.json`` + ``tokenizer_config.json`` with a ChatML chat template) that
``transformers.AutoTokenizer.from_pretrained`` loads.

Special tokens have fixed ids: ``<|endoftext|>`` = 0 (padding, document end), ``<|im_start|>`` = 1,
``<|im_end|>`` = 2 (end of turn, the eos token).
"""

from __future__ import annotations

import functools
import json
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from raymoe.errors import InvalidRequestError

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
"""Special tokens in id order: ``SPECIAL_TOKEN_IDS[tok] == SPECIAL_TOKENS.index(tok)``."""
SPECIAL_TOKEN_IDS: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
ENDOFTEXT_ID = SPECIAL_TOKEN_IDS[ENDOFTEXT]
IM_START_ID = SPECIAL_TOKEN_IDS[IM_START]
IM_END_ID = SPECIAL_TOKEN_IDS[IM_END]

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
"""ChatML (Qwen style): ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then
``<|im_start|>assistant\\n`` when ``add_generation_prompt``."""

_CORPUS_MAX_BYTES = 6_000_000
_CORPUS_MAX_FILE_BYTES = 40_000
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings"})
_MIN_VOCAB = 256 + len(SPECIAL_TOKENS) + 1


def _training_files(max_bytes: int = _CORPUS_MAX_BYTES) -> list[Path]:
    """Sorted stdlib ``.py`` files (skipping tests and installed packages) until ``max_bytes`` are covered."""
    root = Path(sysconfig.get_paths()["stdlib"])
    candidates = sorted(
        (p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    files: list[Path] = []
    total = 0
    for path in candidates:
        if total >= max_bytes:
            break
        files.append(path)
        total += min(path.stat().st_size, _CORPUS_MAX_FILE_BYTES)
    return files


def _training_texts(files: list[Path]) -> list[str]:
    texts = []
    for path in files:
        try:
            text = path.read_bytes()[:_CORPUS_MAX_FILE_BYTES].decode("utf-8", errors="ignore")
        except OSError:
            continue
        texts.append(text)
    return texts


def train_tokenizer(vocab_size: int = 2048) -> Tokenizer:
    """Train the byte-level BPE tokenizer (uncached; same vocab_size -> identical ``to_str()``).

    Args:
        vocab_size: total vocabulary incl. the 256 byte tokens and the 3 special tokens.

    Returns:
        a ``tokenizers.Tokenizer`` whose special tokens have the ids of ``SPECIAL_TOKEN_IDS``.

    Raises:
        InvalidRequestError: ``vocab_size`` is too small to hold the byte alphabet and special tokens.
    """
    if vocab_size < _MIN_VOCAB:
        raise InvalidRequestError("vocab_size", f"must be >= {_MIN_VOCAB}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_texts(_training_files()), trainer=trainer)
    for name, idx in SPECIAL_TOKEN_IDS.items():
        if tok.token_to_id(name) != idx:
            raise RuntimeError(f"special token {name} got id {tok.token_to_id(name)}, expected {idx}")
    return tok


@functools.lru_cache(maxsize=4)
def _trained_json(vocab_size: int) -> str:
    return train_tokenizer(vocab_size).to_str(pretty=True)


def tokenizer_config(chat_template: str | None = None) -> dict:
    """The ``tokenizer_config.json`` dict written next to ``tokenizer.json``.

    Args:
        chat_template: Jinja chat template; ``None`` -> ``CHATML_TEMPLATE``.
    """
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "split_special_tokens": False,
        "chat_template": CHATML_TEMPLATE if chat_template is None else chat_template,
    }


def build_tokenizer(out_dir: Path, vocab_size: int = 2048, chat_template: str | None = None) -> None:
    """Train (or reuse this process's identical earlier training) and write the tokenizer files into ``out_dir``.

    Writes ``tokenizer.json`` (byte-level BPE, ``vocab_size`` entries, special ids 0/1/2 as in
    ``SPECIAL_TOKEN_IDS``) and ``tokenizer_config.json`` (eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos,
    ``chat_template`` or ChatML). Training is deterministic: equal arguments give byte-identical files.

    Raises:
        InvalidRequestError: ``vocab_size`` is too small.
        OSError: ``out_dir`` cannot be written.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(_trained_json(int(vocab_size)), encoding="utf-8")
    cfg = json.dumps(tokenizer_config(chat_template), indent=2, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(cfg + "\n", encoding="utf-8")
