#!/usr/bin/env bash
# Tokenizer encode throughput, opd vs Hugging Face tokenizers, same corpus, same machine, same
# run, single thread each (benchmark, not a test). Prints one JSON line per engine and mode.
# Usage: tools/bench_tokenizer.sh [TOKENIZER_JSON] [CORPUS] [REPEAT]
#   defaults: the committed Qwen3 tokenizer, tests/fixtures/tokenizers/corpus.txt, 5 passes
# Needs build/opd (Release) and python3 with `tokenizers`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tok="${1:-$root/tests/fixtures/tokenizers/qwen3/tokenizer.json}"
corpus="${2:-$root/tests/fixtures/tokenizers/corpus.txt}"
repeat="${3:-5}"
opd="${OPD_BINARY:-$root/build/opd}"
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(nproc) cpus: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
echo "# tokenizer $tok, corpus $corpus ($(wc -l <"$corpus") lines, $(wc -c <"$corpus") bytes), best of $repeat passes"
"$opd" tokenize --tokenizer "$tok" --bench "$corpus" --bench-repeat "$repeat"
python3 "$root/tools/bench_tokenizer_hf.py" "$tok" "$corpus" "$repeat"
# Typical text only: the corpus lines that are printable ASCII without runs of 3+ spaces
# (the full corpus is dominated by adversarial lines: 20k spaces, 10k digits...).
prose="$(mktemp)"
trap 'rm -f "$prose"' EXIT
python3 - "$corpus" "$prose" <<'PY'
import re, sys
lines = open(sys.argv[1], "rb").read().split(b"\n")
keep = [l for l in lines if l and re.fullmatch(rb"[ -~]+", l) and b"   " not in l]
open(sys.argv[2], "wb").write(b"\n".join(keep * 4) + b"\n")
print(f"# prose subset: {len(keep)} lines x 4, {sum(map(len, keep)) * 4} bytes")
PY
"$opd" tokenize --tokenizer "$tok" --bench "$prose" --bench-repeat "$repeat"
python3 "$root/tools/bench_tokenizer_hf.py" "$tok" "$prose" "$repeat"
