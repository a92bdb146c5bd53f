"""Kernel tests: reference and Triton ops against oracles and known answers."""
