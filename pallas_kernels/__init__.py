"""Pallas GPU kernels and their XLA references. Imports nothing from jaxserve."""
