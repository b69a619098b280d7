// C++ stand-in for the Metal Shading Language pieces that mlx's generated
// custom-kernel signatures and the dflash kernel bodies use, so g++ can
// syntax-check every Metal body and the tests can run it on the CPU.
// It plays the part of the metal_stdlib prelude mlx prepends to each kernel.
#pragma once

#include <cstdint>
#include <cstring>

// Address-space and function qualifiers are no-ops on the host.
#define device
#define constant
#define thread
#define threadgroup

typedef unsigned int uint;

struct uint3 {
  uint x;
  uint y;
  uint z;
};

// Element types mlx names in generated signatures (the copy kernels see words;
// the threadgroup kernels compute in them).
typedef _Float16 half;
typedef half float16_t;
// bfloat16 as Metal's bfloat: float conversions round to nearest even.
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = uint16_t((u >> 16) | 0x40u);
    } else {
      bits = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

namespace metal {}
using namespace metal;
