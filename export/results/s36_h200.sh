#!/usr/bin/env bash
# Session 36's device calls: a one-byte (e4m3) KV arena (`--kv-dtype float8_e4m3fn`) against the bf16 one, on
# this checkout. One PART per call:
#
#   tests  $TESTS (default tests/test_kv_fp8_gpu.py and tests/test_plugins_decode_gpu.py: the compiled kernels on
#          the GPU), the log kept as $OUT/gpu_tests.txt
#   kernels  the 31B's layers' decode at batch 64/128/256, context 200, tiles forced: `bench.kernels
#          --decode-batch [--decode-batch-tiles] --kv-dtype D` for D in $KV (default "bfloat16 float8_e4m3fn"),
#          for each of $TABLES (default "table tiles": BATCH_DECODE, BATCH_SMALL; `fma`: BATCH_FMA, a tree that
#          has it), at the batches $BATCHES (comma-separated; default the table's), the log kept as a .txt
#   steps  the 31B's decode steps at the batches $STEPS (default 64,128,256), arms $ARMS alternated (default
#          "bf16 fp8", a process each of at most $STEPS_CAP seconds, default 110): `bench.engine --config 31b
#          --skip-hf --batches "" --engines inductor --decode-steps $STEPS --reps 3`, the fp8 arm with
#          `--kv-dtype float8_e4m3fn` (three contexts as the requests grow); an arm TREE/bf16 or TREE/fp8 runs
#          ab/TREE (a `git archive --prefix=ab/TREE/g4rt/ REV`, carried) instead of this checkout; $STEPS_ARGS more
#          bench.engine flags, e.g. "--decode-temperature 1 --decode-top-k 64" (sampled rows instead of greedy)
#   tests and kernels run this checkout; `PKG=ab/TREE` runs that tree's instead
#
#   sampler  the token sampler's kernel, `bench.kernels --sampler`, arms $ARMS alternated (default "new radix new
#          radix": this checkout and ab/radix, a process each of at most $SAMPLER_CAP s), $OUT/sampler_ARM_N.json;
#          each case's `kernels_ms` gives its kernels' GPU ms a call (profiled), which tells the launch that moved
#     bash export/results/s36_h200.sh PART [budget_s]      # default 570 s; results under $OUT
# The calls of session 36 (the steps need needs_h200: batch 128 and 256 do not fit an H100's 80 GB beside the 31B's
# weights); export/results/README.md, "A one-byte KV arena", gives each call's commands and tree.
# Session 37 ran it on H100s (export/results/README.md, "The `fma` decode tile measured"). The next calls (needs_h200):
# main (the fma tile the default for groups of 2) against main before session 37, both arenas, at batch 64-256:
#   git archive --prefix=ab/pre/g4rt/ 4aa836a | tar -x      # then run with carry ["ab"]
#   ARMS="fp8 pre/fp8 bf16 pre/bf16 fp8 pre/fp8" STEPS_CAP=92 bash export/results/s36_h200.sh steps 570
#   ARMS="bf16 pre/bf16 fp8 pre/fp8 bf16 pre/bf16" STEPS_CAP=92 bash export/results/s36_h200.sh steps 570
#   KV="float8_e4m3fn bfloat16" TABLES="fma table" bash export/results/s36_h200.sh kernels 300   # fma: batch 16-256;
#     table: the full layer's MMA tiles (e4m3: 32 x 4 x 1, one stage, from an H100 sweep before the fp16 widening)
# Session 38 (no machine was lent) prepared three things for the fma tile, none measured: its key loop
# software-pipelined (`pipe`, BATCH_PIPE), a register cap (`maxnreg`, the tables' fifth element), and the branches
# `next/fma3d` (its K and V tiles loaded in the layout of their products: no pass through shared memory) and
# `next/pipe` (on it: the pipelined tile the default, 2 stages). Their calls, before the ones above (any card for the
# first two; carry ["ab"] with git archive --prefix=ab/f3d/g4rt/ next/fma3d and --prefix=ab/pipe/g4rt/ next/pipe):
#   call 1: O=$OUT; OUT=$O/k KV="bfloat16 float8_e4m3fn" TABLES="fma pipe" bash export/results/s36_h200.sh kernels 330
#   rm -f $O/k/*.log; OUT=$O/t PKG=ab/f3d TESTS="tests/test_plugins_decode_gpu.py tests/test_kv_fp8_gpu.py" \
#     bash export/results/s36_h200.sh tests 230; rm -f $O/t/gpu_tests.log $O/t/gpu.csv
#   call 2: PKG=ab/f3d KV="bfloat16 float8_e4m3fn" TABLES="fma pipe" bash export/results/s36_h200.sh kernels 330; rm $OUT/*.log
#   then the steps of the fastest tree against main (an H200 for bf16 batch 128 and 256), and `next/fma-norm` (on
#   next/fma3d: the fma decode norms its q itself; --prefix=ab/fnorm/g4rt/) against next/fma3d, e.g.
#   ARMS="bf16 pipe/bf16 fp8 pipe/fp8 bf16 pipe/bf16 fp8 pipe/fp8" STEPS_CAP=70 bash export/results/s36_h200.sh steps 570
#   ARMS="f3d/bf16 fnorm/bf16 f3d/bf16 fnorm/bf16 f3d/bf16 fnorm/bf16" STEPS_CAP=90 bash export/results/s36_h200.sh steps 570
# Session 39 ran, on one H100, the sampler part (new against radix) and the batch-64 steps of next/pipe-norm (ab/pn:
# next/fma-norm with next/pipe's default) against main, and next/pipe-norm's GPU tests (export/results/README.md, "The
# sampler's top-k by a radix select"). The next calls (carry ["ab"] with git archive --prefix=ab/pn/g4rt/
# next/pipe-norm, --prefix=ab/radix/g4rt/ next/radix, --prefix=ab/f3d/g4rt/ next/fma3d):
#   an H200 (needs_h200): next/pipe-norm at batch 64-256, both arenas, against main, before it is merged:
#     ARMS="bf16 pn/bf16 bf16 pn/bf16 bf16 pn/bf16" STEPS_CAP=90 bash export/results/s36_h200.sh steps 570
#     ARMS="fp8 pn/fp8 fp8 pn/fp8 fp8 pn/fp8" STEPS_CAP=90 bash export/results/s36_h200.sh steps 570
#   any card: the sampler's top-p-only rows on next/radix against main (slower on the default tile in session 39):
#     ARMS="new radix new radix new radix" SAMPLER_CAP=50 bash export/results/s36_h200.sh sampler 330
#   any card: where next/pipe-norm's batch-64 gain comes from, the fma tile plain and pipelined on main and
#   next/fma3d (--decode-batches keeps each table to the batches asked):
#     O=$OUT; export BATCHES=64,128 KV=bfloat16; OUT=$O/m TABLES="fma pipe" bash export/results/s36_h200.sh kernels 150
#     OUT=$O/f PKG=ab/f3d TABLES="fma pipe" bash export/results/s36_h200.sh kernels 150
# Session 40 (one H100, late; export/results/README.md, "The sampler's launches timed one by one") ran the sampler
# part (its kernels_ms: next/radix loses in the row kernel's serial third top-p round) and the kernel tables above
# (main and next/fma3d, both arenas): main now pipelines the fma tile below PIPE_BELOW programs an SM (batch 64);
# next/pipe-norm is not to be merged (its pipelining costs batch 128 16-30 %). The next calls:
#   an H200 (needs_h200): main against main before the batch-64 pipelining (2714f6d), both arenas:
#     git archive --prefix=ab/pre40/g4rt/ 2714f6d | tar -x
#     STEPS=64,128 ARMS="bf16 pre40/bf16 bf16 pre40/bf16 bf16 pre40/bf16" STEPS_CAP=90 bash export/results/s36_h200.sh steps 570
#     the same with fp8 and pre40/fp8 (the e4m3 arena: 3 stages at batch 64)
#   any card: the sampler with 4 split top-p rounds instead of 2, on main (`next/rounds4`) and on next/radix
#   (`next/radix-r4`), against both (git archive --prefix=ab/ARM/g4rt/ for r4 next/rounds4, radix next/radix,
#   rr4 next/radix-r4); a machine's first process of a tree compiles from a cold cache, so give it room:
#     ARMS="new r4 radix rr4 new r4 radix rr4 new r4 radix rr4" SAMPLER_CAP=60 bash export/results/s36_h200.sh sampler 570
# Session 41 (one H100; export/results/README.md, "The sampler's top-k cut by a radix select") ran the sampler with
# main's radix cut and 4 split rounds against main before it, and the batch-64 steps of main against 2714f6d (both
# arenas) and with Gemma's sampling. Only main survives between sessions (session 40's `next/*` branches were gone),
# so an arm is a commit on main or is rebuilt from its description. The next calls:
#   an H200 (needs_h200): main against 2714f6d at batch 64 and 128, both arenas (the issue's targets are the H200's):
#     git archive --prefix=ab/pre40/g4rt/ 2714f6d | tar -x; git archive --prefix=ab/m/g4rt/ main | tar -x
#     STEPS=64,128 ARMS="m/bf16 pre40/bf16 m/bf16 pre40/bf16 m/bf16 pre40/bf16" STEPS_CAP=90 bash export/results/s36_h200.sh steps 570
#     the same with m/fp8 and pre40/fp8
#   any card, with those archives: batch 64 with Gemma's sampling on main (4 split rounds; session 41 measured 2):
#     STEPS=64 STEPS_ARGS="--decode-temperature 1 --decode-top-k 64 --decode-top-p 0.95" \
#       ARMS="m/bf16 pre40/bf16 m/bf16 pre40/bf16 m/bf16 pre40/bf16" STEPS_CAP=80 bash export/results/s36_h200.sh steps 300
# Session 42 (the H200 refused all five starts; H100s for four calls; export/results/README.md, "The sampler's top-k
# by a pivot") ran the sampler with the pivot and gathering pass against main before it, the batch-64 steps with
# Gemma's sampling, and two gathering-pass arms. The next calls, with
#   git archive --prefix=ab/m/g4rt/ main | tar -x; git archive --prefix=ab/p36/g4rt/ 4aa836a | tar -x
#   an H200 (needs_h200): main's scoreboard at batch 64-256 against main before the fma tile (4aa836a), bf16:
#     STEPS=64,128,256 ARMS="m/bf16 p36/bf16 m/bf16 p36/bf16 m/bf16 p36/bf16" STEPS_CAP=95 bash export/results/s36_h200.sh steps 585
#   then the same with m/fp8 and p36/fp8 (the e4m3 arena at batch 256, past the first context)
#   any card: the sampler on main (its top_k_4000 case checks the whole-row cut on the GPU), 3 processes:
#     ARMS="new new new" SAMPLER_CAP=80 bash export/results/s36_h200.sh sampler 250
# Session 43 (the H200 refused both starts; H100s for five sampler calls; export/results/README.md, "The sampler's
# large top-k") ran main's top_k_4000 check, the gathered list (top-k 1,000) and no gathering above the groups. Not
# yet timed: the own listing of a row left without a list (cf2b5b6, 08160a5). The next calls, with
#   git archive --prefix=ab/m/g4rt/ main | tar -x; git archive --prefix=ab/p36/g4rt/ 4aa836a | tar -x
#   git archive --prefix=ab/p43/g4rt/ e7906e8 | tar -x      # main before the own listing
#   an H200 (needs_h200): main's scoreboard at batch 64-256 against main before the fma tile (4aa836a), bf16:
#     STEPS=64,128,256 ARMS="m/bf16 p36/bf16 m/bf16 p36/bf16 m/bf16 p36/bf16" STEPS_CAP=95 bash export/results/s36_h200.sh steps 585
#   then the same with m/fp8 and p36/fp8
#   any card: the own listing (top_k_4000) against main before it. A machine's first process of a tree compiled
#   the sampler's cases from a cold cache for 130-150 s in session 43, most of it the tile sweep, now opt-in
#   (`--sampler-tiles`, which p43 lacks: its arm still sweeps), so the first of each arm gets 170 s:
#     ARMS="m p43 m p43 m p43" SAMPLER_CAP=170 bash export/results/s36_h200.sh sampler 560
#   any card: the gathering pass's key loop software-pipelined (`gp`: its next tile's loads in flight, by cp.async
#   into 8 KB of shared memory, across the per-tile block-wide count and its barrier, which make every warp of a
#   program wait for the slowest load each tile; the loop reads at about 1.7 TB/s where the first pass, with no
#   per-tile reduction, reads at the copy bandwidth), built from main:
#     git archive --prefix=ab/gp/g4rt/ main | tar -x
#     sed -i '/def _gather_kernel/,/^$/s/in range(lo, hi, BLOCK)/in tl.range(lo, hi, BLOCK, num_stages=2)/' \
#       ab/gp/g4rt/plugins/triton_sampling.py    # the one loop of _gather_kernel; compiles (Triton 3.6) to 80
#       registers, 8,448 bytes of shared memory and LDGSTS copies (bench.compile_report --sampler --ir DIR)
#     ARMS="m gp m gp m gp" SAMPLER_CAP=120 bash export/results/s36_h200.sh sampler 500
# Session 44 (three H100 calls, then an H200 for five; export/results/README.md, "The e4m3 arena on an H200") ran
# the scoreboard above on both arenas, batch 1 of the E2B / E4B / 31B, the first token, the own listing, and the
# gathering pass in two stages (merged). The next calls, with git archive --prefix=ab/m/g4rt/ main | tar -x:
#   an H200: the 31B at batch 1 on main against 97aa10c (session 35's main; this session's card ran every
#   skinny-matmul launch 1.5-2.3 % slower than session 35's, to be told apart from a change of code on one card):
#     git archive --prefix=ab/p35/g4rt/ 97aa10c | tar -x
#     MODELS=31b B1_CAP=75 ARMS="m p35 m p35 m p35" bash export/results/s31_h200.sh b1 470
#   an H200: where the e4m3 step at batch 256 goes (6,317 tok/s at context 240, 2.9 % short of 6,500; never
#   profiled at 256 rows: session 23's profile stopped at 128, its 16 new tokens gave batch 256 no graph), one process:
#     PYTHONPATH=$PWD/ab/m python3 -m g4rt.bench.engine --config 31b --skip-hf --engines inductor --batches 256 \
#       --prompt-len 224 --new-tokens 48 --profile --kv-dtype float8_e4m3fn --out $OUT/p256
#   any card: the list's digit passes unrolled again (`for level in tl.static_range(LAST): if level >= first:` in
#   _row_digits, LAST a constexpr), against main, for top-k 1,000 with top-p, 2.5-7.2 us slower since the own listing:
#     ARMS="m st m st m st" SAMPLER_CAP=120 bash export/results/s36_h200.sh sampler 500
# Session 45 (the H200 refused every start; five H100 calls; export/results/README.md, "Where the 31B's batch-64
# step goes by launch on an H100") added the `profile` part: one profiled process each of $PROFILES (BATCH/KV, default
# "64/bf16 64/fp8 256/fp8"), `bench.engine --config 31b --skip-hf --batches "" --engines inductor --decode-steps
# BATCH --reps 1 --profile`: the steady steps, then `decode_profile` with every sequence of the batch decoding (its
# `replay_rows`), records in $OUT/profile_31b.jsonl. (Its calls 1-2 profiled `--batches BATCH --prompt-len P
# --new-tokens N` runs instead, whose last step held about half the batch: the results section says how.)
# The next calls (the H100 does not hold either arena at batch 256):
#   an H200 (needs_h200): PROFILES="64/bf16 256/bf16 256/fp8" PROFILE_CAP=170 bash export/results/s36_h200.sh profile 560
#     (where batch 256 goes: 9 ms above its serial floor at context 188, session 44's replays)
#   then the calls of session 44 above.
# Session 46 (export/results/README.md, "The logits' softcap in one launch"): bench.engine's `--layers N` runs the
# config's first N layers (Gemma4Config.first_layers), so an H100 holds the 31B's per-layer step at batch 256:
# $PROFILE_ARGS adds flags to each profiled process, e.g.
#   PROFILES="64/bf16 256/bf16 256/fp8" PROFILE_ARGS="--layers 30" PROFILE_CAP=150 bash export/results/s36_h200.sh profile 560
# and the kernels part $KERNELS_ARGS, e.g. "--frame-kib engine" (bench.kernels: the layer's pages in frames as large
# as the engine's, its KV spread over memory as in a step; 13-25 % slower than packed on an H100). The next calls:
#   any card: the engine's block layouts (`--frame-kib engine --frame-block G`: PageGeometry's block, G frames stored
#   unit by unit, a unit of 1,280 KiB holding a full layer's page or five sliding layers'), against packed and the
#   engine's frames, to tell whether keeping a layer's pages of G frames together restores the packed speed:
#     O=$OUT; for f in c e g8 g64 g4096 o0 o256; do a=""; case $f in e) a="--frame-kib engine";; g*) a="--frame-kib engine \
#       --frame-block ${f#g}";; o*) a="--frame-kib 12800 --frame-offset-kib ${f#o}";; esac
#       OUT=$O/$f BATCHES=64,256 TABLES="fma pipe" KV=bfloat16 KERNELS_ARGS="$a" bash export/results/s36_h200.sh kernels 70; done
#   (g4096: one block for every frame at batch 256, a layer's pages in one region of their own, as a layer-major
#   arena would hold them; o0, o256: the engine's frame size with the page at the first layers' offsets, where the
#   whole 31B's batch-64 step read its attention faster than the packed bench; the profile's `listed` gives the
#   step's layer by layer)
#   (run in session 47: no faster; the blocks and both --frame-block flags are gone since)
#   any card: the engine's arena by blocks (`bench.engine --frame-block G`: built in session 46, never run on a GPU)
#   against block 1, the first 30 layers at batch 256 and 64, profiled (its attention launch by launch, `listed`):
#     O=$OUT; for fb in 1 64 0 1 64 0; do OUT=$O/fb$fb-$SECONDS PROFILES="256/bf16 64/bf16" \
#       PROFILE_ARGS="--layers 30 --frame-block $fb" PROFILE_CAP=90 bash export/results/s36_h200.sh profile 200; done
#   an H200 (needs_h200): where the whole 31B's batch 256 goes, its attention launch by launch (`listed`):
#     PROFILES="256/bf16 256/fp8 64/bf16" PROFILE_CAP=170 bash export/results/s36_h200.sh profile 560
#   then the calls of session 44 above.
# Session 47 (four H100 calls; export/results/README.md, "The arena by blocks measured and removed") ran session 46's
# block calls: blocks of 64 frames or one of all were no faster in the engine or the bench, and the block layout was
# removed; frames of 1-4 MiB read at the packed speed, 5 MiB or more not, and 8 MiB once fast once slow in one
# process (each case allocates its arena anew). bench.kernels' `--arena-gib N` (the packed pages at the start of an
# arena of N GiB) and `--pad-gib N` (N GiB taken before the case's tensors) tell the allocation's size and its place
# from the layout. The next calls:
#   any card: O=$OUT; for f in c a40 p40 e a40 p40; do a=""; case $f in a*) a="--arena-gib ${f#a}";; \
#     p*) a="--pad-gib ${f#p}";; e) a="--frame-kib engine";; esac
#     OUT=$O/$f-$SECONDS BATCHES=256 TABLES=fma KV=bfloat16 KERNELS_ARGS="$a" bash export/results/s36_h200.sh kernels 60; done
#   (each record's `arena_at_gib` is its arena's virtual address), then the H200 calls of sessions 46 and 44 above.
#   (run in session 48: the arena's size and place do not matter, the frame's stride does; both flags removed since)
# Session 48 (five H100 calls; export/results/README.md, "Frame strides that camp on the memory stacks"): on an H100
# every frame stride that is a multiple of 1,280 KiB reads a batched decode's pages at 80 % of the copy bandwidth;
# frames are padded since (models/layout.py frame_stride), the first 30 layers' batch-256 bf16 step 5.8-7.4 % faster.
# Its calls are export/results/s48_frames.sh (with git archive --prefix=ab/pre/g4rt/ 39af465 | tar -x, carried). The
# next calls, on an H200 (needs_h200; no H200 was lent in session 48):
#   whether the H200 (six stacks) camps, and on which strides; 12,808 and 12,802 KiB tell whether a finer granule
#   (FRAME_GRANULES 1024 or more: 0.06 % of the 31B's frame instead of 1 %, so 141 GiB holds 4 requests of 262,144
#   positions again) reads as fast as 12,928 (any card; the H100 too):
#     FRAMES="256 1280 1536 12800 12928 2304 12808 12802 1280 1536 12808" ARMS=" " bash export/results/s48_frames.sh 200
#   the whole 31B at batch 256, padded against 39af465, bf16 then e4m3 (a card over 100 GB runs all 60 layers):
#     FRAMES=" " STEPS_CAP=90 bash export/results/s48_frames.sh 560
#     FRAMES=" " ARMS="fp8 pre/fp8 pre/fp8 fp8 fp8 pre/fp8" STEPS_CAP=90 bash export/results/s48_frames.sh 560
#   then the H200 calls of sessions 46 and 44 above.
#   any card (both, to compare five stacks with six): whether a weight's row stride camps too (`--row-pad`: each
#   weight also in rows padded to a stride without 3 or 5; the 31B's hidden 5,376 has a 3, the E4B's 2,560 a 5):
#     mkdir -p /tmp/pkg && ln -sfn $PWD /tmp/pkg/g4rt; for c in "31b --layers 30" e4b; do PYTHONPATH=/tmp/pkg \
#       python3 -m g4rt.bench.engine --config $c --out $OUT/m-${c%% *} --skip-hf --matmuls --no-gemv --row-pad \
#       --batches 1,64,256; done
# Session 49 (five H100 calls; export/results/README.md, "Weights in padded rows measured"): weights in padded rows
# read up to 28 % slower in cuBLAS and made the engine's step 2 % slower (not kept, --row-pad removed); frames 16 and
# 32 KiB past 12.5 MiB read as fast as 128 KiB past it on the cards tried (8 KiB past it 1.4 % slower on one), so
# frames are padded in granules of about 1/512 (FRAME_GRANULES; the 31B's frame 12,832 KiB). The next calls, on an
# H200 (needs_h200), with git archive --prefix=ab/pre/g4rt/ 39af465 | tar -x (unpadded frames):
#   whether the H200 camps, on which strides, and whether this checkout's 12,832 KiB frame reads as fast as 12,928:
#     FRAMES="256 1280 1536 12800 12928 2304 12808 engine 1280 1536 12832 12928" ARMS=" " bash export/results/s48_frames.sh 200
#   the whole 31B at batch 256 (and 64), padded against 39af465, bf16 then e4m3:
#     FRAMES=" " STEPS_CAP=90 bash export/results/s48_frames.sh 560
#     FRAMES=" " ARMS="fp8 pre/fp8 pre/fp8 fp8 fp8 pre/fp8" STEPS_CAP=90 bash export/results/s48_frames.sh 560
#   then the H200 calls of sessions 46 and 44 above.
# Session 50 (the H200 refused nine starts; two H100 calls, export/results/README.md, "The E2B's large projections'
# tiles swept"): none of session 49's H200 calls ran; they are still the next ones, the steps call first (it decides
# the batch-256 target). Its call 2 timed the step's forms of a packed gate/up alone (the residual step's norms in
# the prologue: 0.8-4.1 us a launch, paid again by each program that starts after the first two an SM), the call
# that tells a gemv whose programs take several column blocks (not built) from main:
#   python3 -m g4rt.bench.gemv_sweep --shape 12288 1536 --shape 24576 1536 --shape 20480 2560 --reps 15 \
#     --forms gelu,norm-gelu --out $OUT/forms
# Session 51 (the H200 refused every start; two short H100 calls): nothing above ran. gemv's `programs` (a launch
# strided over its column blocks, the same bits) and two arms as patches, `s51_strided_plan.patch` (unmeasured) and
# `s51_chunked_prologue.patch` (the E4B's step 3.2 % slower: not kept); the next call is in export/results/README.md,
# "The skinny matmul on fewer programs than column blocks". The H200 calls of session 49 above are still the next
# ones on an H200.
# Session 52 (one H100 machine, three calls; export/results/README.md, "The strided skinny matmul in the E4B's
# step"): the strided plan lost 24 % of the E4B's step (removed); padded frames changed nothing at batch 64. The
# H200 calls of session 49 above are still the next ones, and main's scoreboard at batch 64-256, both arenas:
#   STEPS=64,128,256 ARMS="bf16 fp8 bf16 fp8 bf16 fp8" STEPS_CAP=95 bash export/results/s36_h200.sh steps 585
PART=${1:?PART: tests or steps}
BUDGET=${2:-570}
TAG=s36-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
case $PART in
  tests) [ -n "${PKG:-}" ] && cd "$PKG/g4rt" && export PYTHONPATH=$OLDPWD/$PKG
         run_part gpu_tests 240 python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_kv_fp8_gpu.py \
           tests/test_plugins_decode_gpu.py}
         cp "$OUT/gpu_tests.log" "$OUT/gpu_tests.txt"; tail -3 "$OUT/gpu_tests.log" ;;
  kernels) [ -n "${PKG:-}" ] && export PYTHONPATH=$PWD/$PKG
           for kv in ${KV:-bfloat16 float8_e4m3fn}; do
             for t in ${TABLES:-table tiles}; do
               flag=""; [ "$t" != table ] && flag=--decode-batch-$t
               run_part "kernels_${kv}_$t" 150 python3 -m g4rt.bench.kernels --out "$OUT/kernels_${kv}_$t" \
                 --decode-batch $flag --kv-dtype "$kv" ${BATCHES:+--decode-batches $BATCHES} ${KERNELS_ARGS:-}
               cp "$OUT/kernels_${kv}_$t.log" "$OUT/kernels_${kv}_$t.txt"; rm -rf "$OUT/kernels_${kv}_$t"
             done
           done ;;
  steps) n=0
         for a in ${ARMS:-bf16 fp8}; do
           n=$((n + 1)); kv=(); pkg=/tmp/pkg
           [ "${a#*/}" = fp8 ] && kv=(--kv-dtype float8_e4m3fn)
           [ "${a%/*}" != "$a" ] && pkg=$PWD/ab/${a%/*}
           run_arm "$pkg" "${a//\//-}" $n steps_31b "${STEPS_CAP:-110}" engine --config 31b --skip-hf --batches "" \
             --engines inductor --decode-steps "${STEPS:-64,128,256}" --reps 3 "${kv[@]}" ${STEPS_ARGS:-}
         done ;;
  sampler) n=0  # `bench.kernels --sampler` (1 / 64 / 256 rows), arms $ARMS alternated: `new` this checkout, else ab/ARM
         for a in ${ARMS:-new radix new radix}; do
           n=$((n + 1)); pkg=/tmp/pkg d=$OUT/sampler_${a}_$n; [ "$a" != new ] && pkg=$PWD/ab/$a
           PYTHONPATH=$pkg run_part "sampler_${a}_$n" "${SAMPLER_CAP:-120}" python3 -m g4rt.bench.kernels --out "$d" --sampler
           mv "$d/sampler.json" "$d.json" && rm -rf "$d" "$d.log"
         done ;;
  profile) for spec in ${PROFILES:-64/bf16 64/fp8 256/fp8}; do  # BATCH/KV: one profiled process each, no arms
           kv=(); [ "${spec#*/}" = fp8 ] && kv=(--kv-dtype float8_e4m3fn)
           run_arm /tmp/pkg "${spec//\//-}" 1 profile_31b "${PROFILE_CAP:-160}" engine --config 31b --skip-hf \
             --batches "" --engines inductor --decode-steps "${spec%/*}" --reps 1 --profile "${kv[@]}" ${PROFILE_ARGS:-}
         done ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
