"""TRL + Liger's contenders, run on the CPU before a GPU lease: `python -m bench.liger_cpu`.

Why: session 42's lease lost its reward row. TRL + Liger failed at its first step on the GPU (Liger had patched the
classifier with the causal LM's forward), and nothing run on a CPU could have said so: Liger's kernels are Triton,
and `python -m bench` leaves that contender out on a CPU. The contender has been mended since (`run_one.liger_args`),
and GRPO's has never run at all.

Triton's interpreter runs Triton kernels on CPU tensors, as the tests run ours. This runs, for each trainer of the
GPU suite that has a `trl+liger` contender (SFT, reward, DPO, GRPO: TRL 1.12's PPO has no Liger path):
- the users' case, shrunk (`shrunk`): the same flags (packed rows, gradient accumulation, completions a prompt), its
  token counts cut by `SHRINK` and an offline step's rows by `FEWER_ROWS`;
- on `tiny-qwen2`, the tiny model's sizes in Qwen2's architecture, so that Liger patches what it patches in the GPU's
  `qwen0.5b`;
- TRL + Liger and plain TRL, each in a fresh process, on the same model, data and hyperparameters.

It checks that each contender trains (what the lease would otherwise find at its first step), counts the Liger kernels
each launched (TRL applied them), and compares the losses: in fp32 Liger's kernels compute TRL's function, so the
offline trainers' losses agree within `LOSS_RTOL`. GRPO's completions are sampled from models that differ in their
last bits, so its losses are shown, not compared. It exits 1 where any check fails.

Three things Triton 3.6's interpreter does differently from a launch on a GPU, and that Liger's kernels rely on, are
shimmed in the contender's process only (`interpreter_shims`):
- a float argument stays a Python float where a GPU launch passes an fp32 scalar: Liger's RMSNorm calls `eps.to(…)`;
- `range` over a program's scalar calls `int()` on a one-element array, which NumPy 2 refuses;
- `libdevice` functions that a kernel's module imported by name (`rsqrt`, `tanh`) are not swapped for the
  interpreter's and return None; they are bound to `tl.math.rsqrt` and a tanh made of `tl.sigmoid`, looked up at
  each call (the interpreter swaps `tl.math`'s functions while a kernel runs).

What it showed first (session 57): every contender trains, and TRL 1.16 applies Liger's RMSNorm, rotary and SwiGLU
kernels to SFT, reward, DPO and GRPO alike, never Liger's fused linear cross-entropy: for SFT, DPO and GRPO it turns
that off itself and computes the loss through its own chunked LM head (`add_fused_lm_head`); for reward,
`run_one.liger_args` turns it off.

Two steps a run: 7 to 11 minutes in all on two cores (7:24 and 10:44 in session 57). `make test-slow` runs it
(tests/test_liger_on_cpu.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from bench.cases import ONLINE, TINY_QWEN2, Case, _user

ROOT = Path(__file__).resolve().parents[1]
TRAINERS = ("sft", "reward", "dpo", "grpo")
SHRINK = 32
"""The users' prompts, completions and new tokens over this (GRPO's 256 new tokens become 8), and their rows' lengths
over half of it (8×2048 packed SFT rows become 128 long: the synthetic rows overshoot a short target by a larger
share, and TRL drops a pair longer than its rows). Liger's kernels run a program a token in the interpreter,
milliseconds each, so tokens are what a run's minutes are made of."""
FEWER_ROWS = 4
"""An offline step's rows (pairs) over this; the online trainers keep theirs, which set TRL's generation batches."""
LOSS_RTOL = 1e-4
"""How far TRL + Liger's loss may be from plain TRL's, relative, for the offline trainers: both in fp32, summed in other
orders (session 57's agreed to the 6 digits printed)."""


def shrunk(case: Case) -> Case:
    """`case` with its token counts over `SHRINK` (rows' lengths over half of it), an offline step's rows over
    `FEWER_ROWS`, and its flags (packing, accumulation, completions a prompt) kept. Its key is the users' case's."""
    s = case.shape
    fewer = lambda n, by: max(4, n // by) if n else 0  # noqa: E731
    return Case(
        case.trainer,
        dataclasses.replace(
            s,
            label=f"{s.label} shrunk",
            batch=s.batch if case.trainer in ONLINE else max(2, s.batch // FEWER_ROWS),
            max_len=fewer(s.max_len, SHRINK // 2),
            completion=fewer(s.completion, SHRINK),
            prompt_tokens=fewer(s.prompt_tokens, SHRINK),
            completion_tokens=fewer(s.completion_tokens, SHRINK),
        ),
    )


def users_cases(trainers: list[str]) -> list[Case]:
    """The GPU suite's first case of each trainer (SFT: 8×2048 packed), shrunk (as `host_work.USERS_HEAD` reads it)."""
    return [shrunk(Case(t, _user(gpu=True)[t][0])) for t in trainers]


def interpreter_shims() -> None:
    """What Liger's kernels need of Triton's interpreter that a GPU launch gives them (the module's docstring)."""
    import importlib
    import pkgutil

    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    plain_cvt = interpreter._implicit_cvt

    def as_fp32_scalar(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return plain_cvt(arg)

    interpreter._implicit_cvt = as_fp32_scalar
    plain_patch = interpreter._patch_lang_tensor

    def index_of_one_element(tensor, scope) -> None:
        plain_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = index_of_one_element

    import liger_kernel.ops as ops

    for info in pkgutil.iter_modules(ops.__path__):
        try:
            module: Any = importlib.import_module(f"liger_kernel.ops.{info.name}")
        except ImportError:  # another vendor's backend (Ascend, XPU)
            continue
        if hasattr(module, "rsqrt"):
            module.rsqrt = lambda x: tl.math.rsqrt(x)
        if hasattr(module, "tanh"):
            module.tanh = lambda x: 2 * tl.sigmoid(2 * x) - 1


def count_kernels() -> Counter:
    """Liger kernel launches by name, counted from now on in this process."""
    from triton.runtime.interpreter import InterpretedFunction

    launched: Counter = Counter()
    plain_run = InterpretedFunction.run

    def run(self, *args, **kwargs):
        module = getattr(self.fn, "__module__", "")
        if module.startswith("liger_kernel."):
            launched[f"{module.rsplit('.', 1)[-1]}.{self.fn.__name__}"] += 1
        return plain_run(self, *args, **kwargs)

    InterpretedFunction.run = run
    return launched


def run_here(impl: str, trainer: str, steps: int, assets: str) -> dict:
    """One contender on the shrunk users' case of `trainer`, in this process (`--run`)."""
    from bench import run_one

    launched: Counter = Counter()
    if impl == "trl+liger":
        interpreter_shims()
        launched = count_kernels()
    (case,) = users_cases([trainer])
    out = run_one.case(impl, case, TINY_QWEN2, steps, assets)
    return {**out, "liger_kernels": dict(launched)}


def run_fresh(impl: str, trainer: str, steps: int, assets: str) -> dict:
    """`run_here` in a fresh process with Triton's interpreter on: its result, or {"error": the output's tail}."""
    from bench.run_one import fresh_json

    args = ["bench.liger_cpu", "--run", impl, trainer, "--steps", str(steps), "--assets", assets]
    try:
        return fresh_json(args, {**os.environ, "TRITON_INTERPRET": "1"})
    except RuntimeError as failed:
        return {"error": str(failed)}


def verdict(trainer: str, trl: dict, liger: dict) -> str | None:
    """What is wrong with the pair of runs, or None."""
    for name, out in (("trl", trl), ("trl+liger", liger)):
        if "error" in out:
            return f"{name} failed:\n{out['error']}"
        if not math.isfinite(out["loss"]):
            return f"{name}'s loss is {out['loss']}"
    if not liger["liger_kernels"]:
        return "trl+liger launched no Liger kernel: TRL did not apply them"
    if trainer != "grpo" and not math.isclose(liger["loss"], trl["loss"], rel_tol=LOSS_RTOL):
        return f"trl+liger's loss {liger['loss']:.6f} is not plain TRL's {trl['loss']:.6f} (within {LOSS_RTOL:g})"
    return None


def _shape(case: Case) -> str:
    s = case.shape
    if case.trainer in ONLINE:
        return f"{s.per_step // s.generations}×{s.generations}×{s.completion}"
    return f"{s.batch}×{s.max_len}" + (" packed" if s.packed else "")


def _loss(out: dict) -> str:
    return f"{out['loss']:.6f}" if "loss" in out else "–"


def _kernels(out: dict) -> str:
    return ", ".join(f"{name} ×{n}" for name, n in sorted(out.get("liger_kernels", {}).items())) or "–"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.liger_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", default=",".join(TRAINERS), help=f"of {', '.join(TRAINERS)}")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--assets", default=str(ROOT / "assets" / "tiny"))
    parser.add_argument("--run", nargs=2, metavar=("IMPL", "TRAINER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        print(json.dumps(run_here(args.run[0], args.run[1], args.steps, args.assets)))
        return 0
    trainers = args.trainers.split(",")
    if unknown := sorted(set(trainers) - set(TRAINERS)):
        parser.error(f"--trainers: no trl+liger contender for {', '.join(unknown)} (one of {', '.join(TRAINERS)})")
    failed = 0
    print(
        f"| users' case | run here (tokens ÷ {SHRINK}, tiny-qwen2) | trl loss | trl+liger loss | Liger kernels launched | verdict |"
    )
    print("|---|---|---|---|---|---|")
    for case in users_cases(trainers):
        trl = run_fresh("trl", case.trainer, args.steps, args.assets)
        liger = run_fresh("trl+liger", case.trainer, args.steps, args.assets)
        wrong = verdict(case.trainer, trl, liger)
        failed += wrong is not None
        print(f"| {case.key} | {_shape(case)} | {_loss(trl)} | {_loss(liger)} | {_kernels(liger)} | "
              f"{'ok' if wrong is None else 'FAIL'} |", flush=True)  # fmt: skip
        if wrong:
            print(wrong, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
