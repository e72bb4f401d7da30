"""numba @njit kernels and LLVM-IR intrinsics for the CPU. Know arrays and quant layouts, not models."""
