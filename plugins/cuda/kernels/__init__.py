"""Triton kernels of the cuda plugin (also run by the rocm plugin), importable without a GPU."""
