"""Hopper limits and numeric constants. DSL-free: configs and host code import it."""

from __future__ import annotations

import math

SMEM_CAPACITY = 232448  # per-block opt-in shared memory on sm_90 (227 KiB)
THREADS_PER_WG = 128  # threads of one warpgroup
WARP_SIZE = 32
NUM_SMS_H100_H200 = 132
REGISTERS_PER_SM = 1 << 16  # 32-bit registers a CTA's setmaxnreg split may use
LN2 = math.log(2.0)
LOG2E = math.log2(math.e)
# The 16-bit input dtypes, by the name every compile key uses.
DTYPE_NAMES = ("float16", "bfloat16")
