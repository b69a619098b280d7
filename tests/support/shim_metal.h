// C++ stand-in for the Metal Shading Language pieces that mlx's generated
// custom-kernel signatures and the dflash kernel bodies use, so g++ can
// syntax-check every Metal body and the tests can run it on the CPU.
// It plays the part of the metal_stdlib prelude mlx prepends to each kernel.
#pragma once

#include <cstdint>

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

// Element types mlx names in generated signatures (unused by the copy
// kernels, which see words, but kept so any dtype signature parses).
typedef _Float16 half;
typedef half float16_t;
struct bfloat16_t {
  uint16_t bits;
};

namespace metal {}
using namespace metal;
