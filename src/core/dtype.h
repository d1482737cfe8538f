// Element types and the host-side conversions between them.
// bf16 = the top 16 bits of an IEEE float32 (round-to-nearest-even on narrowing);
// f16 = IEEE binary16. Conversions are bit-exact with PyTorch's .to(dtype).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace opd {

enum class DType : uint8_t { F32, BF16, F16, I32, I64, F64 };

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);  // "f32", "bf16", ...
bool dtype_is_float(DType dtype);

// Raw 16-bit storage types (no arithmetic on purpose: convert to float to compute).
struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };

float bf16_to_float(uint16_t bits);
uint16_t float_to_bf16(float value);  // round to nearest even; NaN stays NaN
float f16_to_float(uint16_t bits);
uint16_t float_to_f16(float value);   // round to nearest even; overflow -> inf

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<double>() { return DType::F64; }
template <> constexpr DType dtype_of<bf16_t>() { return DType::BF16; }
template <> constexpr DType dtype_of<f16_t>() { return DType::F16; }
template <> constexpr DType dtype_of<int32_t>() { return DType::I32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::I64; }

}  // namespace opd
