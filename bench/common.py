"""What every GPU bench shares: timers, the machine's ceilings (copy bandwidth, bf16 matmul rate), a
JSON-lines logger that keeps what a run did even when it is cut short, and where two arms' tokens part."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch


def sync() -> None:
    """Wait for the GPU, so wall-clock times cover the work (a no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def log_json(out: Path, record: dict, name: str = "runtime_bench.jsonl") -> dict:
    """Print one result and append it to DIR/name as it happens: a run cut short keeps what it did."""
    print(json.dumps(record), flush=True)
    with open(out / name, "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def first_differences(tokens, reference) -> list:
    """Per sequence, the first index where the greedy tokens differ (None: identical)."""
    return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None) for p, q in zip(tokens, reference)]


def time_to_first_token(generate, prompt, reps: int = 3) -> dict:
    """Seconds to the first token of `prompt`: one warm-up (compiles this prefill shape), then `reps` runs."""
    generate(prompt)
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        generate(prompt)
        sync()
        times.append(time.perf_counter() - t)
    return {"min_s": round(min(times), 4), "median_s": round(statistics.median(times), 4), "max_s": round(max(times), 4)}


_FLUSH = None


def time_ms(fn):
    """GPU ms of one call with a cold L2 and no host launch overhead.

    Eager timing of a ~5 us kernel measures Python launch cost, and a warm L2 (50 MB on the H200)
    would hold a whole sliding window. So: capture `reps` x [zero a 256 MiB buffer, fn] and
    `reps` x [zero the buffer] as CUDA graphs, and take the median difference over >= 5 replays
    of each, divided by reps (>= 20 measured calls in all). Falls back to do_bench (eager, L2
    flushed) where capture fails."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    try:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        reps = max(3, min(30, int(30 / max(start.elapsed_time(end), 1e-3))))  # ~30 ms per graph
        replays = max(5, -(-20 // reps))  # >= 20 measured calls in all
        graphs = []
        for with_fn in (True, False):
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()  # warm any lazy allocation on the capture stream
                with torch.cuda.graph(g, stream=s):
                    for _ in range(reps):
                        _FLUSH.zero_()
                        if with_fn:
                            fn()
            torch.cuda.current_stream().wait_stream(s)
            graphs.append(g)
        times = []
        for _ in range(replays):
            pair = []
            for g in graphs:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                g.replay()
                end.record()
                torch.cuda.synchronize()
                pair.append(start.elapsed_time(end))
            times.append((pair[0] - pair[1]) / reps)
        del graphs
        return max(sorted(times)[len(times) // 2], 1e-6)
    except Exception:  # noqa: BLE001 - not capturable: eager timing instead
        torch.cuda.synchronize()
        return time_ms_eager(fn)


def time_ms_eager(fn):
    """Median ms over >= 20 reps, L2 flushed between reps (triton.testing.do_bench)."""
    import triton.testing
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    est = start.elapsed_time(end) / 3
    return triton.testing.do_bench(fn, warmup=25, rep=max(100, 25 * est),
                                   return_mode="median")


def copy_bandwidth(n: int = 2 << 30) -> float:
    """Device-to-device copy of n bytes: bytes read + written per second, the bandwidth roofline
    every GPU measurement here is compared with (median, eager do_bench: exact for big ops)."""
    src = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = time_ms_eager(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / (t * 1e-3)


def ceilings(quick):
    n = (1 << 30) if quick else (2 << 30)
    bw = copy_bandwidth(n)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    bm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    tm = time_ms_eager(lambda: a @ bm)
    del a, bm
    torch.cuda.empty_cache()
    return {"copy_bytes": n, "copy_GBps": bw / 1e9, "matmul_TFLOPs": 2 * 8192 ** 3 / (tm * 1e-3) / 1e12}


CARVEOUT_ATTRIBUTE = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT (cuda.h)


def compile_health() -> dict:
    """Dynamo's frames since the process started (compiled, tried) and how many times a frame hit its recompile
    limit, past which Dynamo runs that code eager without failing: a benchmark of a compiled engine states both."""
    from torch._dynamo.utils import counters

    hits = sum(n for k, n in counters["unimplemented"].items() if "recompile limit" in k.lower())
    return {"dynamo_frames_ok": counters["frames"]["ok"], "dynamo_frames": counters["frames"]["total"],
            "recompile_limit_hits": hits}


def prefer_shared_carveout(percent: int, lib=None) -> None:
    """Every Triton and Gluon kernel loaded from now on prefers `percent` % of its SM's L1/shared memory as shared
    memory (cuFuncSetAttribute on the loaded function; `lib`, libcuda by default). Why an arm of its own: Triton's
    launcher sets a preference only for kernels above 48 KB of shared memory, so an SM running a small kernel
    under the driver's default carveout might not take a 90 KB program of the next launch until it drains. On the
    H200 it changes nothing at the E4B's batch 1 (export/results/README.md, "The shared-memory carveout"), whose
    late launch waits for the launch before it to let it in, not for shared memory. Call it before the first kernel
    loads."""
    import ctypes

    from triton import knobs

    if not 0 <= percent <= 100:
        raise ValueError(f"a shared-memory carveout is a percentage, 0-100, got {percent}")
    cuda = lib or ctypes.CDLL("libcuda.so.1")

    def hook(module, function, name, metadata_group, hash) -> None:
        if function is None:  # the hook's call before the module loads
            return
        rc = cuda.cuFuncSetAttribute(ctypes.c_void_p(function), CARVEOUT_ATTRIBUTE, percent)
        if rc != 0:
            raise RuntimeError(f"cuFuncSetAttribute(carveout {percent} %) failed for kernel {name}: CUresult {rc}")

    knobs.runtime.kernel_load_end_hook.add(hook)


def kernel_kinds(prof) -> dict:
    """GPU kernel time of a profiled step, summed by what the kernel does (cuBLAS names vary by
    version: anything that is not ours or Inductor's and reads like a GEMM counts as matmul)."""
    kinds, names = {}, {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        n, us = e.name, e.time_range.elapsed_us()
        kind = ("attention" if "_paged_attn" in n or "_combine" in n else "kv_write" if "_kv_write" in n else
                "rms_norm" if any(k in n for k in ("_rms_norm", "_router_inputs", "_normed_sum")) else
                "norm_rope" if "_norm_rope" in n else
                "gelu_mul" if "_gelu" in n else
                "inductor_fused" if n.startswith("triton_") else
                "matmul" if any(m in n.lower() for m in ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk")) else
                "other")
        kinds.setdefault(kind, [0, 0.0])
        kinds[kind][0] += 1
        kinds[kind][1] += us
        names[n[:90]] = names.get(n[:90], 0.0) + us
    top = sorted(names.items(), key=lambda kv: -kv[1])[:12]
    return {"kernels": sum(k[0] for k in kinds.values()), "kernel_ms": round(sum(k[1] for k in kinds.values()) / 1e3, 3),
            "by_kind": {k: {"count": c, "ms": round(us / 1e3, 3)} for k, (c, us) in sorted(kinds.items())},
            "top": [[n, round(us / 1e3, 3)] for n, us in top]}
