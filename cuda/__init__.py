"""CUDA kernel sources, shipped as package data of `openjev.kernels` and compiled at run time."""
