#!/usr/bin/env bash
# One call of a GPU lease, planned whole: `bash bench/gpu_session.sh STAGE` is the device call's command.
#
# Before the lease, here: `bash bench/device_wheels.sh` (the wheels the device image lacks, into .whl/), and where
# anything on TRL + Liger's path changed since its last run, `python -m bench.liger_cpu` (its contenders on the CPU,
# so that none fails at its first step on the lease; `make test-slow` runs it). Each call carries `.whl` and
# `assets/tiny`. A stage fits the tool's 10-minute call with a time limit on each of its steps;
# the bench rewrites its report after every round of runs, so a step stopped by its limit keeps the rounds it
# finished. The log, gpu_checks' lines and the report land in $OUT, which the tool fetches. A lease has 15 minutes
# of device time, a machine's start included: two calls, made back to back so that the second finds it warm. A row
# comes from one call's runs, so a case's three rounds a side must fit in one call.
# tests/test_bench_report.py runs each stage's bench steps with `--dry-run` and checks its gpu_checks names.
#
# What issue 18 still owes (docs/benchmarks.md, "Where the GPU targets stand"), in this order:
#   l  GRPO 8×8×256 against TRL, three rounds (session 29's row had two; a round of ours and TRL's takes ~140 s),
#      for L_LIMIT s (default 450); timeout_s 480
#   m  at once: PPO 64×256 against TRL 1.12 (session 42's row had two of TRL's runs), 4 steps a run, steady after 2,
#      for M_LIMIT s, the lease's seconds left less 60 (default 300). Three rounds take ~360 s: where l leaves less,
#      m goes first in the lease after, before n
#   n  the lease after (timeout_s 570): gpu_checks' AdamW and offloading lines (session 63 mended both checks: the
#      first stepped the hand-written optimizer once more than the eager one, the second held the plain step's
#      gradient copies on the device), SFT's head and the RL trainers' head on the hand-written kernels (session 70)
#      and PPO's full KL on `token_kl` (71); then reward 8×1024 against TRL + Liger with room for three rounds (f's
#      140 s held two), then GRPO 8×8×256 against TRL + Liger (never run; one round) for N_LIMIT s (default 150)
#   The SFT, DPO and reward rows are an H200's (session 63); the issue's targets are an H100's. A run that names no
#   kind starts an H100 where one opens and an H200 otherwise, so the lease's first call is `nvidia-smi -L` (seconds;
#   the start is paid either way), whose reply names the card: on an H100, run `k` (timeout_s 450: SFT 8×2048 and
#   4×4096 against TRL + Liger, the issue's headline target) and then, at once, `o` with O_LIMIT the seconds left
#   less 150; on an H200, l and m as above.
#   The rest follows in later leases: after an H100's k and o, l and m (on an H100 too), then n; after an H200's l
#   and m, n, and k and o on the first H100 lent.
#   o  on an H100, after k: gpu_checks' SwiGLU, rotary and DPO-head lines (session 63's on the H200), then DPO 8×1024
#      against TRL + Liger, three rounds (~210 s), for O_LIMIT s (default 210)
#
# The stages behind today's figures, to run them again:
#   f  (session 63) gpu_checks' SwiGLU, rotary, DPO head, AdamW and offloading lines; DPO 8×1024 (210 s: a side's
#      first run can pay its kernels' compiles inside the steady window, which the median of three leaves out) and
#      reward 8×1024 against TRL + Liger
#   k  (session 63) SFT 8×2048 and 4×4096 packed against TRL + Liger
#   b  (session 29) the sync, CUDA-graph decode and rollout-speed checks; GRPO 8×8×256 against TRL for B_LIMIT s
#   d  (session 42) the offloading and AdamW checks; PPO 64×256 against TRL 1.12 for D_LIMIT s
#
# Earlier plans, kept so that the log's entries can be run again (docs/benchmarks-log.md says why each was planned):
#   1-5  session 28's 30-minute session: 1 gpu_checks, packed SFT 8×2048 and profiles of its step, ours and TRL +
#        Liger's; 2 DPO and reward 8×1024; 3 GRPO and PPO as a recipe runs them on a GPU (CUDA-graph rollouts,
#        varlen updates); 4 SFT 4×4096, SFT with `--eager-kernels`, GRPO with compiled rollouts; 5 profiles of a DPO
#        step, then compiled packed SFT. These merge their rows into docs/benchmarks.md; every later stage writes
#        its table to $OUT/gpu.md only, so that one card's header never sits over another card's rows
#   a  gpu_checks without the compiled decode step; SFT 8×2048 and DPO 8×1024 against TRL + Liger (session 29)
#   c  the sync, decode-step and decode-kernel checks; DPO and reward 8×1024 against TRL + Liger (session 42)
#   e  SFT 4×4096, then GRPO 8×8×256, against TRL + Liger
#   g  profiles of a DPO 8×1024 step (ours, ours on torch's AdamW rounding, TRL + Liger's), then SFT 4×4096 against
#      TRL + Liger for G_LIMIT s
#   h  DPO and reward 8×1024 with `--compile` against TRL + Liger
#   i  DPO 8×1024 with a log every step (`--log-every 1`), as every GPU row before session 44 ran
#   j  DPO 8×1024 on inductor's kernels (`--compiled-kernels`): what the hand-written ones buy
set -uo pipefail
stage=${1:?"usage: bash bench/gpu_session.sh STAGE (1 to 5, or a to o)"}
case $stage in 1 | 2 | 3 | 4 | 5 | a | b | c | d | e | f | g | h | i | j | k | l | m | n | o) ;; *)
  echo "no stage $stage: bash bench/gpu_session.sh STAGE (the next lease: l, then m at once, or on an H100 k, then o at once; the lease after: n; the others, 1 to 5 and a to k, run earlier sessions' calls again)" >&2
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
o)
  timeout 90 python3 -m bench.gpu_checks --only fused_silu,fused_rotary,dpo_head 2>&1 | tee "$out/checks"
  bench "${O_LIMIT:-210}" --cases dpo/8x1024 --attention varlen --contenders trl+liger --steps 20 --out "$out/gpu.md"
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
