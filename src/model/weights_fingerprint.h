// A cheap identity of a model directory's weights (a teacher's, saved with every training
// checkpoint so that a resume notices a teacher rewritten under the same path): SHA-256 over
// config.json, and for each *.safetensors file (by name) its name, size, whole header (tensor
// names, dtypes, shapes, offsets, metadata) and kSamples x kSampleBytes of its data at fixed,
// evenly spaced offsets. No full read: a 64 GB teacher in 17 files costs ~1 MiB of reads.
// What it cannot see: a change confined to bytes between the samples that keeps every header
// and size (one weight edited by hand); retrained, converted, re-quantized or replaced weights
// change the samples (and usually the headers).
#pragma once

#include <cstdint>
#include <string>

namespace opd {

struct WeightsFingerprint {
  static constexpr int kSamples = 16;
  static constexpr int64_t kSampleBytes = 4096;
  std::string sha256;       // 64 hex characters
  int64_t files = 0;        // safetensors files covered
  int64_t total_bytes = 0;  // their sizes summed
  int64_t bytes_read = 0;   // headers + samples + config.json actually read
};

// Throws Io when the directory or a file cannot be read, InvalidData for a safetensors file
// whose header length does not fit the file.
WeightsFingerprint weights_fingerprint(const std::string& model_dir);

}  // namespace opd
