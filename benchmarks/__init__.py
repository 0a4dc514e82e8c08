"""Benchmarks of the builder and of the packages it writes: a package run from the repository root, one module per
benchmark (`python -m benchmarks.bench_runtime --help`), with the helpers they share in `benchmarks.common`."""
