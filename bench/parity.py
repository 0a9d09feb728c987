"""Real-size correctness: every published size at full depth, our engines against a float64 oracle.

    python -m g4rt.bench.parity --out DIR [--sizes e2b,e4b,26b-a4b,31b] [--engines eager,inductor]
                                [--kernels triton,reference] [--init deep] [--decode 32] [--factor 4]
                                [--break-window]

Per size, one process builds the model once with seeded random float32 weights on the GPU
(`random_model(init="deep")`, the non-chaotic init: DESIGN.md, "Random weights: two inits"), then:

1. each arm (engine x kernels) runs one request through the runtime, decoding greedily: a prompt of
   2W + `--extra` tokens (W the sliding window, so every sliding layer drops keys), chunked prefill,
   then `--decode` decode steps; its logits rows are the prompt's last position and one per decode
   step. The first arm's tokens are the continuation the references follow; an arm whose tokens leave
   it fails, and only its rows up to that token are compared (later ones saw other inputs). The
   inductor engine with reference kernels runs without decode CUDA graphs (`CompiledSteps`);
2. Hugging Face `Gemma4ForCausalLM` (sdpa attention, its eager experts loop) holding the very same
   tensors runs one forward over prompt + continuation in float32;
3. the oracle: the same HF model in float64 (`float64_streamed`: each module gets float64 copies of its
   weights only while it runs, so the 31B's 123 GB of fp32 weights plus one fp64 layer fit one H200,
   where a whole fp64 31B, 245 GB, would not), with HF's internal fp32 casts kept at fp64
   (`KeepFloat64`).

On MoE sizes steps 2 and 3 also follow the arm's expert choices (`routing_forced`; recorded by a hook
on each router, `RoutingRecord`), as they follow its tokens: routing is discrete, and fp32 rounding
alone decides near-tied choices either way (DESIGN.md, "Random weights: two inits"). Each choice must
then trail the oracle's own k-th probability by at most `--routing-tol`. An arm whose routing was not
seen (CUDA-graph replays run no hook) is compared through an observed arm whose logits it equals bit
for bit, and fails if there is none.

Errors are max |logits - oracle| / max |oracle| over the compared rows. An arm passes when its error
is at most `--factor` times HF-fp32's own error, measured in the same run: rounding alone then explains
it. `tokens_equal_hf32_greedy`: the arm's tokens are the continuation and so is HF fp32's argmax on
every row, so HF fp32 decoding greedily would have produced exactly our tokens.

With several sizes, each runs in a fresh process (the same command with one `--sizes`): nothing one
size leaves on the GPU can crowd the next. `--memory-gib` lets sizes whose planned memory fits together
run side by side (most of a size's time is CPU-bound compilation).

`--break-window` runs our engines with the sliding window W-1 (what an off-by-one window mask in
a kernel computes) against the true model: the command must then fail. Each record is appended to
DIR/parity.jsonl as it is made, so a run cut short keeps what it did. Exit status 0 iff every arm
passed.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from g4rt.models.checkpoint import INITS, hf_config_dict, model_shapes, random_model
from g4rt.models.config import PUBLISHED, load_config
from g4rt.models.layout import KVLayout, PageGeometry
from g4rt.plugins.ops import check_kernels
from g4rt.runtime.admission import promise_for
from g4rt.runtime.engines.inductor import InductorEngine
from g4rt.runtime.llm import LLM
from g4rt.runtime.sampling import SamplingParams
from g4rt.runtime.scheduler import SchedulerConfig

from .common import first_differences, log_json

F32, F64 = torch.float32, torch.float64
LOG = "parity.jsonl"


# ---- the oracle: HF on our tensors, in float32 or in float64 ------------------------------------

class KeepFloat64(TorchFunctionMode):
    """Inside it, no float64 tensor is rounded to float32.

    HF's Gemma 4 computes its norms (`x.float()`, `weight.float()`) and the router softmax
    (`dtype=torch.float32`) in fp32: an upcast for a bf16 model, but in a float64 run the same casts
    round the oracle to fp32 at every norm (on a tiny model that leaves it 1e-7 from true float64,
    a fifth of fp32's own error). Here those casts return the float64 tensor and fp32 `dtype=`
    arguments become fp64; `kept` counts them. The RoPE tables stay as every implementation builds
    them, in fp32 from the integer positions (an int -> fp32 cast is not a float64 one).
    """

    def __init__(self):
        super().__init__()
        self.kept = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if src is not None and src.dtype == F64:
            if func is torch.Tensor.float or (func is torch.Tensor.type_as and args[1].dtype == F32):
                self.kept += 1
                return src
            if func in (torch.Tensor.to, torch.Tensor.type) and any(a is F32 for a in args[1:]):
                self.kept += 1
                args = tuple(F64 if a is F32 else a for a in args)
        if kwargs.get("dtype") is F32 and any(isinstance(a, torch.Tensor) and a.dtype == F64 for a in args):
            self.kept += 1
            kwargs["dtype"] = F64
        return func(*args, **kwargs)


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside hold their parameters on the meta device (nothing allocated); buffers are real."""
    register = nn.Module.register_parameter

    def on_meta(self, name, param):
        register(self, name, None if param is None else nn.Parameter(param.to("meta"), param.requires_grad))

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def hf_sharing(model, cfg=None):
    """HF `Gemma4ForCausalLM` of `cfg` (default: the model's) whose parameters are `model`'s own tensors
    (no copy: a 31B in fp32 fits the GPU once, not twice). sdpa attention and the eager experts loop,
    which run in float64 too (grouped_mm does not)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    p = next(model.parameters())
    hf_cfg = Gemma4TextConfig(**hf_config_dict(cfg or model.config, str(p.dtype).removeprefix("torch.")),
                              attn_implementation="sdpa", experts_implementation="eager")
    with _parameters_on_meta():
        hf = Gemma4ForCausalLM(hf_cfg)
    hf.config._attn_implementation = "sdpa"
    hf.config._experts_implementation = "eager"
    for mod in hf.modules():
        for name, b in mod._buffers.items():
            if b is not None:
                mod._buffers[name] = b.to(p.device)
    missing, unexpected = hf.load_state_dict({f"model.{k}": v for k, v in model.state_dict().items()},
                                             strict=False, assign=True)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"HF state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    hf.lm_head.weight = hf.model.embed_tokens.weight
    empty = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if empty:
        raise RuntimeError(f"HF tensors left without data: {empty[:5]}")
    return hf.eval()


def _streamed_units(hf) -> list[nn.Module]:
    """What `float64_streamed` converts one at a time: each decoder layer, each other top-level module
    that holds weights (embeddings, PLE projection and norm, final norm), and the lm_head."""
    m = hf.model
    others = [c for c in m.children() if c is not m.layers and next(c.parameters(), None) is not None]
    return others + list(m.layers) + [hf.lm_head]


@contextlib.contextmanager
def float64_streamed(hf):
    """Run `hf` (fp32 weights) in float64, one unit at a time (`_streamed_units`): a unit gets float64
    copies of its parameters and persistent buffers (exact: every fp32 value is a double) right before
    it runs and its own tensors back right after, so the extra memory is the largest unit in fp64.
    Yields the `KeepFloat64` mode it runs under."""
    def swap_in(mod, args):
        saved = []
        for sub in mod.modules():
            for store in (sub._parameters, sub._buffers):
                for name, t in store.items():
                    if t is None or not t.is_floating_point() or name in sub._non_persistent_buffers_set:
                        continue
                    saved.append((store, name, t))
                    t64 = t.detach().to(F64)
                    store[name] = nn.Parameter(t64, requires_grad=False) if isinstance(t, nn.Parameter) else t64
        mod._fp32_tensors = saved

    def swap_out(mod, args, out):
        for store, name, t in mod._fp32_tensors:
            store[name] = t
        del mod._fp32_tensors

    handles = []
    for unit in _streamed_units(hf):
        handles += [unit.register_forward_pre_hook(swap_in), unit.register_forward_hook(swap_out)]
    try:
        with KeepFloat64() as keep:
            yield keep
    finally:
        for h in handles:
            h.remove()


@torch.inference_mode()
def hf_logits(hf, ids: list[int], rows: int, float64: bool = False) -> tuple[torch.Tensor, int]:
    """HF's logits of the last `rows` positions of one forward over `ids` without a cache (each position
    sees exactly the tokens before it, as prefill plus teacher-forced decode does), and the number of
    fp32 casts the float64 run kept at fp64 (0 in float32)."""
    x = torch.tensor([ids], device=hf.lm_head.weight.device)
    with float64_streamed(hf) if float64 else contextlib.nullcontext() as keep:
        out = hf(input_ids=x, use_cache=False, logits_to_keep=rows).logits[0]
    kept = keep.kept if float64 else 0
    if float64 and (out.dtype != F64 or kept == 0):
        raise RuntimeError(f"the oracle did not run in float64 (logits {out.dtype}, {kept} casts kept)")
    return out, kept


# ---- our engines ----------------------------------------------------------------------------------

@contextlib.contextmanager
def sliding_window(model, window: int):
    """`model` with every sliding layer attending over `window` keys (the weights unchanged): what a
    kernel with an off-by-one window computes when `window` is W-1. Restored on exit."""
    saved = model.config, model.layout, [layer.self_attn.kv for layer in model.layers]
    model.config = dataclasses.replace(saved[0], sliding_window=window)
    model.layout = KVLayout.from_config(model.config, saved[1].dtype)
    for layer, kv in zip(model.layers, model.layout.layers):
        layer.self_attn.kv = kv
    try:
        yield model
    finally:
        model.config, model.layout = saved[0], saved[1]
        for layer, kv in zip(model.layers, saved[2]):
            layer.self_attn.kv = kv


class CompiledSteps:
    """The inductor engine's compiled step for every step, decode included, without its decode CUDA
    graphs: the reference ops read batch sizes on the host (`.tolist()`), which graph capture forbids.
    How the inductor engine runs with reference kernels here."""

    def __init__(self, engine):
        self.engine, self.geometry, self.config, self.arena = engine, engine.geometry, engine.config, engine.arena

    @torch.inference_mode()
    def step(self, batch, seq_ids=()):
        return self.engine.compiled(*batch.to(self.engine.device).tensors())

    def release(self, seq_id: int) -> None:
        """Nothing to do: the runtime owns the pages."""


def make_llm(model, engine: str, kernels: str, prompt_len: int, decode: int, chunk: int):
    """A one-request runtime (greedy logits recorded) over `engine` ("eager" | "inductor") with `kernels`,
    and the PagedStep module its steps run (`RoutingRecord.watch`)."""
    cfg = SchedulerConfig(max_num_batched_tokens=chunk, chunk=chunk, max_num_seqs=1)
    model.set_kernels(kernels)
    geometry = PageGeometry.build(model.layout)
    frames = promise_for(geometry, prompt_len, decode + 1, chunk).frames
    if engine == "eager":
        llm = LLM.paged(model, num_frames=frames, config=cfg, record_logits=True)
        return llm, llm.engine.paged
    torch._dynamo.reset()  # a fresh compile per arm: no graphs of another size or kernels, no recompile limit
    torch._dynamo.utils.counters.clear()
    compiled = InductorEngine(model, geometry, frames)
    return (LLM(compiled if kernels == "triton" else CompiledSteps(compiled), frames, cfg,
                eos_ids=model.config.eos_token_ids, record_logits=True), compiled.module.paged)


def run_arm(llm, prompt: list[int], decode: int) -> tuple[torch.Tensor, list[int]]:
    """Greedy generation of decode + 1 tokens: the logits rows [decode + 1, V] fp32 that chose them (the
    prompt's last position, then one per decode step) and the tokens."""
    (out,) = llm.generate([prompt], SamplingParams(max_new_tokens=decode + 1, ignore_eos=True))
    if out.error:
        raise RuntimeError(out.error)
    return torch.stack(out.logits), out.token_ids


class RoutingRecord:
    """Every call's top-k choice of each of our routers (they return (w, idx)), as sorted expert ids, with
    the real token count of each step of the engine it `watch`es: the engines compute a step on padded
    rows (plugins/buckets.py token_bucket), whose choices are not the request's. The hooks run outside
    any compiled graph (a graph break at each router in the compiled reference arm); CUDA-graph replays
    run none, so their steps are not observed (`routing` is None)."""

    def __init__(self, routers: list[nn.Module]):
        self.calls: list[list[torch.Tensor]] = [[] for _ in routers]
        self.steps: list[int] = []

        def hook(i):
            @torch.compiler.disable
            def record(mod, args, out):
                self.calls[i].append(out[-1].sort(dim=-1).values)
            return record
        self._handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]

    def watch(self, paged: nn.Module) -> None:
        """Count the tokens of each step the engine's PagedStep `paged` runs (args: arena, token_ids, ...)."""
        self._handles.append(paged.register_forward_pre_hook(lambda mod, args: self.steps.append(args[1].shape[0])))

    def routing(self, positions: int) -> torch.Tensor | None:
        """The choices [layers, positions, k] of the real rows, or None where they do not cover `positions`
        tokens step by step (no router, or some steps ran as CUDA-graph replays)."""
        calls, steps = self.calls, self.steps
        if not calls or not calls[0] or any(len(layer) != len(steps) for layer in calls):
            return None
        idx = torch.stack([torch.cat([c[:t] for c, t in zip(layer, steps)]) for layer in calls])
        return idx if idx.shape[1] == positions else None

    def __enter__(self) -> "RoutingRecord":
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()


@contextlib.contextmanager
def routing_forced(hf_routers: list[nn.Module], idx: torch.Tensor | None):
    """HF's routers take the expert ids `idx` [layers, positions, k] (one forward over all positions, one
    call per router) instead of their own top-k, with HF's weights for them: their probabilities
    renormalised, times per_expert_scale. As the references follow an arm's tokens, they follow its
    discrete routing, so what is compared is arithmetic. Yields per router the relative margin by which
    the forced choice trails HF's own k-th probability [positions] (0 where HF would choose the same)."""
    margins = [None] * len(hf_routers)

    def hook(i):
        def force(mod, args, out):
            probs, ids = out[0], idx[i].to(out[0].device)
            kth = probs.topk(ids.shape[-1], dim=-1).values[..., -1]
            chosen = probs.gather(-1, ids)
            margins[i] = ((kth - chosen.min(-1).values) / kth).clamp(min=0)
            w = chosen / chosen.sum(dim=-1, keepdim=True)
            return probs, w * mod.per_expert_scale[ids], ids
        return force

    handles = [] if idx is None else [r.register_forward_hook(hook(i)) for i, r in enumerate(hf_routers)]
    try:
        yield margins
    finally:
        for h in handles:
            h.remove()


def references(hf, ids: list[int], rows: int, forced: torch.Tensor | None = None) -> dict:
    """HF fp32 and the float64 oracle over `ids` (their last `rows` logits rows), both routing as
    `forced` says when given (`routing_forced`), with the oracle's margins behind the forced choices."""
    hf_routers = [layer.router for layer in hf.model.layers if layer.enable_moe_block]
    t = time.perf_counter()
    with routing_forced(hf_routers, forced):
        hf32, _ = hf_logits(hf, ids, rows)
    hf32_s = time.perf_counter() - t
    t = time.perf_counter()
    with routing_forced(hf_routers, forced) as margins:
        oracle, kept = hf_logits(hf, ids, rows, float64=True)
    r = {"hf32": hf32, "oracle": oracle, "kept": kept, "hf32_s": hf32_s, "oracle_s": time.perf_counter() - t,
         "hf32_err": rel_err(hf32, oracle)}
    if forced is not None:
        m = torch.stack(margins)
        worst = m.flatten().argmax().item()
        r["routing"] = {"choices": m.numel(), "differ_from_oracle": int((m > 0).sum()),
                        "max_margin": float(f"{m.max().item():.3g}"),
                        "max_margin_at": {"layer": worst // m.shape[1], "position": worst % m.shape[1]}}
    return r


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| over every row, in float64."""
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def release(llm) -> None:
    arena = getattr(llm.engine, "arena", None)
    if arena is not None:
        arena.close()
    free_memory()


# ---- one size -------------------------------------------------------------------------------------

@dataclasses.dataclass
class Settings:
    engines: tuple[str, ...] = ("eager", "inductor")
    kernels: tuple[str, ...] = ("triton", "reference")
    init: str = "deep"
    decode: int = 32
    extra: int = 300
    chunk: int = 512
    factor: float = 4.0
    routing_tol: float = 1e-3
    break_window: bool = False
    seed: int = 0
    device: str = "cuda"


def check_size(cfg, name: str, s: Settings, log) -> list[dict]:
    """Every arm of one config against the oracle; returns the arm records (each has `pass`)."""
    t0 = time.perf_counter()
    if s.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = random_model(cfg, dtype=F32, device=s.device, seed=s.seed, init=s.init)
    W = cfg.sliding_window
    prompt_len = 2 * W + s.extra
    prompt = torch.randint(3, cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(s.seed + 1)).tolist()
    base = {"size": name, "layers": cfg.num_hidden_layers, "window": W, "init": s.init, "prompt_len": prompt_len,
            "decode": s.decode, "engine_window": W - 1 if s.break_window else W}
    log({**base, "stage": "build", "build_s": round(time.perf_counter() - t0, 1)})
    free_memory()  # the build's temporaries: kernels load their code and local memory outside torch's pool
    routers = [layer.router for layer in model.layers if layer.has_moe]
    positions = prompt_len + s.decode
    arms = []
    for engine in s.engines:
        for kernels in s.kernels:
            t, llm, arm = time.perf_counter(), None, {"engine": engine, "kernels": kernels}
            try:
                with sliding_window(model, W - 1) if s.break_window else contextlib.nullcontext(), \
                        RoutingRecord(routers) as record:
                    llm, paged = make_llm(model, engine, kernels, prompt_len, s.decode, s.chunk)
                    record.watch(paged)
                    arm["rows"], arm["tokens"] = run_arm(llm, prompt, s.decode)
                arm["routing"] = record.routing(positions)
            except Exception as e:  # record and go on: one broken arm must not hide the others
                arm["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
            if engine == "inductor" and "error" not in arm:
                stats = torch._dynamo.utils.counters["stats"]
                arm["compiled_graphs"] = stats["unique_graphs"]
            arm["arm_s"] = round(time.perf_counter() - t, 1)
            if llm is not None:
                release(llm)
            arms.append(arm)
            log({**base, "stage": "ran", **{k: v for k, v in arm.items() if k not in ("rows", "routing")}})
    path = next((a["tokens"] for a in arms if "tokens" in a), None)
    if path is None:
        return [log({**base, "stage": "arm", "engine": a["engine"], "kernels": a["kernels"], "pass": False,
                     "error": a["error"]}) for a in arms]
    hf = hf_sharing(model)
    ids, n = prompt + path[:-1], s.decode + 1
    own = references(hf, ids, n)
    top2 = own["oracle"].topk(2, dim=-1).values
    log({**base, "stage": "reference", "hf32_err_vs_fp64": own["hf32_err"], "hf32_s": round(own["hf32_s"], 1),
         "oracle_s": round(own["oracle_s"], 1), "oracle_casts_kept": own["kept"],
         "oracle_top2_gap_min": round((top2[:, 0] - top2[:, 1]).min().item(), 4),
         "hf32_greedy_is_path": own["hf32"].argmax(-1).tolist() == path, "path": path,
         "peak_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 1) if s.device == "cuda" else None})
    followed = {}  # the references that followed one arm's routing, by the routing's bytes

    def refs_for(arm) -> tuple[dict | None, str | None]:
        """The references this arm is compared with, or why there are none."""
        if not routers:
            return own, None
        route = arm["routing"]
        if route is None:
            # Its routing was not observable (CUDA-graph replays): its logits equal to the bit those of an
            # arm whose routing was seen mean the same choices.
            twin = next((a for a in arms if a is not arm and a.get("routing") is not None
                         and torch.equal(a["rows"], arm["rows"])), None)
            if twin is None:
                return None, "its routing was not observable and its logits equal no observed arm's"
            arm["routing_from"] = f"{twin['engine']} {twin['kernels']} (bit-equal logits)"
            route = twin["routing"]
        key = route.cpu().numpy().tobytes()
        if key not in followed:
            followed[key] = references(hf, ids, n, forced=route)
        return followed[key], None

    records = []
    for arm in arms:
        r = {**base, "stage": "arm", "engine": arm["engine"], "kernels": arm["kernels"], "arm_s": arm["arm_s"]}
        refs, why = (None, arm["error"]) if "error" in arm else refs_for(arm)
        if refs is None:
            records.append(log({**r, "pass": False, "error": why}))
            continue
        oracle, hf32_err = refs["oracle"], refs["hf32_err"]
        # Row i saw prompt + tokens[:i]: rows are comparable up to the first token off the path.
        (diff,) = first_differences([arm["tokens"]], [path])
        m = n if diff is None else diff + 1
        rows = arm["rows"][:m].to(oracle.device)
        # Per row, so an error carried by one row shows as such; their max is `rel_err` of all the rows.
        row_errs = ((rows.double() - oracle[:m]).abs().amax(-1) / oracle[:m].abs().max()).tolist()
        err = max(row_errs)
        routing_ok = "routing" not in refs or refs["routing"]["max_margin"] <= s.routing_tol
        r.update({"err_vs_fp64": err, "row_errs": [float(f"{e:.3g}") for e in row_errs], "hf32_err_vs_fp64": hf32_err,
                  "ratio": round(err / hf32_err, 2), "factor": s.factor, "rows_compared": m,
                  "first_difference_at": diff,
                  "tokens_equal_hf32_greedy": arm["tokens"] == path == refs["hf32"].argmax(-1).tolist(),
                  "pass": diff is None and err <= s.factor * hf32_err and routing_ok,
                  **{k: arm[k] for k in ("compiled_graphs", "routing_from") if k in arm},
                  **({"routing": {**refs["routing"], "tol": s.routing_tol}} if "routing" in refs else {})})
        records.append(log(r))
    return records


def memory_plan(cfg) -> dict[str, float]:
    """What one size's process holds at its peak, from the config alone (GiB): the fp32 weights (ours and
    HF's are the same tensors), the largest float64 unit of the streamed oracle, and `planned`, their sum
    plus 4 GiB of activations, caches and CUDA context. Measured peaks (models/results): E2B and E4B
    within 0.5 GiB of the first two's sum, 26B-A4B 2.5 GiB over it, the 31B 9.7 GiB over (134.6 GiB,
    5.7 above `planned`), so the plan is a lower bound for the 31B, which runs alone anyway under any
    limit below its plan plus the smallest other size's (E2B: 128.9 + 38.7 GiB)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    with torch.device("meta"):
        hf = Gemma4ForCausalLM(Gemma4TextConfig(**hf_config_dict(cfg, "float32")))
    weights = sum(s.numel() for s in model_shapes(cfg).values()) * 4 / 2 ** 30
    unit = max(sum(p.numel() for p in u.parameters()) for u in _streamed_units(hf)) * 8 / 2 ** 30
    return {"fp32_weights": weights, "largest_fp64_unit": unit, "planned": weights + unit + 4.0}


def run_sizes(argv: list[str], sizes: list[str], plan: dict[str, float], memory_gib: float) -> dict[str, int]:
    """Each size in a fresh process (the same command with one `--sizes`; the last one wins): nothing one
    size leaves on the GPU (allocator state, compiled graphs) can crowd another. In the given order, a
    size starts once the planned memory of those running plus its own fits `memory_gib` (always, when
    none is running). Returns each size's exit status."""
    waiting, running, codes = list(sizes), {}, {}
    while waiting or running:
        while waiting and (not running or sum(plan[n] for n in running) + plan[waiting[0]] <= memory_gib):
            n = waiting.pop(0)
            running[n] = subprocess.Popen([sys.executable, "-m", "g4rt.bench.parity", *argv, "--sizes", n])
        time.sleep(0.5)
        for n, proc in list(running.items()):
            if proc.poll() is not None:
                codes[n] = running.pop(n).returncode
    return {n: codes[n] for n in sizes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m g4rt.bench.parity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sizes", default=",".join(PUBLISHED), help="published sizes or config.json paths")
    d = Settings()
    ap.add_argument("--engines", default=",".join(d.engines))
    ap.add_argument("--kernels", default=",".join(d.kernels))
    ap.add_argument("--init", default=d.init, choices=INITS)
    ap.add_argument("--decode", type=int, default=d.decode, help="decode steps after the prompt")
    ap.add_argument("--extra", type=int, default=d.extra, help="prompt length beyond two sliding windows")
    ap.add_argument("--chunk", type=int, default=d.chunk, help="prefill chunk")
    ap.add_argument("--factor", type=float, default=d.factor, help="pass: error <= factor x HF-fp32's error")
    ap.add_argument("--routing-tol", type=float, default=d.routing_tol,
                    help="MoE: an arm's expert choice may trail the oracle's k-th probability by this (relative)")
    ap.add_argument("--break-window", action="store_true", help="our engines use window W-1: must fail")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--device", default=d.device)
    ap.add_argument("--memory-gib", type=float, default=0.0,
                    help="run sizes side by side while their planned memory (`memory_plan`) sums to at most this "
                         "(e.g. 130 on an H200: E2B and E4B together); 0: one size at a time")
    a = ap.parse_args(argv)
    engines, kernels = tuple(a.engines.split(",")), tuple(a.kernels.split(","))
    bad = set(engines) - {"eager", "inductor"}
    if bad:
        ap.error(f"--engines: unknown {', '.join(sorted(bad))}; choose from eager,inductor")
    for k in kernels:
        check_kernels(k, "--kernels")
    a.out.mkdir(parents=True, exist_ok=True)
    log = lambda r: log_json(a.out, r, name=LOG)  # noqa: E731
    sizes = a.sizes.split(",")
    if len(sizes) > 1:
        argv = list(sys.argv[1:] if argv is None else argv)
        plan = {n: memory_plan(load_config(n))["planned"] for n in sizes}
        log({"stage": "plan", "planned_gib": {n: round(g, 1) for n, g in plan.items()}, "memory_gib": a.memory_gib})
        codes = run_sizes(argv, sizes, plan, a.memory_gib)
        log({"stage": "summary", "exit_codes": codes, "pass": not any(codes.values())})
        return 0 if not any(codes.values()) else 1
    torch.set_float32_matmul_precision("highest")  # no TF32: fp32 means fp32, for us and for HF
    torch.backends.cudnn.allow_tf32 = False
    s = Settings(engines, kernels, init=a.init, decode=a.decode, extra=a.extra, chunk=a.chunk, factor=a.factor,
                 routing_tol=a.routing_tol, break_window=a.break_window, seed=a.seed, device=a.device)
    import transformers
    log({"stage": "setup", "torch": torch.__version__, "transformers": transformers.__version__,
         "gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "tf32": False,
         **dataclasses.asdict(s)})
    (name,) = sizes
    try:
        records = check_size(load_config(name), name, s, log)
        ok = bool(records) and all(r["pass"] for r in records)
    except Exception as e:
        ok = False
        log({"size": name, "stage": "size", "error": f"{type(e).__name__}: {e}",
             "trace": traceback.format_exc()[-3000:]})
    log({"stage": "size_summary", "size": name, "pass": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
