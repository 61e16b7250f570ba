"""`forgekernel selftest`: launch semantics the timing harness relies on, checked on the GPU.

Our kernels launch through TVM-FFI on torch's current stream; if they did not, a CUDA graph
capture would miss them and event timings would measure nothing. Checked: a side stream, a
captured graph replayed on fresh inputs, the eager path and torch.compile(fullgraph=True), each
against torch.
"""

from __future__ import annotations

import torch


def _close(x: torch.Tensor, y: torch.Tensor) -> bool:
    return bool(torch.isfinite(x).all()) and (x.float() - y.float()).abs().max().item() < 0.5


def run_selftest() -> bool:
    import forgekernel

    dev = torch.device("cuda")
    a = torch.randn(2048, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(3072, 4096, device=dev, dtype=torch.bfloat16)
    want = a @ b.t()
    results = {"eager": _close(forgekernel.gemm(a, b), want)}

    # Views TMA cannot read in place (transposed A, misaligned B, a column slice as out) are
    # copied, never misread.
    a_t = a.t().contiguous().t()
    b_off = torch.empty(b.numel() + 1, device=dev, dtype=b.dtype)[1:].view_as(b).copy_(b)
    wide = torch.full((2048, 3072 + 8), float("nan"), device=dev, dtype=torch.bfloat16)
    forgekernel.gemm(a_t, b_off, out=wide[:, 8:])
    results["strided_views"] = _close(wide[:, 8:], want) and bool(wide[:, :8].isnan().all())

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = forgekernel.gemm(a, b)
    torch.cuda.current_stream().wait_stream(side)
    results["side_stream"] = _close(got, want)

    out = torch.full((2048, 3072), float("nan"), device=dev, dtype=torch.bfloat16)
    forgekernel.gemm(a, b, out=out)  # warm (load) outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forgekernel.gemm(a, b, out=out)
    a.copy_(torch.randn_like(a))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    results["cuda_graph"] = _close(out, a @ b.t())

    compiled = torch.compile(lambda x, y: forgekernel.gemm(x, y) * 2, fullgraph=True)
    results["torch_compile"] = _close(compiled(a, b) / 2, a @ b.t())

    for name, ok in results.items():
        print(f"selftest {name:12s} {'PASS' if ok else 'FAIL'}")
    return all(results.values())
