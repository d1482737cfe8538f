#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh runs on the lent GPU machine into .carry/bundle.tgz (ignored
# by git; pass `.carry` as the device tool's carry): the stripped opd and GPU test binaries
# built here, and the runtime libraries that machine lacks (OpenBLAS and its Fortran runtime,
# PCRE2, cpp-httplib with brotli). Build first: scripts/build.sh --target opd --target test_cuda
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .carry/bin .carry/lib
mkdir -p .carry/bin .carry/lib
for b in build/opd build/tests/test_cuda "$@"; do
  cp "$b" .carry/bin/
  strip .carry/bin/"$(basename "$b")"
done
for l in libopenblas.so.0 libgfortran.so.5 libquadmath.so.0 libpcre2-8.so.0 \
         libcpp-httplib.so.0.11 libbrotlidec.so.1 libbrotlienc.so.1 libbrotlicommon.so.1; do
  cp -L "/lib/x86_64-linux-gnu/$l" .carry/lib/
done
tar -C .carry -czf .carry/bundle.tgz bin lib
rm -rf .carry/bin .carry/lib
ls -la .carry/bundle.tgz
