"""Golden steps: inputs and outputs of a few representative steps of the eager torch step graph, in
polygraphy's JSON format, and the polygraphy comparison of an engine against them.

Every export writes `golden/inputs.json` (a JSON list of feed dicts, one per step: what
`polygraphy run --load-inputs` reads) and `golden/outputs.json` (polygraphy `RunResults` of one
runner, "eager-torch": what `--load-outputs` reads). They come from `PagedStep(functional=True)` on the
same weights in the exported dtype, run eagerly with the reference kernels, so they share no code
with ONNX Runtime's reference functions or TensorRT's Triton plugins. The steps:

* `prefill`: one sequence's first chunk, over several pages of both cache groups;
* `mixed`: that sequence decodes one token while a second sequence prefills a chunk;
* `decode`: both decode (T == B, the decode launch shape, which TensorRT runs split-K).

Each step's arena is the previous step's `arena_out`, so later steps read KV the earlier ones wrote;
frames are handed out in a shuffled order and one spare frame is never written, so a wrong page
lookup or a stray write shows in `arena_out`. The sliding table of a step holds only the pages a
query can still see (`sliding_first` > 0 once a sequence outgrows the window).

`compare` runs any polygraphy runner over the golden inputs and compares with `SimpleCompareFunc`
(max absolute error per output against a per-dtype tolerance). `g4rt check ENGINE_DIR` picks the
runner: ONNX Runtime (`OnnxrtRunner`) or TensorRT (`TrtRunner`, plugins registered).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from g4rt.models.layout import PageGeometry
from g4rt.models.profiles import ProfileError, check_step, step_sizes
from g4rt.models.step import OUTPUTS, StepBatch
from g4rt.plugins.reference import window_left

GOLDEN_DIR = "golden"
INPUTS_FILE = f"{GOLDEN_DIR}/inputs.json"
OUTPUTS_FILE = f"{GOLDEN_DIR}/outputs.json"
RUNNER = "eager-torch"
STEPS = ("prefill", "mixed", "decode")
SEED = 1234
# Max absolute error per output, by engine dtype, against the eager torch step. float32: ONNX
# Runtime's reference functions against torch differ by <= 1.3e-4 on the tiny models' logits and
# <= 5e-6 on the arena (summation order; tests/test_export_check.py prints them). float16 and
# bfloat16 allow a few units in the last place of values of magnitude ~10 (logits) and ~4 (K/V);
# not yet measured against an engine: calibrate on the first TensorRT run (DESIGN.md).
TOLERANCES = {
    "float32": {"logits": 1e-3, "arena_out": 1e-4},
    "float16": {"logits": 5e-2, "arena_out": 1e-2},
    "bfloat16": {"logits": 2.5e-1, "arena_out": 6e-2},
}


class GoldenError(RuntimeError):
    pass


@dataclass
class _Seq:
    """One golden sequence: its tokens and the frames holding its pages, per cache group."""
    tokens: list
    frames: dict
    done: int = 0  # positions already in the cache


def _plan(geometry: PageGeometry, vocab: int) -> tuple[list, int]:
    """[(step name, [(seq, q_len)])] and the frame count. Lengths follow the sliding page size, so
    every export crosses sliding page boundaries with few tokens (and, on the tiny test models, full
    ones too; the published sizes' full pages hold 32-160 positions)."""
    ps = geometry.page_tokens["sliding"]
    first_chunk = 2 * ps + 3
    second_chunk = ps + 1
    g = torch.Generator().manual_seed(SEED)
    lens = (first_chunk + 2, second_chunk + 1)
    seqs = [_Seq(torch.randint(1, vocab, (n,), generator=g).tolist(), {}) for n in lens]
    need = {grp: [geometry.pages_for(grp, n) for n in lens] for grp in ("sliding", "full")}
    total = sum(sum(v) for v in need.values()) + 1  # + one spare frame nobody writes
    order = torch.randperm(total, generator=g).tolist()
    for grp in ("sliding", "full"):
        for s, n in zip(seqs, need[grp]):
            s.frames[grp], order = order[:n], order[n:]
    steps = [("prefill", [(0, first_chunk)]), ("mixed", [(0, 1), (1, second_chunk)]), ("decode", [(0, 1), (1, 1)])]
    return [(name, [(seqs[i], q) for i, q in work]) for name, work in steps], total


def _batch(work, geometry: PageGeometry, window: int | None) -> StepBatch:
    """The StepBatch of one step (the runtime's contract, models/step.py)."""
    ps, pf = geometry.page_tokens["sliding"], geometry.page_tokens["full"]
    wl = window_left(window)
    token_ids, positions, s_slots, f_slots, cu, kv_lens, firsts, rows = [], [], [], [], [0], [], [], []
    s_rows, f_rows = [], []
    for seq, q in work:
        lo, hi = seq.done, seq.done + q
        pos = list(range(lo, hi))
        token_ids += seq.tokens[lo:hi]
        positions += pos
        s_slots += [seq.frames["sliding"][p // ps] * ps + p % ps for p in pos]
        f_slots += [seq.frames["full"][p // pf] * pf + p % pf for p in pos]
        first = max(0, lo - wl) // ps if wl >= 0 else 0  # pages no query of this step can see are gone
        s_rows.append(seq.frames["sliding"][first:geometry.pages_for("sliding", hi)])
        f_rows.append(seq.frames["full"][:geometry.pages_for("full", hi)])
        firsts.append(first)
        cu.append(cu[-1] + q)
        kv_lens.append(hi)
        rows.append(cu[-1] - 1)
        seq.done = hi

    def table(rows_):
        width = max(len(r) for r in rows_)
        return torch.tensor([r + [0] * (width - len(r)) for r in rows_], dtype=torch.int32)

    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return StepBatch(token_ids=i32(token_ids), positions=i32(positions), cu_q=i32(cu), kv_lens=i32(kv_lens),
                     sliding_table=table(s_rows), sliding_first=i32(firsts), sliding_slots=i32(s_slots),
                     full_table=table(f_rows), full_slots=i32(f_slots), logits_rows=i32(rows))


def _host(t: torch.Tensor):
    """numpy where numpy has the dtype (what ONNX Runtime takes), else the torch tensor (bfloat16;
    polygraphy's JSON and TrtRunner take both)."""
    return t if t.dtype == torch.bfloat16 else t.numpy()


@torch.no_grad()
def golden_steps(step: torch.nn.Module, geometry: PageGeometry, dtype: torch.dtype) -> tuple[list, list]:
    """Run the eager step graph `step` (PagedStep(functional=True)) on the golden steps: returns the
    feed dicts and the output dicts, in step order."""
    cfg = geometry.layout.config
    plan, frames = _plan(geometry, cfg.vocab_size)
    arena = torch.zeros(frames, geometry.frame_elems, dtype=dtype)
    feeds, outputs = [], []
    for _, work in plan:
        batch = _batch(work, geometry, cfg.sliding_window)
        logits, arena_out = step(arena, *batch.tensors())
        feeds.append({"arena": _host(arena), **{n: t.numpy() for n, t in zip(StepBatch.names(), batch.tensors())}})
        outputs.append(dict(zip(OUTPUTS, (_host(logits.float()), _host(arena_out)))))
        arena = arena_out
    return feeds, outputs


def write_goldens(step: torch.nn.Module, geometry: PageGeometry, out_dir: str | Path, dtype: torch.dtype) -> dict:
    """Write golden/inputs.json and golden/outputs.json into `out_dir`; returns the manifest's `golden` entry."""
    from polygraphy.comparator import RunResults
    from polygraphy.json import save_json

    out = Path(out_dir)
    (out / GOLDEN_DIR).mkdir(parents=True, exist_ok=True)
    feeds, outputs = golden_steps(step, geometry, dtype)
    with _quiet():
        save_json(feeds, str(out / INPUTS_FILE))
        results = RunResults()
        results.add(outputs, runner_name=RUNNER)
        results.save(str(out / OUTPUTS_FILE))
    return {"inputs": INPUTS_FILE, "outputs": OUTPUTS_FILE, "steps": list(STEPS), "runner": RUNNER,
            "frames": int(feeds[0]["arena"].shape[0])}


def tolerances(dtype: str, overrides: dict | None = None) -> dict:
    if dtype not in TOLERANCES:
        raise GoldenError(f"no golden tolerances for dtype {dtype!r}; known: {', '.join(TOLERANCES)}")
    tol = dict(TOLERANCES[dtype])
    for name, value in (overrides or {}).items():
        if name not in tol:
            raise GoldenError(f"tolerance for unknown output {name!r}; outputs: {', '.join(tol)}")
        tol[name] = float(value)
    return tol


def compare(manifest: dict, engine_dir: str | Path, runner, tol: dict) -> dict:
    """Run polygraphy `runner` over the golden inputs of `engine_dir` and compare with the golden
    outputs. Returns {"passed", "runner", "tolerances", "steps": [{"step", "outputs": {name:
    {"max_abs", "max_rel", "passed"}}}]}."""
    from polygraphy.comparator import Comparator, RunResults, SimpleCompareFunc
    from polygraphy.json import load_json

    entry = manifest.get("golden")
    if not entry:
        raise GoldenError(f"{engine_dir}: the manifest has no 'golden' entry (exported before goldens existed; "
                          f"re-export with `g4rt export` or `g4rt build`)")
    root = Path(engine_dir)
    with _quiet():
        feeds = load_json(str(root / entry["inputs"]))
    if manifest.get("profiles"):
        for name, feed in zip(entry["steps"], feeds):
            try:
                check_step(manifest["profiles"], step_sizes(feed))
            except ProfileError as e:
                raise GoldenError(f"golden step {name!r}: {e}") from None
    with _quiet():
        golden = RunResults.load(str(root / entry["outputs"]))
        ran = Comparator.run([runner], data_loader=feeds)
        both = RunResults()
        both.append((entry["runner"], golden[entry["runner"]]))
        both.append(ran[0])
        func = SimpleCompareFunc(atol=tol, rtol=0.0, check_error_stat="max")
        accuracy = Comparator.compare_accuracy(both, compare_func=func)
    (pair, per_step), = accuracy[0].items()
    steps = []
    for name, result in zip(entry["steps"], per_step):
        outs = {out: {"max_abs": float(r.max_absdiff), "max_rel": float(r.max_reldiff), "passed": bool(r)}
                for out, r in result.items()}
        steps.append({"step": name, "outputs": outs})
    passed = len(steps) == len(entry["steps"]) and all(o["passed"] for s in steps for o in s["outputs"].values())
    return {"passed": passed, "runner": pair[1], "tolerances": tol, "steps": steps}


def _quiet():
    """Polygraphy logs every step at INFO; the check prints its own table instead."""
    from polygraphy.logger import G_LOGGER
    return G_LOGGER.verbosity(G_LOGGER.ERROR)
