"""Token-mask cost of the two grammar libraries a structured-output engine can use: xgrammar and llguidance.

What a serving step pays for JSON-schema requests: for every constrained request in the batch, the set of tokens
the grammar allows next (a bitmask over the vocabulary), then advancing the grammar by the sampled token. This
script compiles one realistic schema (nested objects, an enum, arrays, optional fields, numbers, strings), starts
``--batch`` matchers, and drives each along the tokens of a different valid document, timing per step: the masks of
the whole batch (each library's batched entry point, and one request at a time) and the token advance. It reports
the median and p99 per step, the compile time and the vocabulary, and what applying one step's masks to the logits
costs on the CPU (xgrammar's CPU kernel against ``raymoe.runner.grammar_masks.apply_bitmask_host``). Two
tokenizers: the demo checkpoint's (what raymoe serves here) and a 32k-token BPE trained on the same corpus (closer
to a production vocabulary's size).

    python benchmarks/grammar_mask.py [--batch 64] [--steps 60] [--threads 2]

Needs ``xgrammar`` and ``llguidance`` importable (``pip install xgrammar llguidance``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string"}},
        "scores": {"type": "array", "items": {"type": "number"}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "active"],
    "additionalProperties": False,
}


def documents(n: int, seed: int = 0) -> list[str]:
    """``n`` different documents valid under ``SCHEMA`` (compact separators), seeded."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "lambda", "theta", "zeta"]
    out = []
    for i in range(n):
        doc = {"name": f"{rng.choice(words)} {rng.choice(words)}", "age": rng.randint(0, 99),
               "email": f"{rng.choice(words)}{i}@example.com", "role": rng.choice(["admin", "editor", "viewer"]),
               "address": {"street": f"{rng.randint(1, 999)} {rng.choice(words)} street",
                           "city": rng.choice(words).title(), "zip": f"{rng.randint(10000, 99999)}"},
               "tags": [rng.choice(words) for _ in range(rng.randint(0, 6))],
               "scores": [round(rng.uniform(0, 100), 2) for _ in range(rng.randint(0, 4))],
               "active": rng.random() < 0.5}
        out.append(json.dumps(doc, separators=(",", ":")))
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _drive(docs: list[list[int]], steps: int, new_matcher, fill, accept) -> tuple[list[float], list[float]]:
    """Fresh matchers driven along ``docs``: seconds per step of ``fill(live matchers)`` and of the advances."""
    matchers = [new_matcher() for _ in docs]
    fill_s, advance_s = [], []
    for step in range(steps):
        live = [i for i, d in enumerate(docs) if step < len(d)]
        if not live:
            break
        t = time.perf_counter()
        fill([matchers[i] for i in live])
        fill_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        for i in live:
            if not accept(matchers[i], docs[i][step]):
                raise RuntimeError(f"token {step} of document {i} rejected")
        advance_s.append(time.perf_counter() - t)
    return fill_s, advance_s


def bench_xgrammar(tok, vocab_size: int, docs: list[list[int]], steps: int, threads: int) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
    t = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=threads).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - t
    batch = xgr.BatchGrammarMatcher(max_threads=threads)
    bitmask = xgr.allocate_token_bitmask(len(docs), vocab_size)

    def one_by_one(ms):
        for j, m in enumerate(ms):
            m.fill_next_token_bitmask(bitmask, j)

    def new():
        return xgr.GrammarMatcher(compiled)

    mask_s, advance_s = _drive(docs, steps, new, lambda ms: batch.batch_fill_next_token_bitmask(ms, bitmask),
                               lambda m, tok_id: m.accept_token(tok_id))
    one_s, _ = _drive(docs, steps, new, one_by_one, lambda m, tok_id: m.accept_token(tok_id))
    apply = bench_apply(bitmask, vocab_size)
    return {"compile_s": compile_s, "mask_s": mask_s, "one_by_one_s": one_s, "advance_s": advance_s, **apply}


def bench_apply(bitmask: torch.Tensor, vocab_size: int, repeats: int = 50) -> dict:
    """Seconds to apply ``bitmask`` ([batch, W] int32, the masks of a step of the documents) to float32 logits on
    the CPU: xgrammar's CPU kernel (``apply_token_bitmask_inplace``) and raymoe's host path
    (``raymoe.runner.grammar_masks.apply_bitmask_host``), each the median of ``repeats``."""
    import xgrammar as xgr

    from raymoe.runner.grammar_masks import apply_bitmask_host

    rows = list(range(bitmask.shape[0]))
    words = bitmask.numpy()
    out = {}
    for name, fn in (("apply_xgrammar_s", lambda lg: xgr.apply_token_bitmask_inplace(lg, bitmask,
                                                                                       vocab_size=vocab_size)),
                     ("apply_host_s", lambda lg: apply_bitmask_host(lg, words, rows, vocab_size))):
        times = []
        for _ in range(repeats):
            logits = torch.randn(len(rows), vocab_size)
            t = time.perf_counter()
            fn(logits)
            times.append(time.perf_counter() - t)
        out[name] = [statistics.median(times)]
    return out


def bench_llguidance(tok, vocab_size: int, docs: list[list[int]], steps: int, threads: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides={
        "whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
    first = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t
    if first.is_error():
        raise RuntimeError(f"llguidance: {first.get_error()}")
    executor = llguidance.LLExecutor(num_threads=threads)
    bitmask = llguidance.torch.allocate_token_bitmask(len(docs), vocab_size)

    def batched(ms):
        llguidance.torch.fill_next_token_bitmask_par(executor, [(m, j) for j, m in enumerate(ms)], bitmask)

    def one_by_one(ms):
        for j, m in enumerate(ms):
            llguidance.torch.fill_next_token_bitmask(m, bitmask, j)

    def new():
        return llguidance.LLMatcher(lltok, grammar)

    mask_s, advance_s = _drive(docs, steps, new, batched, lambda m, tok_id: m.consume_token(tok_id))
    one_s, _ = _drive(docs, steps, new, one_by_one, lambda m, tok_id: m.consume_token(tok_id))
    return {"compile_s": compile_s, "mask_s": mask_s, "one_by_one_s": one_s, "advance_s": advance_s}


def bpe_32k(corpus: list[str]):
    """A 32k-token byte-level BPE trained on ``corpus`` (a production-sized vocabulary), as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from raymoe.models.checkpoint import default_model_path
    from raymoe.tokenizer import load_tokenizer

    demo = load_tokenizer(default_model_path())
    texts = documents(a.batch)
    import pathlib
    import sysconfig

    corpus = [p.read_text(errors="ignore") for p in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))]
    for label, tok in (("demo tokenizer", demo), ("32k BPE", bpe_32k(corpus + texts))):
        vocab = len(tok)
        docs = [tok.encode(s, add_special_tokens=False) for s in texts]
        print(f"{label}: vocabulary {vocab}, batch {a.batch}, documents of {min(map(len, docs))}-"
              f"{max(map(len, docs))} tokens, {a.threads} threads")
        for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
            r = fn(tok, vocab, docs, a.steps, a.threads)
            ms = {k: [x * 1e3 for x in v] for k, v in r.items() if k != "compile_s"}
            print(f"  {name:10s} compile {r['compile_s'] * 1e3:7.1f} ms | batch mask per step p50 "
                  f"{statistics.median(ms['mask_s']):6.2f} p99 {_pct(ms['mask_s'], 0.99):6.2f} ms | one by one "
                  f"p50 {statistics.median(ms['one_by_one_s']):6.2f} ms | advance p50 "
                  f"{statistics.median(ms['advance_s']):5.2f} ms")
            if "apply_host_s" in ms:
                print(f"  {'':10s} apply the batch's masks to float32 logits: xgrammar's CPU kernel "
                      f"{ms['apply_xgrammar_s'][0]:6.2f} ms, raymoe's host path {ms['apply_host_s'][0]:6.2f} ms")


if __name__ == "__main__":
    main()
