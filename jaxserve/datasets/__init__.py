"""Prompt datasets shared by the benchmarks (bench/) and the EAGLE-3 data pipeline (training/eagle3/).

They live in the jaxserve package because both consumers sit above it and neither may import the other:
`bench` is not an installed package, and `training` must not depend on the benchmark harness.
"""
