#!/usr/bin/env python3
"""HF `tokenizers` side of tools/bench_tokenizer.sh: single-thread encode throughput on a corpus,
measured the way `opd tokenize --bench` measures (lines in memory, best of N passes, first pass
reported too). Prints one JSON object per mode: `encode` (one call per line, includes Python
call overhead) and `encode_batch` (one call for all lines; single-threaded because
TOKENIZERS_PARALLELISM=false and RAYON_NUM_THREADS=1 are set before import)."""
import json
import os
import sys
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"
from tokenizers import Tokenizer, __version__  # noqa: E402


def main():
    tok_path, corpus, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3
    tok = Tokenizer.from_file(tok_path)
    raw = open(corpus, "rb").read().split(b"\n")
    if raw and raw[-1] == b"":
        raw.pop()
    nbytes = sum(len(b) for b in raw)
    lines = [b.decode("utf-8", errors="replace") for b in raw]
    for mode in ("encode", "encode_batch"):
        times, tokens = [], 0
        for _ in range(max(1, repeat)):
            t0 = time.perf_counter()
            if mode == "encode":
                n = sum(len(tok.encode(line, add_special_tokens=False).ids) for line in lines)
            else:
                n = sum(len(e.ids) for e in tok.encode_batch(lines, add_special_tokens=False))
            times.append(time.perf_counter() - t0)
            tokens = n
        best = min(times)
        print(json.dumps({"engine": f"hf tokenizers {__version__} {mode}", "lines": len(lines),
                          "bytes": nbytes, "tokens": tokens, "first_pass_s": times[0],
                          "best_pass_s": best, "mb_per_s": nbytes / 1e6 / best,
                          "tokens_per_s": tokens / best,
                          "first_pass_mb_per_s": nbytes / 1e6 / times[0]}))


if __name__ == "__main__":
    main()
