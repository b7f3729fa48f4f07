"""Launchers for raw_kernels/*.cu, one module per kernel family, each with its NumPy twin."""
