"""numba.cuda kernels (issue 3). Know arrays and quant layouts, not models."""
