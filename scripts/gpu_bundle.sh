#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh runs on the lent GPU machine into .carry/bundle.txz (ignored
# by git; pass `.carry` as the device tool's carry): the stripped opd and GPU test binaries
# built here, and the runtime libraries that machine lacks (OpenBLAS and its Fortran runtime,
# PCRE2, cpp-httplib with brotli). Build first: scripts/build.sh --target opd --target test_cuda
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .carry/bin .carry/lib
mkdir -p .carry/bin .carry/lib
for b in build/opd build/tests/test_cuda "$@"; do
  if [[ "$b" == build/tests/test_cuda && ! -f "$b" ]]; then  # a bench-only call
    echo "note: $b is not built; the bundle has no GPU tests" >&2
    continue
  fi
  cp "$b" .carry/bin/
  strip .carry/bin/"$(basename "$b")"
done
for l in libopenblas.so.0 libgfortran.so.5 libquadmath.so.0 libpcre2-8.so.0 \
         libcpp-httplib.so.0.11 libbrotlidec.so.1 libbrotlienc.so.1 libbrotlicommon.so.1; do
  cp -L "/lib/x86_64-linux-gnu/$l" .carry/lib/
done
# xz: half of gzip's size (21 vs 44 MB in session 6), which keeps the tracked tree + carry under
# the device tool's 64 MiB; gpu_check.sh unpacks it with tar -J or, where the GPU machine has no
# xz binary, with Python's tarfile (lzma is in its standard library).
rm -f .carry/bundle.tgz .carry/bundle.txz
tar -C .carry -c bin lib | xz -T0 -6 > .carry/bundle.txz
rm -rf .carry/bin .carry/lib
ls -la .carry/bundle.txz
total=$(( $(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}') + \
          $(stat -c %s .carry/bundle.txz) ))
echo "tracked tree + carry: $((total >> 20)) MiB (the device tool takes 64 MiB in all)"
(( total < (64 << 20) )) || { echo "over 64 MiB: carry fewer binaries" >&2; exit 1; }
