"""tests/gpu/: operator checks that need an sm90 GPU, marked `gpu` (the skip elsewhere is in
tests/conftest.py). On the H200: `python -m pytest -m gpu tests/gpu` (kernels from a bundle,
$FORGEKERNEL_KERNEL_DIR, or compiled on first use; naming the folder keeps a host without the
DSL from collecting the CPU tests that import it)."""
