"""Arch detection, the compile cache and loading of prebuilt kernels (no DSL needed to load)."""
