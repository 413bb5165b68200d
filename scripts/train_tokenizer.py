"""Train the default model's byte-level BPE tokenizer (Hugging Face `tokenizers`) on the prepared corpus.

- Byte-level pre-tokenizer (GPT-2 regex) and byte-level decoder, no normaliser: any UTF-8 text round-trips exactly.
- Vocabulary size 4096 including the special tokens, which take the lowest ids in the order of SPECIAL_TOKENS
  (BOS = 0 and EOS = 1 as in the official DeepSeek-V4 tokenizer, docs/model.md section 8). They are registered as
  special added tokens, so they are matched whole in the input and skipped by `decode(..., skip_special_tokens=True)`.
- No BOS/EOS are added automatically (`add_bos_token: false` in the official config); callers add them.

Usage: python scripts/train_tokenizer.py [--train data/corpus/train.txt] [--valid data/corpus/valid.txt]
                                         [--out dsv4_jax/default_model/tokenizer.json] [--vocab-size 4096]
"""

from __future__ import annotations

import argparse
import os
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# The corpus lives inside the repository (data/ is gitignored), wherever the script is run from.
CORPUS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "corpus")

# The DeepSeek-V4 special tokens (docs/model.md section 8), `｜` = U+FF5C, `▁` = U+2581. `<tool_result>` is not in the
# list: in V4 it is plain text inside user turns, not a special token.
SPECIAL_TOKENS = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
    "<｜latest_reminder｜>",
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜title｜>",
    "<｜read_url｜>",
    "<｜extracted_url｜>",
]


def read_documents(path: str) -> list[str]:
    """The corpus has one document (chapter) per blank-line-separated block."""
    with open(path, encoding="utf-8") as f:
        return [d + "\n" for d in f.read().split("\n\n") if d.strip()]


def train(docs: list[str], vocab_size: int, min_frequency: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, so nothing is ever unknown
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def check(tok: Tokenizer, vocab_size: int, valid_docs: list[str]) -> None:
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size, tok.get_vocab_size()
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    assert specials == set(SPECIAL_TOKENS), specials
    # Round trips: arbitrary Unicode / whitespace, and the chat grammar with special tokens kept.
    samples = [
        "In the beginning God created the heaven and the earth.\n",
        "  tabs\tand  spaces \n\n trailing  ",
        "Ünïcödé, 你好, emoji 🙂, ｜ and ▁ outside specials, <think without close",
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜><think>4</think>"
        "Four.<｜end▁of▁sentence｜>",
    ]
    for s in samples + valid_docs:
        ids = tok.encode(s).ids
        assert tok.decode(ids, skip_special_tokens=False) == s, s[:60]
    chat = tok.encode(samples[3]).ids
    assert chat[0] == 0 and chat[-1] == 1 and tok.token_to_id("<think>") in chat, chat
    print(f"round-trip OK on {len(samples)} samples + {len(valid_docs)} valid documents; chat ids: {chat}")


def count_tokens(tok: Tokenizer, docs: list[str]) -> tuple[int, int]:
    return sum(len(e.ids) for e in tok.encode_batch(docs)), sum(len(d) for d in docs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", default=os.path.join(CORPUS_DIR, "train.txt"))
    ap.add_argument("--valid", default=os.path.join(CORPUS_DIR, "valid.txt"))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "dsv4_jax", "default_model",
                                                  "tokenizer.json"))
    ap.add_argument("--vocab-size", type=int, default=4096, help="total, special tokens included")
    ap.add_argument("--min-frequency", type=int, default=2)
    args = ap.parse_args()

    t0 = time.time()
    train_docs, valid_docs = read_documents(args.train), read_documents(args.valid)
    tok = train(train_docs, args.vocab_size, args.min_frequency)
    print(f"trained in {time.time() - t0:.1f}s")
    check(tok, args.vocab_size, valid_docs)

    out = os.path.normpath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tok.save(out)
    reloaded = Tokenizer.from_file(out)
    assert reloaded.encode(valid_docs[0]).ids == tok.encode(valid_docs[0]).ids
    print(f"saved {out} ({os.path.getsize(out)} bytes), vocab size {reloaded.get_vocab_size()}")

    for name, docs in (("train", train_docs), ("valid", valid_docs)):
        n_tok, n_char = count_tokens(reloaded, docs)
        print(f"{name}: {len(docs)} documents, {n_char} chars, {n_tok} tokens, "
              f"{n_tok / n_char:.4f} tokens/char ({n_char / n_tok:.2f} chars/token)")
    print(f"total time {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
