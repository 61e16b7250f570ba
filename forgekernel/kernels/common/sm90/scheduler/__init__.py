"""Tile schedulers: which output tile a persistent CTA takes next.

- `static`: the GEMM's static persistent walk (tile t, t + grid, ...) in raster groups.
- `longest_first`: the attention forward's order, the longest causal row blocks first.
- `atomic`: a global counter hands out the next tile (dynamic; uneven tiles, varlen).
"""
