// Stand-in for mlx/backend/cuda/device/utils.cuh (which the CPU wheel of mlx
// does not ship): the types mlx's generated CUDA custom-kernel source needs,
// so nvcc can compile every CUDA body inside the signature mlx generates.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cuda/std/limits>
