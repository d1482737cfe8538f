// Dequantization of ggml tensor blocks to float32, written from the block definitions (ggml
// docs and the k-quants description): F32, F16, BF16; Q8_0 (x = d*q, q int8); Q4_0
// (x = d*(q-8), q 4-bit); Q4_1 (x = d*q + m); and the 256-element super-blocks Q4_K / Q5_K
// (8 sub-blocks of 32, x = d*sc*q - dmin*mn with 6-bit sc/mn packed in 12 bytes; Q5_K adds a
// 5th bit from qh) and Q6_K (16 sub-blocks of 16, x = d*sc*(q-32), 8-bit signed sc, q split
// into 4 low bits in ql and 2 high bits in qh). Byte layouts are spelled out in dequant.cpp.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "model/gguf.h"

namespace opd {

bool dequant_supported(GgmlType type);
std::string dequant_supported_list();  // "F32, F16, BF16, Q8_0, ..."

// Dequantizes whole blocks: src holds out.size() / block_elems blocks (ggml_type_info(type));
// sizes that do not match are an InvalidArgument error naming the type and both sizes.
void dequantize_blocks(GgmlType type, std::span<const uint8_t> src, std::span<float> out);

}  // namespace opd
