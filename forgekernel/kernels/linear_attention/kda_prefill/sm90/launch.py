"""Host launcher of the KDA forward: the first pass (`intra.py`; its torch model, the tests'
yardstick, is `operands.kda_chunk_operands`), then the recurrence kernel. Torch only (no DSL).
Nothing here reads a device value on the host: the offsets stay on the device (the kernels read
them; the chunk tables are torch ops over an upper bound of chunks), so a call can be captured
in a CUDA graph. Callers validate first (`forgekernel.ops.kda_chunked.kimi_delta_attention`)."""

from __future__ import annotations

import functools

import torch

from forgekernel.kernels.linear_attention.gdn_prefill.sm90.launch import (
    SEGMENT_SCALE,
    _segment_offsets,
)
from forgekernel.kernels.linear_attention.kda_prefill.sm90 import (
    INTRA_SPEC,
    SPEC,
    intra_params_for,
)
from forgekernel.kernels.linear_attention.kda_prefill.sm90.config import CHUNK, params_for
from forgekernel.kernels.linear_attention.kda_prefill.sm90.operands import (
    L2NORM_EPS,
    OPERAND_DTYPE,
    chunk_bound,
    chunk_tables,
)
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import dtype_name, on_device

ALIGN = 16  # bytes: TMA boxes, 16-byte O stores
MAX_SEQUENCES = 65535  # the grid is (HV, N): N is gridDim.y


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def value_split(sequences: int, heads: int, device: torch.device) -> bool:
    """Two CTAs per (sequence, head) (one state warpgroup each) where the split grid still fits
    one wave: the recurrence is one CTA's sequential walk, so CTAs are its parallelism; past one
    wave two warpgroups sharing a CTA's loads and tensor cores (filling each other's bubbles)
    are the better use of an SM."""
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 132
    return 2 * sequences * heads <= sms


# Compile keys per (dtype, dims, ...): built once (a dict and a sort per call otherwise).
_intra_params = functools.cache(intra_params_for)
_params = functools.cache(params_for)

# Exact chunk tables where every sequence's length is known on the host (one sequence, or a
# batch without offsets: the offsets are n x seq_len), per (device, sequences, seq_len): the
# same `chunk_tables` over the same offsets, built once and only read since (the kernels never
# write them). Without it each call ran ~20 tiny torch ops (~20 launches, 5-8 us of host
# issue each on a GPU) for constant tables: the bench's 1 x 2048 host probe. Never evicted (a
# kernel on another stream may still read an entry): past MAX_TABLES keys, new lengths build
# their own tables per call. Not used while a CUDA graph captures (the graph keeps its own).
_TABLES: dict = {}
MAX_TABLES = 256


def _exact_tables(device: torch.device, sequences: int, seq_len: int):
    tables = chunk_tables(_offsets(device, sequences, seq_len),
                          chunk_bound(sequences * seq_len, sequences, seq_len))  # fmt: skip
    if device.type == "cuda":  # built on this stream, later read on any: finished first
        torch.cuda.current_stream(device).synchronize()
    return tables


def _offsets(device: torch.device, sequences: int, seq_len: int) -> torch.Tensor:
    return torch.arange(sequences + 1, dtype=torch.int32, device=device) * seq_len


# The offsets 0, L, ..., N L themselves (the KDA backward's first pass passes them: read only
# under a CUDA-graph capture, where `_tables` builds from them; 2 launches a call before
# next/linattn-bwd-host), kept as the tables are: per (device, N, L), never evicted, at most
# MAX_TABLES, not while a graph captures.
_OFFSETS: dict = {}


def equal_offsets(device: torch.device, sequences: int, seq_len: int) -> torch.Tensor:
    """int32 (N + 1,) offsets of N sequences of seq_len tokens on `device`: read only."""
    if _capturing(device):
        return _offsets(device, sequences, seq_len)
    key = (device, sequences, seq_len)
    cu = _OFFSETS.get(key)
    if cu is None:
        cu = _offsets(*key)
        if device.type == "cuda":  # built on this stream, later read on any: finished first
            torch.cuda.current_stream(device).synchronize()
        if len(_OFFSETS) < MAX_TABLES:
            _OFFSETS[key] = cu
    return cu


def device_tables(cu_seqlens: torch.Tensor, bound: int, chunks: torch.Tensor | None = None):
    """`operands.chunk_tables` (its model and yardstick: equal bitwise, tests/test_kda_op.py)
    in 14 launching torch ops instead of 21, no value read on the host: int32 throughout (the
    offsets' own type) save the sequence index, and each chunk's start as a per-sequence base
    plus 64 x its global index (cu[s] + 64 (gc - first[s]) = (cu[s] - 64 first[s]) + 64 gc).
    chunks: (N,) in the offsets' dtype, the chunks each sequence takes (default ceil(len /
    64)); the varlen backward's slot layout passes its owned slots (ceil(len / 64) or one
    more: a chunk past the tokens gets length 0; ops/_linattn_varlen.py `slot_tables`)."""
    cu = cu_seqlens
    lo, hi = cu[:-1], cu[1:]
    if chunks is None:
        chunks = (hi - lo).add_(CHUNK - 1).div_(CHUNK, rounding_mode="floor")
    ends = chunks.cumsum(0, dtype=cu.dtype)
    first = ends - chunks
    gc = torch.arange(bound, dtype=cu.dtype, device=cu.device)
    seq = torch.searchsorted(ends, gc, right=True).clamp_(max=lo.numel() - 1)
    starts = torch.sub(lo, first, alpha=CHUNK)[seq].add_(gc, alpha=CHUNK)
    lengths = (hi[seq] - starts).clamp_(0, CHUNK)
    return tuple(x.to(torch.int32) for x in (first, starts, lengths))


def _capturing(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _tables(cu_seqlens: torch.Tensor, tokens: int, seq_len: int | None):
    """(first, starts, lengths) of `operands.chunk_tables` over `chunk_bound` chunks: the
    cached exact tables where seq_len is known and no CUDA graph captures, else torch ops on
    the offsets."""
    n = cu_seqlens.shape[0] - 1
    device = cu_seqlens.device
    if seq_len is not None and not _capturing(device):
        key = (device, n, seq_len)
        tables = _TABLES.get(key)
        if tables is None and len(_TABLES) < MAX_TABLES:
            tables = _TABLES[key] = _exact_tables(*key)
        if tables is not None:
            return tables
    return device_tables(cu_seqlens, chunk_bound(tokens, n, seq_len))


def _aligned(x: torch.Tensor) -> torch.Tensor:
    return x if x.data_ptr() % ALIGN == 0 else x.clone()


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    f = x.float()
    return (f / torch.sqrt((f * f).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def first_pass_kernel(q, k, g, beta, cu_seqlens: torch.Tensor, scale: float, l2norm: bool,
                      seq_len: int | None = None, bwd: bool = False,
                      v: torch.Tensor | None = None) -> dict:  # fmt: skip
    """The first pass on `intra.py` (one CTA per chunk and value head; a chunk of length 0, past
    the last real one, returns at once): the same outputs as `operands.kda_chunk_operands`
    (its model: within a few bf16 roundings on the H200, tests/gpu/test_kda_prefill_gpu.py),
    with the rows of those empty chunks left unwritten (the recurrence never reads them).
    bwd: its bwd key, tt and big_g too, P^T as "pt" in p's place, and W = T_beta Kg, u = T_beta
    V ("w", "u", bf16 (R, HV, 128)) from v (T, HV, 128) in q's dtype, given with bwd only (the
    KDA backward's; tests/gpu/test_kda_first_pass_bwd_gpu.py)."""
    if bwd != (v is not None):
        raise ValueError("v is the bwd key's input: given with bwd=True, and only then")
    if v is not None and (v.shape != (*g.shape[:2], q.shape[2]) or v.dtype != q.dtype):
        raise ValueError(f"v must be (T, HV, K) {tuple(g.shape[:2])} x {q.shape[2]} in q's "
                         f"dtype {q.dtype}, got {tuple(v.shape)} {v.dtype}")  # fmt: skip
    if l2norm:  # the kernel reads unit rows: normalized here, in fp32, back in q's dtype
        q, k = (_unit_rows(x) for x in (q, k))
    first, starts, lengths = _tables(cu_seqlens, q.shape[0], seq_len)
    bound = starts.shape[0]
    rows, hv, dk = bound * CHUNK, g.shape[1], q.shape[2]
    p = "pt" if bwd else "p"  # the bwd key writes P^T there (`operands.py`)
    out = {
        name: q.new_empty(rows, hv, width, dtype=OPERAND_DTYPE)
        for name, width in (("q_g", dk), ("k_g", dk), ("k_d", dk), ("t_beta", CHUNK),
                            (p, CHUNK))
    }  # fmt: skip
    out["decay"] = q.new_empty(bound, hv, dk, dtype=torch.float32)
    out["first"] = first
    if bwd:
        out["tt"] = q.new_empty(rows, hv, CHUNK, dtype=OPERAND_DTYPE)
        out["big_g"] = q.new_empty(rows, hv, dk, dtype=torch.float32)
        out["w"] = q.new_empty(rows, hv, dk, dtype=OPERAND_DTYPE)
        out["u"] = q.new_empty(rows, hv, dk, dtype=OPERAND_DTYPE)
        v = _aligned(v.contiguous())
    fn = get_kernel(INTRA_SPEC, _intra_params(dtype_name(q.dtype), dk, bwd=bwd))
    with on_device(q.device):
        fn(_aligned(q), _aligned(k), _aligned(g.float().contiguous()), beta.float().contiguous(),
           starts, lengths, out["q_g"], out["k_g"], out["k_d"], out["t_beta"], out[p],
           out["decay"], out.get("tt"), out.get("big_g"), v, out.get("w"), out.get("u"),
           scale)  # fmt: skip
    return out


def kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    out: torch.Tensor,
    final_state: torch.Tensor,
    scale: float,
    *,
    l2norm: bool,
    seq_len: int | None = None,
    segments: int = 1,
    pieces: int = 1,
) -> None:
    """Varlen form: q, k (T, H, K), v (T, HV, V) 16-bit, g (T, HV, K) and beta (T, HV),
    cu_seqlens int32 (N + 1,) rising from 0 to T; initial_state fp32 (N, HV, K, V) or None
    (zeros). Writes out (T, HV, V) in v's dtype and final_state (N, HV, K, V) fp32. Contiguous
    tensors. Never reads the offsets on the host (no sync; CUDA-graph capturable): the chunk
    tables are built on the device over an upper bound of chunks (`operands.chunk_bound`).
    seq_len: every sequence's length where the caller knows it on the host (a batch without
    offsets): exact tables. The first pass on its kernel (`first_pass_kernel`): the kernel of
    2026-12-02 ran 3.9-4.7x the speed of the torch pass, its "rows8" re-layout (the only one
    since 2026-12-03) takes the op to 0.455-0.680x of that time (H200, every kda_prefill bench
    case). segments > 1 (opt-in, the bench's `segments` variant; not measured yet): the
    recurrence over each sequence cut into that many segments (`_segmented`), the first pass
    unchanged. pieces > 1 (opt-in, the bench's `pieces` variant; not measured yet): each
    sequence cut into that many pieces run at once, each after warm-up chunks from a zero state
    (`_pieces`: an approximation for unit keys, cuDNN's warm-up heuristic, not a bound)."""
    n = final_state.shape[0]
    if segments > 1 and pieces > 1:
        raise ValueError(f"segments ({segments}) and pieces ({pieces}): one or the other")
    if n == 0:
        return
    if q.shape[0] == 0:  # T = 0, every sequence empty: no TMA descriptor over zero rows
        final_state.copy_(initial_state) if initial_state is not None else final_state.zero_()
        return
    if n == 1:  # the offsets are (0, T)
        seq_len = q.shape[0]
    ops = first_pass_kernel(q, k, g, beta, cu_seqlens, scale, l2norm, seq_len)
    v = _aligned(v)
    dst = out if out.data_ptr() % ALIGN == 0 else torch.empty_like(out)
    if segments > 1:
        _segmented(ops, v, initial_state, cu_seqlens, dst, final_state, segments)
    elif pieces > 1:
        _pieces(ops, v, initial_state, cu_seqlens, dst, final_state, pieces)
    else:
        init = None if initial_state is None else _aligned(initial_state)
        _recurrence(ops, v, init, cu_seqlens, ops["first"], dst, final_state)
    if dst is not out:
        out.copy_(dst)


def _recurrence(ops: dict, v, init, cu_seqlens, first, dst, final_state, warm=None) -> None:
    """One launch of the recurrence over the sequences cu_seqlens delimits, chunk c of sequence
    n read at the first pass's global chunk first[n] + c; v, dst aligned. warm (N,) int32: the
    `warmup` kernel, sequence n walking warm[n] chunks before cu[n] (`_pieces`)."""
    split = value_split(final_state.shape[0], v.shape[1], v.device)
    params = _params(dtype_name(v.dtype), (ops["k_g"].shape[-1], v.shape[-1]),
                     initial_state=init is not None, value_split=split,
                     warmup=warm is not None)  # fmt: skip
    fn = get_kernel(SPEC, params)
    with on_device(v.device):
        fn(ops["q_g"], ops["k_g"], ops["k_d"], ops["t_beta"], ops["p"], ops["decay"], v, init,
           cu_seqlens, first, dst, final_state, warm)  # fmt: skip


def _segment_first(cu_seqlens: torch.Tensor, first: torch.Tensor, cu_seg: torch.Tensor,
                   parts: int) -> torch.Tensor:  # fmt: skip
    """(N P,) global first chunk of each segment: first[n] + the segment's chunk offset in its
    sequence (segments start on whole chunks, `_segment_offsets`; an empty one past the end
    gets the sequence's chunk count and is never read). On the device, int32."""
    bos = cu_seqlens[:-1].long().repeat_interleave(parts)
    offset = (cu_seg[:-1].long() - bos + CHUNK - 1) // CHUNK
    return (first.long().repeat_interleave(parts) + offset).to(torch.int32)


def _segmented(ops: dict, v, initial_state, cu_seqlens, dst, final_state, parts: int) -> None:
    """The recurrence over each sequence cut into `parts` segments of whole chunks, three
    launches and a scan as GDN's (`gdn_prefill.sm90.launch._segmented`, the same offsets and
    scale): per segment S_end = M S_start + L with M the K x K transition (the decays and
    I - beta k k^T), a state itself where K = V. A (segments 0 .. NP - 2) from zero (segment
    (n, 0) from the initial state): L, and segment 0's o; B (1 .. NP - 2) from SEGMENT_SCALE x I:
    c M + L; the scan S_(p+1) = M_p S_p + L_p on torch; C (1 .. NP - 1) from those starts: o and
    the final states. The first pass ran once over the whole sequences: each segment reads its
    chunks at `_segment_first`. Three passes' recurrence work over P times the CTAs: for few
    long sequences, whose direct recurrence leaves most SMs idle (1 x 32768 h16: 32 CTAs)."""
    n, hv, dk, dv = final_state.shape
    if dk != dv:
        raise ValueError(f"the segmented path needs K = V (M is K x K as a state), got {dk}, {dv}")
    cu = _segment_offsets(cu_seqlens, parts)
    first = _segment_first(cu_seqlens, ops["first"], cu, parts)
    runs = [cu[:-1], cu[1:-1].clone(), cu[1:].clone()]  # A, B, C; own bases (aligned like cu)
    firsts = [first[:-1], first[1:-1].clone(), first[1:].clone()]
    total = n * parts
    flat = (total, *final_state.shape[1:])
    starts = torch.zeros(flat, dtype=torch.float32, device=v.device)
    if initial_state is not None:
        starts[::parts] = initial_state
    local = torch.empty_like(starts)
    _recurrence(ops, v, starts[:-1], runs[0], firsts[0], dst, local[:-1])
    shifted = torch.empty_like(starts)
    if total > 2:
        eye = torch.eye(dk, dtype=torch.float32, device=v.device) * SEGMENT_SCALE
        init = eye.expand(total - 2, *final_state.shape[1:]).contiguous()
        _recurrence(ops, v, init, runs[1], firsts[1], dst, shifted[1:-1])
    shape = (n, parts, *final_state.shape[1:])
    local, shifted, by_seq = local.view(shape), shifted.view(shape), starts.view(shape)
    s = local[:, 0]
    for p in range(1, parts):
        by_seq[:, p] = s
        if p + 1 < parts:  # S (K, V): S_end = M S_start + L
            s = (shifted[:, p] - local[:, p]) * (1.0 / SEGMENT_SCALE) @ s + local[:, p]
    last = torch.empty_like(starts)
    _recurrence(ops, v, starts[1:], runs[2], firsts[2], dst, last[1:])
    final_state.copy_(last.view(shape)[:, -1])


# Pieces (`_pieces`): the state a piece drops is the sequence's state before its warm-up
# chunks. The warm-up is chosen by cuDNN kda_hopper_cuda's heuristic, not by a bound: the sum
# over the warm-up chunks of log2 of each chunk's largest total decay (over heads and key
# channels, the first pass's `decay`) plus WARMUP_MIX_LOG2 (log2 sqrt(K), the entries' mixing)
# at most WARMUP_LOG2 (-20). That bounds the dropped state only while it stays in the channels
# that decay: the projections I - beta k k^T move state between key channels, so keys that turn
# a slow channel into a decayed one can carry most of it through (a two-channel construction
# keeps 0.93 |S| where the heuristic takes one warm-up chunk; review of 2026-12-05). Random
# gates and keys (the tests, the bench) never do; real activations must be checked before
# `pieces` is ever a default. It also assumes beta |k|^2 <= 2 (unit keys, beta in [0, 1]).
WARMUP_LOG2 = -20.0
WARMUP_MIX_LOG2 = 3.5
WARMUP_MAX = 4  # warm-up chunks tried before a piece falls back to its sequence's start


def _warmup_chunks(decay: torch.Tensor, first: torch.Tensor, piece_first: torch.Tensor,
                   parts: int):  # fmt: skip
    """(warm-up chunks, whether they reach the sequence's start) per piece, on the device: the
    fewest whole chunks before the piece's first (at most WARMUP_MAX) whose summed log2 max
    decay (over heads and key channels) + WARMUP_MIX_LOG2 is <= WARMUP_LOG2; else every chunk
    before it (exact: the piece then starts where its sequence does)."""
    bound = decay.amax(dim=(1, 2)).log2()  # (chunk slots,): -inf where a decay underflowed
    c0 = piece_first.long()
    back = c0 - first.long().repeat_interleave(parts)  # whole chunks before the piece
    j = torch.arange(1, WARMUP_MAX + 1, device=decay.device)
    walked = bound[(c0[:, None] - j).clamp_min(0)].cumsum(1) + WARMUP_MIX_LOG2
    ok = (walked <= WARMUP_LOG2) & (j <= back[:, None])
    warm = torch.where(ok.any(1), ok.int().argmax(1) + 1, back)
    return warm.to(torch.int32), warm == back


def _pieces(ops: dict, v, initial_state, cu_seqlens, dst, final_state, parts: int) -> None:
    """Each sequence cut into `parts` pieces of whole chunks (`_segment_offsets`), all in one
    launch of the `warmup` recurrence (cuDNN kda_hopper_cuda's sequence parallelism): piece
    p > 0 starts from zero `_warmup_chunks` before its first row and stores o from that row on;
    piece 0, and any piece whose warm-up reaches its sequence's start, starts from the initial
    state and is exact. The error: what the dropped state adds after the warm-up, under 2^-20
    max |S| only where the heuristic above holds (a heuristic, not a bound: see the comment
    above WARMUP_LOG2; assumes beta |k|^2 <= 2: unit keys, the bench's and l2norm's).
    One pass over the operands, so the bytes of the direct launch plus the warm-up chunks."""
    n = final_state.shape[0]
    cu = _segment_offsets(cu_seqlens, parts)
    first = _segment_first(cu_seqlens, ops["first"], cu, parts)
    warm, from_start = _warmup_chunks(ops["decay"], ops["first"], first, parts)
    # pieces past a short sequence's end (start = end, not on a chunk boundary) walk nothing;
    # the final state is the last non-empty piece's (or piece 0's: the initial state)
    full = (cu[1:] > cu[:-1]).view(n, parts)
    warm = torch.where(full.flatten(), warm, 0).to(torch.int32)
    last = torch.arange(n, device=v.device) * parts + (full.sum(1) - 1).clamp_min(0)
    init = None
    if initial_state is not None:
        init = torch.where(from_start[:, None, None, None],
                           initial_state.float().repeat_interleave(parts, 0), 0.0)  # fmt: skip
    final = torch.empty(n * parts, *final_state.shape[1:], dtype=torch.float32, device=v.device)
    _recurrence(ops, v, init, cu, first, dst, final, warm=warm)
    final_state.copy_(final[last])
