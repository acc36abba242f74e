"""Compiled kernels, by backend: `cpu/` (C++ sources in cpu/csrc, built once per machine) and
what the CPU reports it can do (`isa`). Every kernel has a torch fallback in its caller."""
