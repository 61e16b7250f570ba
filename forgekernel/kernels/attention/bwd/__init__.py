"""Attention backward kernels (dQ, dK, dV), one leaf per architecture."""
