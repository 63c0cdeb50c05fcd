"""gpt-oss's harmony vocabulary and tokenizer for tests, on machines that cannot download it.

``openai-harmony`` loads ``o200k_base.tiktoken`` from OpenAI's blob store, or from the folder named by
``TIKTOKEN_ENCODINGS_BASE``. This machine reaches package registries only, so :func:`o200k_dir` rebuilds the file
from the npm package ``js-tiktoken`` (its ``dist/ranks/o200k_base.js`` holds the same ranks, grouped by runs of
consecutive ids) and keeps it only if its SHA-256 is the one ``tiktoken`` itself checks the download against, so the
tests run on the real vocabulary or not at all (skipped). :func:`harmony_tokenizer_dir` turns it into a Hugging Face
``tokenizer.json`` with harmony's special tokens at their ids (transformers' ``TikTokenConverter``), the tokenizer a
released gpt-oss checkpoint ships.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import tarfile
import urllib.request
from pathlib import Path

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
"""SHA-256 of ``o200k_base.tiktoken`` (``tiktoken_ext.openai_public``'s ``expected_hash``)."""
JS_TIKTOKEN = "https://registry.npmjs.org/js-tiktoken/-/js-tiktoken-1.0.21.tgz"
HARMONY_VOCAB_SIZE = 201088
"""gpt-oss's ``vocab_size`` (o200k_base's 199,998 ranks and harmony's special and reserved tokens)."""
_NAMED = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
          200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>",
          200018: "<|endofprompt|>"}


def _cache() -> Path:
    base = os.environ.get("RAYMOE_CACHE_DIR") or str(Path.home() / ".cache" / "raymoe")
    return Path(base) / "harmony"


def _good(path: Path) -> bool:
    return path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == O200K_SHA256


def _from_npm(dest: Path) -> bool:
    """Rebuild ``o200k_base.tiktoken`` from js-tiktoken's ranks into ``dest``; False when unreachable or not the
    real file."""
    try:
        with urllib.request.urlopen(JS_TIKTOKEN, timeout=60) as r:
            data = r.read()
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            js = tar.extractfile("package/dist/ranks/o200k_base.js").read().decode()
    except (OSError, KeyError, tarfile.TarError):
        return False
    ranks = json.loads(js[js.index("{"):js.rindex("}") + 1])["bpe_ranks"]
    rows = []
    for line in ranks.split("\n"):
        if not line:
            continue
        _, offset, *tokens = line.split(" ")
        rows += [(int(offset) + i, tok) for i, tok in enumerate(tokens)]
    rows.sort()
    text = "".join(f"{tok} {rank}\n" for rank, tok in rows)
    if hashlib.sha256(text.encode()).hexdigest() != O200K_SHA256:
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(dest)
    return True


def o200k_dir() -> Path | None:
    """A folder holding the verified ``o200k_base.tiktoken`` (``TIKTOKEN_ENCODINGS_BASE``'s, the cache's, or rebuilt
    from npm into the cache), or None when none can be had."""
    env = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    if env and _good(Path(env) / "o200k_base.tiktoken"):
        return Path(env)
    dest = _cache() / "o200k_base.tiktoken"
    if _good(dest) or _from_npm(dest):
        return dest.parent
    return None


def harmony_tokenizer_dir(vocab: Path) -> Path:
    """A tokenizer folder like a released gpt-oss checkpoint's: o200k_base plus harmony's special tokens at their ids
    (reserved names elsewhere up to :data:`HARMONY_VOCAB_SIZE`), ``<|return|>`` as eos, and gpt-oss's generation
    config (eos ``<|return|>``, ``<|endoftext|>``, ``<|call|>``). Built once into the cache."""
    out = _cache() / "gpt-oss-tokenizer"
    if (out / "tokenizer.json").is_file():
        return out
    from transformers.convert_slow_tokenizer import TikTokenConverter

    js_pattern = ("[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
                  "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
                  "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
                  "[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
    specials = [_NAMED.get(i, f"<|reserved_{i}|>") for i in range(199998, HARMONY_VOCAB_SIZE)]
    class Converter(TikTokenConverter):
        def load_tiktoken_bpe(self, path):  # what tiktoken.load does, without needing tiktoken installed
            lines = Path(path).read_text().splitlines()
            return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in lines if line)}

    tok = Converter(vocab_file=str(vocab / "o200k_base.tiktoken"), pattern=js_pattern,
                    extra_special_tokens=specials).converted()
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>", "model_max_length": 131072}))
    (tmp / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 199998, "pad_token_id": 199999, "eos_token_id": [200002, 199999, 200012],
        "do_sample": False}))
    tmp.replace(out)
    return out
