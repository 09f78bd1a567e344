#!/usr/bin/env bash
# A GPU session of the device tool, planned as whole calls: `bash bench/gpu_session.sh STAGE` is one call's command
# (carry `.whl` and `assets/tiny`; run `bash bench/device_wheels.sh` here first, and `python -m bench.liger_cpu`: TRL +
# Liger's contenders on the CPU, so that none fails at its first step on the lease). Each stage fits the tool's 10-minute
# limit with its own per-step timeouts; the bench rewrites docs/benchmarks.md after every round of runs, so a step
# stopped by its timeout keeps the rounds it finished. What each stage leaves lands in $OUT (the tool fetches it):
# the log, gpu_checks' lines and the report. Stages in order of what the acceptance targets need most:
#   1  gpu_checks (varlen and padding-free DPO against SDPA, the fused norm, the SwiGLU, rotary and head kernels of
#      `fused_kernels` timed against eager, syncs, the compiled and CUDA-graph decode steps, rollout tokens/s at
#      GRPO's shape); packed SFT 8×2048 on the varlen kernel
#      (both sides varlen: the fair comparison, since TRL's padding-free rows under SDPA get a dense 16k × 16k mask),
#      ours (with `fused_kernels`, the default), then profiles of that step, ours and TRL + Liger's: where the time
#      goes on each side (the figure the SFT target's gap needs)
#   2  DPO and reward 8×1024, eager, on the varlen kernel (ours then runs its batches padding-free; TRL's have no
#      padding-free mode for these trainers and run padded, which the kernel hands to SDPA)
#   3  GRPO 8×8×256 against TRL and PPO 64×256 against TRL 1.12 (7 steps each: the steady window is steps 6 and
#      7), ours as a recipe runs them on a GPU by default: rollouts decoded by the eager step recorded as a CUDA
#      graph (`rollout: {cuda_graphs: true}`, what the GRPO target rests on; gpu_checks of stage 1 gives its tokens/s
#      beside the eager loops'), updates on varlen (what `model.attention: auto` runs: padding-free; TRL's padded
#      batches go to SDPA). A round of fresh runs (ours, then TRL's ~6 s steps) takes ~2 minutes, so each case has
#      the stage's half to reach 2 rounds or more
#   4  SFT 4×4096 on varlen, packed SFT without `fused_kernels` (`--eager-kernels`: what they buy), GRPO with
#      compiled rollouts (inductor's kernels in the graph, paid by a compilation per shape)
#   5  profiles of a DPO 8×1024 step on varlen, ours and TRL + Liger's (where the DPO target's gap is), then compiled
#      packed SFT
# A session's 30 minutes of device time (until session 28) held about three stages (a machine's start takes a minute or two, and it
# goes back 30 s after a call), so run them back to back in this order.
#
# A 15-minute lease (the device tool's allowance since session 29) holds two calls, made back to back so that the
# second finds the machine warm; their tables go to $OUT/gpu.md only (the lease's card alone in its header, not
# merged into docs/benchmarks.md's rows of another card):
#   a  gpu_checks without the compiled decode step (not a default), then packed SFT 8×2048 and DPO 8×1024 on varlen
#      against TRL + Liger, the targets with the most users (timeout_s 590)
#   b  gpu_checks of the step's syncs and the CUDA-graph rollouts, then GRPO 8×8×256 against TRL as a recipe runs it
#      on a GPU (CUDA-graph rollouts, varlen updates) for B_LIMIT seconds (default 150: one round), the lease's
#      remaining seconds less a margin
#   c  what session 29's lease could not reach, and DPO again: gpu_checks of the step's syncs (none since session 30,
#      DPO's fused head included), of the decode steps (the graphed policy with its fused kernels recorded) and of the
#      kernels a decode step runs (session 31), then DPO 8×1024 (session 30 removed ~7 syncs a pair from its fused
#      head) and reward 8×1024 against TRL + Liger (timeout_s 480: the checks took ~90 s in session 29, before the
#      policy's recordings compiled their fused kernels and the kernel count was added)
#   d  then, at once: gpu_checks' activation offloading (session 38: its side-stream copies, equal loss and
#      gradients, the peak memory it frees, what it costs; under a minute), then PPO 64×256 against TRL 1.12 for
#      D_LIMIT seconds (default 280), 4 steps a run with the steady rate after step 2 (a TRL 1.12 PPO step decodes with `generate`, ~20 s: 7 steps a run would leave room for one
#      round)
#   e  the lease after: SFT 4×4096 against TRL + Liger (the SFT target's other shape), then GRPO 8×8×256 against
#      TRL + Liger (the GRPO row owed since session 29: TRL's layer kernels under its generation) (timeout_s 520)
# Session 42's lease ran c and d. What it found sets the next lease's two calls, f then g, back to back:
#   f  gpu_checks' AdamW and offloading lines (session 42 mended both: the compiled AdamW step in calls of 8 slices
#      with Triton's FMA contraction off, the offloaded step warmed up before it is timed; since session 56 the
#      hand-written step moves 16 bytes a load, and the line gives each step's bound), then DPO 8×1024 and
#      reward 8×1024 against TRL + Liger (the reward contender now runs: Liger's layer kernels, no fused LM head).
#      DPO gets 210 s, room for a third round: a side's first run can pay its JIT kernels' compilation inside the
#      steady window (session 42: TRL + Liger's first DPO run 13.9 pairs/s, its second 26.3), and only a median of
#      three leaves that run out (timeout_s 480)
#   g  at once: profiles of a DPO 8×1024 step, ours, ours with `low_precision_updates: nearest` (torch's AdamW, as
#      TRL runs: what the Kahan default costs; session 43) and TRL + Liger's (ours ran at 21–22 pairs/s in session 42
#      against 41 in session 29: where the time went), then SFT 4×4096 against TRL + Liger for G_LIMIT seconds
#      (default 200), the lease's remaining seconds less a margin
#   h  where g's profiles show ours' DPO step waiting on its host (device busy well under 100%): DPO and reward
#      8×1024 with `compile: true` (`--compile`: each decoder layer one compiled graph, far fewer launches a step;
#      session 43 found no recompile in 14 compiled DPO steps of the case's own lengths on CPU) against TRL + Liger
#      (timeout_s 480)
#   i  the clock's own effect (session 44): DPO 8×1024 against TRL + Liger with a log every step (`--log-every 1`),
#      as every GPU row before session 44 ran, each step then waiting for the device at its log; read beside f's rows
#      (a log every 10 steps, as users run) from the same lease (timeout_s 300)
# Session 45 made the SwiGLU and rotary kernels, the LM head's scores and gradients (DPO's fused head, the scoring
# passes) and the Kahan AdamW step (one launch) hand-written Triton (`alignpipe/triton_kernels.py`, the default on a
# GPU; checked only in Triton's interpreter so far). f's checks now start
# with the SwiGLU and rotary lines (each kernel against eager and inductor's, the host time of a call on each), the
# DPO head's (eager, compiled and hand-written against float32 autograd), and the AdamW line times the hand-written
# and compiled steps: 140 s for the checks, reward 140 s, f's timeout_s 520.
# Then:
#   j  what the hand-written kernels buy: DPO 8×1024 with `--compiled-kernels` (all of that work on inductor's
#      kernels, as before session 45) against TRL + Liger, to read beside f's rows (timeout_s 300)
# Since session 60 each profile (g's) also prints its matmul and attention kernels' TFLOP/s: the FLOPs a step that
# `bench.device_work --save` counted on CPU for that case and side (bench/device_counts.json: products, and
# attention as each side's kernels run it) over the kernels' time a step. Session 29's DPO steps ran all their FLOPs
# at 277 (ours) and 292 TFLOP/s (TRL + Liger), their SFT steps at 335 and 333: the rates say which kernels ours
# runs slower.
# Since session 61 the GPU tables (f's, g's) carry the same counts: beside each measured ratio, the counted one and each
# side's counted TFLOP/s (steady samples/s × its FLOPs a sample): a measured ratio below the counted one is ours' lower
# rate a FLOP, which g's profiles then place.
# Session 63's lease (15 minutes) ran f, then at once k (timeout_s 425, 365 s): both SFT shapes against TRL + Liger,
# the rows the SFT target needs, in place of g's profiles (no longer needed: DPO met its target in f). What it left
# owed sets the next leases' calls. A row comes from one call's runs (a call's table stands alone), and the online
# trainers' rounds are long (GRPO ~140 s a round of ours and TRL's, PPO against TRL 1.12 ~120 s), so a case's three
# rounds must fit in one call:
#   l  GRPO 8×8×256 against TRL, three rounds (session 29's row had two) for L_LIMIT seconds (default 450)
#      (timeout_s 480)
#   m  at once: PPO 64×256 against TRL 1.12 (session 42's row had two of TRL's runs), 4 steps a run, steady after 2,
#      for M_LIMIT seconds (default 300), the lease's remaining seconds less a margin: three rounds take ~360 s, so
#      where l leaves less, m goes first in the lease after, before n
#   n  the lease after: gpu_checks' AdamW line (session 63 mended the check: it stepped the hand-written optimizer once
#      more than the eager one it compared with) and offloading line (mended: it held the plain step's gradient copies
#      on the device), then reward 8×1024 against TRL + Liger with room for three rounds (f's 140 s held two), then
#      GRPO 8×8×256 against TRL + Liger (its row has never run; one round) for N_LIMIT seconds (default 150);
#      since session 70 the checks include SFT's head and the RL trainers' trained head on the hand-written kernels,
#      since session 71 PPO's full KL on `token_kl` (timeout_s 570)
set -uo pipefail
stage=${1:?"usage: bash bench/gpu_session.sh STAGE (1 to 5, or a to n)"}
case $stage in 1 | 2 | 3 | 4 | 5 | a | b | c | d | e | f | g | h | i | j | k | l | m | n) ;; *)
  echo "no stage $stage: bash bench/gpu_session.sh STAGE (1 to 5; a then b, c then d, f then g or k, l then m, or e, h, i, j or n, for a 15-minute lease)" >&2
  exit 2
  ;;
esac
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-/tmp/alignpipe-gpu-session}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
  exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1

bench() { # bench SECONDS ARGS...: one invocation under its own limit, the report copied out after it
  local limit=$1
  shift
  echo "== python3 -m bench --models qwen0.5b --merge --warmup 0 $*" | tee -a "$out/log"
  timeout "$limit" python3 -m bench --models qwen0.5b --merge --warmup 0 "$@" 2>&1 | tee -a "$out/log"
  cp docs/benchmarks.md "$out/"
}

dpo_profiles() { # where a DPO 8×1024 step's time goes: ours, ours on torch's AdamW rounding, TRL + Liger's (80 s each)
  for side in ours ours+nearest trl+liger; do
    nearest=0
    [ "$side" = ours+nearest ] && nearest=1 # `low_precision_updates: nearest`: what the Kahan default costs a step
    ALIGNPIPE_BENCH_NEAREST=$nearest ALIGNPIPE_BENCH_ATTENTION=varlen timeout 80 python3 -m bench.profile \
      "${side%+nearest}" dpo/8x1024 qwen0.5b --steps 8 --out "$out/profile-dpo-$side" 2>&1 | tail -40 | tee -a "$out/log"
  done
}

case $stage in
1)
  timeout 170 python3 -m bench.gpu_checks 2>&1 | tee "$out/checks"
  bench 190 --cases sft/8x2048 --attention varlen --steps 25
  for side in ours trl+liger; do
    ALIGNPIPE_BENCH_ATTENTION=varlen timeout 100 python3 -m bench.profile "$side" sft/8x2048 qwen0.5b --steps 10 \
      --out "$out/profile-$side" 2>&1 | tail -40 | tee -a "$out/log"
  done
  ;;
2)
  bench 280 --cases dpo/8x1024 --attention varlen --steps 25
  bench 280 --cases reward/8x1024 --attention varlen --steps 25
  ;;
3)
  bench 280 --cases grpo/8x8x256 --attention varlen --contenders trl --steps 7
  bench 280 --cases ppo/64x256 --attention varlen --steps 7
  ;;
4)
  bench 160 --cases sft/4x4096 --attention varlen --steps 20
  bench 200 --cases sft/8x2048 --attention varlen --eager-kernels --contenders trl+liger --steps 25
  bench 200 --cases grpo/8x8x256 --attention varlen --compile --contenders trl --steps 7
  ;;
a)
  timeout 140 python3 -m bench.gpu_checks --skip compiled_decode 2>&1 | tee "$out/checks"
  bench 200 --cases sft/8x2048 --attention varlen --contenders trl+liger --steps 20 --out "$out/gpu.md"
  bench 170 --cases dpo/8x1024 --attention varlen --contenders trl+liger --steps 20 --out "$out/gpu.md"
  ;;
b)
  timeout 90 python3 -m bench.gpu_checks --only step_syncs,graphed_decode,rollout_speed 2>&1 | tee "$out/checks"
  bench "${B_LIMIT:-150}" --cases grpo/8x8x256 --attention varlen --contenders trl --steps 7 --out "$out/gpu.md"
  ;;
c)
  timeout 130 python3 -m bench.gpu_checks --only step_syncs,graphed_decode,rollout_speed,decode_kernels 2>&1 |
    tee "$out/checks"
  bench 170 --cases dpo/8x1024 --attention varlen --contenders trl+liger --steps 20 --out "$out/gpu.md"
  bench 170 --cases reward/8x1024 --attention varlen --contenders trl+liger --steps 20 --out "$out/gpu.md"
  ;;
d)
  timeout 120 python3 -m bench.gpu_checks --only activation_offloading,low_precision_adamw 2>&1 | tee -a "$out/checks"
  bench "${D_LIMIT:-280}" --cases ppo/64x256 --attention varlen --steps 4 --skip-steps 2 --out "$out/gpu.md"
  ;;
f)
  timeout 140 python3 -m bench.gpu_checks --only fused_silu,fused_rotary,dpo_head,low_precision_adamw,activation_offloading \
    2>&1 | tee "$out/checks"
  bench 210 --cases dpo/8x1024 --attention varlen --contenders trl+liger --steps 20 --out "$out/gpu.md"
  bench 140 --cases reward/8x1024 --attention varlen --contenders trl+liger --steps 20 --out "$out/gpu.md"
  ;;
g)
  dpo_profiles
  bench "${G_LIMIT:-200}" --cases sft/4x4096 --attention varlen --contenders trl+liger --steps 20 --out "$out/gpu.md"
  ;;
h)
  bench 240 --cases dpo/8x1024 --attention varlen --compile --contenders trl+liger --steps 20 --out "$out/gpu.md"
  bench 200 --cases reward/8x1024 --attention varlen --compile --contenders trl+liger --steps 20 --out "$out/gpu.md"
  ;;
i)
  bench 270 --cases dpo/8x1024 --attention varlen --log-every 1 --contenders trl+liger --steps 20 --out "$out/gpu.md"
  ;;
j)
  bench 270 --cases dpo/8x1024 --attention varlen --compiled-kernels --contenders trl+liger --steps 20 --out "$out/gpu.md"
  ;;
k)
  bench 205 --cases sft/8x2048 --attention varlen --contenders trl+liger --steps 20 --out "$out/gpu.md"
  bench 205 --cases sft/4x4096 --attention varlen --contenders trl+liger --steps 20 --out "$out/gpu.md"
  ;;
l)
  bench "${L_LIMIT:-450}" --cases grpo/8x8x256 --attention varlen --contenders trl --steps 7 --out "$out/gpu.md"
  ;;
m)
  bench "${M_LIMIT:-300}" --cases ppo/64x256 --attention varlen --steps 4 --skip-steps 2 --out "$out/gpu.md"
  ;;
n)
  timeout 150 python3 -m bench.gpu_checks --only low_precision_adamw,activation_offloading,sft_head,rl_head,full_kl 2>&1 |
    tee "$out/checks"
  bench 240 --cases reward/8x1024 --attention varlen --contenders trl+liger --steps 20 --out "$out/gpu.md"
  bench "${N_LIMIT:-150}" --cases grpo/8x8x256 --attention varlen --contenders trl+liger --steps 7 --out "$out/gpu.md"
  ;;
e)
  bench 200 --cases sft/4x4096 --attention varlen --contenders trl+liger --steps 20 --out "$out/gpu.md"
  bench 280 --cases grpo/8x8x256 --attention varlen --contenders trl+liger --steps 7 --out "$out/gpu.md"
  ;;
5)
  dpo_profiles
  bench 200 --cases sft/8x2048 --attention varlen --compile --contenders trl+liger --steps 25
  ;;
esac
