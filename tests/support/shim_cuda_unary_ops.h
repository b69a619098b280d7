// Compile-only stand-in for mlx/backend/cuda/device/unary_ops.cuh (which the CPU wheel
// of mlx does not ship), so nvcc can compile the CUDA bodies here: the functor the gated
// fold names, with the same signature. Its arithmetic is not mlx's (mlx's rounds each
// half-type step through its fp16_math.cuh operators); on the GPU mlx's JIT hands over
// its own header, so the kernel runs mlx's functor itself (checked by the cuda tests).
#pragma once

namespace mlx::core::cu {

struct Sigmoid {
  template <typename T>
  __device__ T operator()(T x) {
    const float v = static_cast<float>(x);
    const float y = 1.0f / (1.0f + expf(fabsf(v)));
    return static_cast<T>(v < 0.0f ? y : 1.0f - y);
  }
};

}  // namespace mlx::core::cu
