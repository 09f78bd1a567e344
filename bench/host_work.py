"""A training step's host work, measured on a CPU with a GPU's code paths open:

    python -m bench.host_work [TRAINER] [--side ours|trl|trl+liger | --compare] [--layers 24] [--width 64] [--rows 8]
                              [--tokens 16] [--steps 5] [--users-head]

TRAINER is `dpo` (default), `sft`, `reward` or `kto`. On a GPU a step waits on its host wherever the host's work
(Python, dispatch, launches) outlasts its kernels: session 43 measured a DPO step's host work on CPU near that step's
time on an H200, so host work cut is step time cut there. A GPU's profile shows that a step waits, not what for.
This runs our trainer on a model of Qwen2-0.5B's depth and attention layout at a width that leaves next to no
compute (bf16, `--width` wide, rows of about `--tokens` tokens: 8 prompt tokens and the rest completion), with the
paths a CUDA device takes opened and stood in for:

- the fused kernels' gate (`fused_kernels.wanted`) open, as on CUDA;
- the hand-written Triton kernels (`triton_kernels`: SwiGLU, rotary, the LM head's scores and gradients, the Kahan
  AdamW step) taken, each launch a no-op: their host work up to the launch is counted (the arguments, the outputs'
  allocation, the AdamW block tables), the launch itself (tens of µs on a GPU's host) is not. The weights do not
  change;
- `model.attention: varlen` (padding-free batches, shared prompts for DPO), with flash's one variable-length kernel
  a layer stood in for by one SDPA call over all the batch's tokens (CPU runs the documents one by one otherwise);
- torch's fused RMSNorm (one operator each way on CUDA, several on CPU, where it decomposes) stood in for by one
  operator forward and two backward;
- the loader's tokenizing and collating in a worker process (`dataloader_workers: 1`, the CUDA default);
- with `--users-head` (SFT and DPO), the LM head in as many pieces as at the users' shape: the stand-in's few tokens
  over the tokenizer's 512-token vocabulary make logits small enough for the head to run whole, where SFT 8×2048's
  and DPO 8×1024's over Qwen2-0.5B's 151,936 tokens run it in chunks (SFT, DPO's reference) and a group a pair (DPO's
  fused head). The head's limits are divided by how many times more logits the users' step makes
  (`logprobs.WHOLE_LOGITS_MAX`, a step's) and the users' pair (`dpo.FUSED_GROUP_MAX`, a pair's): `users_head_scales`.
  With `--tokens 64`, DPO's head then runs as at 8×1024: a fused group a pair, ~24 chunks for the reference.

`--side trl` and `--side trl+liger` run TRL 1.16's trainer of the same step instead (`bench.run_one.trl_run`, the
contender of the GPU table, as a user configures it), on the same model, data and paths, with what its step does on a
CUDA device stood in for alike (`trl_paths`):
- TRL's chunked LM head (`add_fused_lm_head`, both TRL sides) takes its Triton folds of each tile, as on CUDA, each
  launch a no-op, and its float32-accumulating product (one `addmm` with `out_dtype` on CUDA, a cast of each input
  and a product on CPU) is counted as the one operator;
- with `trl+liger`, Liger's RMSNorm, rotary and SwiGLU kernels are launched (the norms and MLPs of the policy, which
  TRL hands Liger, and the rotary of every model, which Liger swaps module-wide), each a no-op: their host work up to
  the launch is counted, as ours'.
No-op launches leave their outputs unwritten, so TRL's losses are garbage (TRL trains on through a NaN; the counts do
not depend on the values). Two things of TRL's GPU step are not stood in for, so its counts are lower bounds: its
`bf16=True` autocast (casts to float32 before the operators autocast runs in float32) and the pinned copies of its
batches. `--compare` runs the three sides, each in a fresh process, and prints one table.

It prints, a steady step each: the wall time (steps run without a profiler), the Python function calls (cProfile, in
steps of their own) and the top-level aten operators (the torch profiler, in steps of their own: operators called
from within other operators are not counted, those run by autograd's engine in backward are), then where they come
from: the functions with the most own time, and the operators by count. Three windows after `--warmup` steps, each
`--steps` long; the numbers say which part of a step to cut and, compared between two commits, whether a change cut
it. Wall times on a shared CPU vary by tens of percent from run to run; the counts do not.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import math
import pstats
import statistics
import sys
import tempfile
import time
import types
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from bench.cases import QWEN_05B, Case, Shape, _user, rows
from bench.run_one import _train_ours, fresh_json, optimizer_ticks, trl_run

TRAINERS = ("dpo", "sft", "reward", "kto")
SIDES = ("ours", "trl", "trl+liger")


LAUNCHES: Counter = Counter()
"""The hand-written kernels' launches by kernel, from the start of the operator-counting window."""

STAND_IN = "host_work::stand_in"
"""The profiler's label around what the stand-ins do that a GPU's step does not (left out of the operator counts)."""


class _NoLaunch:
    """A Triton kernel whose launch (`kernel[grid](...)`) computes nothing: it zeroes the outputs at positions
    `outputs` of its arguments (a garbage output would stop training at a NaN loss), under `STAND_IN`."""

    def __init__(self, name: str, *outputs: int):
        self.name, self.outputs = name, outputs

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs) -> None:
        LAUNCHES[self.name] += 1
        with torch.profiler.record_function(STAND_IN):
            for i in self.outputs:
                args[i].zero_()


class _OneOpNorm(torch.autograd.Function):
    """torch's fused RMSNorm as a CUDA device runs it, by its operator count: one operator forward
    (`_fused_rms_norm`), here a product with the weight, and the gradients of input and weight in backward."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad * weight, (grad * x).flatten(0, -2).sum(0)


def _stand_in_norm(self, hidden_states):
    return _OneOpNorm.apply(hidden_states, self.weight)


def _one_attention_call(q, k, v, cu_q, cu_k, longest_q, longest_k, scale):
    """flash's variable-length kernel, one call a layer, stood in for by one SDPA call over all tokens (not
    document-masked: the values do not matter here, the host work does)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=q.shape[0] == k.shape[0],
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out[0].transpose(0, 1)


@contextlib.contextmanager
def patched(patches: dict[tuple[Any, str], Any]):
    """Each `(owner, name)` attribute set to its value for the block, and put back after it."""
    kept = {key: getattr(*key) for key in patches}
    try:
        for (owner, name), value in patches.items():
            setattr(owner, name, value)
        yield
    finally:
        for (owner, name), value in kept.items():
            setattr(owner, name, value)


@contextlib.contextmanager
def gpu_paths():
    """Open, for the block, the code paths a CUDA device takes (the module docstring lists them)."""
    from alignpipe import attention, fused_kernels, lean_activations, triton_kernels

    stub = types.SimpleNamespace(  # each kernel's outputs among its arguments (`triton_jit`)
        silu_mul_forward=_NoLaunch("silu_mul_forward", 2),
        silu_mul_backward=_NoLaunch("silu_mul_backward", 3, 4, 5),
        rotary=_NoLaunch("rotary", 2, 3),
        kahan_adamw=_NoLaunch("kahan_adamw"),  # updates the weights in place, by address
        token_scores=_NoLaunch("token_scores", 2, 3, 4),
        token_grads=_NoLaunch("token_grads", 6),
    )
    patches = {
        (fused_kernels, "wanted"): lambda enabled, device: bool(enabled),
        (triton_kernels, "interpreted"): lambda: True,
        (triton_kernels, "_kernels"): lambda: stub,
        (triton_kernels, "usable"): lambda device: True,
        (triton_kernels, "adamw_usable"): lambda device: True,
        (triton_kernels, "head_usable"): lambda device: True,
        (attention, "_documents_attention"): _one_attention_call,
        (lean_activations, "_norm_forward"): _stand_in_norm,
    }
    with patched(patches):
        yield


def _users_head() -> dict[str, tuple[int, int]]:
    """Rows a step and tokens the LM head scores a row at the first users' shape of `bench.cases` for SFT and DPO:
    SFT's 8 packed rows of 2048, DPO's 8 pairs of two ~720-token answers (the prompts are not scored)."""
    sft, dpo = (_user(gpu=True)[trainer][0] for trainer in ("sft", "dpo"))
    return {"sft": (sft.batch, sft.max_len), "dpo": (dpo.batch, 2 * dpo.completion_tokens)}


USERS_HEAD = _users_head()


def _stand_in_row(trainer: str, tokens: int) -> tuple[int, int]:
    """(tokens the head scores in one of the stand-in's rows of about `tokens` tokens, in one of the users' rows): SFT
    scores packed blocks of twice `tokens`, DPO two answers a pair after 8 prompt tokens."""
    if trainer not in USERS_HEAD:
        raise SystemExit(f"--users-head: {trainer} has no users' head shape here (sft, dpo)")
    return (2 * tokens if trainer == "sft" else 2 * (tokens - min(8, tokens // 2))), USERS_HEAD[trainer][1]


def users_head_scales(trainer: str, rows: int, tokens: int, vocab: int) -> tuple[float, float]:
    """How many times more logits the LM head makes at the users' shape (`USERS_HEAD` over Qwen2-0.5B's vocabulary)
    than the stand-in's `rows` rows of about `tokens` tokens (SFT: packed blocks of twice that; DPO: two answers a
    pair, after 8 prompt tokens) over `vocab`: (a step's, a row's)."""
    scored, users_tokens = _stand_in_row(trainer, tokens)
    row = users_tokens * QWEN_05B["vocab_size"] / (scored * vocab)
    return row * USERS_HEAD[trainer][0] / rows, row


@contextlib.contextmanager
def head_limits(step: float, row: float):
    """The LM head's limits divided for the block (`--users-head`): a step's logits in one piece by `step`, a DPO
    group's by `row`."""
    from alignpipe import logprobs
    from alignpipe.trainers import dpo

    kept = (logprobs.WHOLE_LOGITS_MAX, dpo.FUSED_GROUP_MAX)
    logprobs.WHOLE_LOGITS_MAX = max(1, int(kept[0] / step))
    dpo.FUSED_GROUP_MAX = max(1, int(kept[1] / row))
    try:
        yield
    finally:
        logprobs.WHOLE_LOGITS_MAX, dpo.FUSED_GROUP_MAX = kept


TRL_TOKEN_TILE, TRL_VOCAB_TILE = 4096, 32768
"""TRL 1.16's chunked LM head's tile: tokens (`trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE`) by vocabulary entries
(`trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE`)."""


def trl_head_tiles(trainer: str, rows: int, tokens: int, vocab: int) -> tuple[int, int]:
    """TRL's head tile (tokens, vocabulary entries) that cuts the stand-in's scored tokens over `vocab` into as many
    tiles as TRL's tile cuts the users' step over Qwen2-0.5B's vocabulary (`--users-head` on a TRL side): DPO 8×1024's
    11,520 scored tokens a forward in 3 × 5 tiles, SFT 8×2048's 16,384 in 4 × 5."""
    scored, users_tokens = _stand_in_row(trainer, tokens)
    token_tiles = math.ceil(USERS_HEAD[trainer][0] * users_tokens / TRL_TOKEN_TILE)
    vocab_tiles = math.ceil(QWEN_05B["vocab_size"] / TRL_VOCAB_TILE)
    return math.ceil(rows * scored / token_tiles), math.ceil(vocab / vocab_tiles)


def _no_launch(self, *args, grid, warmup, **kwargs) -> None:
    """`JITFunction.run` for a TRL side: any Triton kernel's launch (Liger's, TRL's head folds) counted, not run."""
    LAUNCHES[f"{self.fn.__module__.rsplit('.', 1)[-1]}.{self.fn.__name__}"] += 1


def _fp32_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """TRL's `_addmm_fp32` as CUDA runs it, by its operator count: one `addmm` with `out_dtype=float32`, which the
    CPU lacks. The range's name makes the profiler count it as that one operator and the casts within as nested."""
    with torch.profiler.record_function("aten::addmm"):
        acc.addmm_(a.float(), b.float())


@contextlib.contextmanager
def trl_paths(tiles: tuple[int, int] | None = None):
    """Open, for the block, the paths TRL's step takes on a CUDA device (the module docstring lists them), with its
    head cut in `tiles` (tokens, vocabulary entries; `trl_head_tiles`) where given."""
    import trl.kernels.chunked_logprob as chunked
    import trl.trainer.utils as trl_utils

    patches: dict[tuple[Any, str], Any] = {(chunked, "_addmm_fp32"): _fp32_product}
    if chunked._TRITON_AVAILABLE:  # without Triton (not Linux x86-64), TRL's head folds its tiles in torch, as here
        from triton.runtime.jit import JITFunction

        patches[(JITFunction, "run")] = _no_launch
        patches[(chunked, "_use_triton")] = lambda device: True
    if tiles:
        patches[(chunked, "TOKEN_CHUNK_SIZE")], patches[(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE")] = tiles
    with patched(patches):
        yield


class _NoClock:
    """`trl_run`'s clock, unused: both sides' windows tick at the end of each optimizer step (`optimizer_ticks`)."""

    def tick(self) -> None:
        pass


def model(trainer: str, tok, layers: int, width: int):
    """A bf16 Qwen2 of `layers` layers, `width` wide, with Qwen2-0.5B's ratio of query to key/value heads (7:1 there,
    2:1 here at 16-wide heads), the tokenizer's vocabulary; random init, seeded. Attention: `varlen`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    from alignpipe.modeling import implementation

    heads = max(2, width // 16)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": QWEN_05B["rope_theta"]},
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    cfg.num_labels = 1
    torch.manual_seed(0)
    built = (Qwen2ForSequenceClassification if trainer == "reward" else Qwen2ForCausalLM)(cfg)
    built.to(torch.bfloat16)  # type: ignore[arg-type]  # functools.wraps: unbound to mypy
    built.set_attn_implementation(implementation("varlen"))
    return built


class Windows:
    """`tick`ed at the end of each optimizer step (`bench.run_one.optimizer_ticks`): the step's wall time, and the
    profilers switched on and off at the windows' edges."""

    def __init__(self, warmup: int, steps: int):
        self.edges = (warmup, warmup + steps, warmup + 2 * steps, warmup + 3 * steps)
        self.ends: list[float] = []
        self.python = cProfile.Profile()
        self.ops = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def tick(self) -> None:
        self.ends.append(time.perf_counter())
        n = len(self.ends)
        _, profiled, counted, last = self.edges
        if n == profiled:
            self.python.enable()
        elif n == counted:
            self.python.disable()
            LAUNCHES.clear()
            self.ops.start()
        elif n == last:
            self.ops.stop()

    def step_ms(self) -> list[float]:
        first, last = self.edges[0], self.edges[1]
        return [1000 * (b - a) for a, b in zip(self.ends[first - 1 : last - 1], self.ends[first:last])]


def top_level_ops(prof) -> Counter:
    """aten operators the host called that no other aten operator called (autograd's engine calls backward's), the
    stand-ins' own left out."""

    def nested(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::") or parent.name == STAND_IN:
                return True
            parent = parent.cpu_parent
        return False

    return Counter(e.name for e in prof.events() if e.name.startswith("aten::") and not nested(e))


def train_side(side: str, case: Case, built, tok, data: list[dict], steps: int, clock, tiles=None) -> None:
    """Train `built` for `steps` optimizer steps of `case` on `side`'s trainer (ours as `common` configures it, or
    TRL's as `trl_run` does, TRL's head in `tiles` where given), with the GPU's paths open (`gpu_paths`, `trl_paths`):
    `clock.tick()` at the end of each optimizer step. SystemExit if fewer steps ran."""
    from alignpipe.tracking import Tracker

    shape = case.shape
    common = dict(
        learning_rate=1e-4,
        max_steps=steps,
        batch_size=shape.batch,
        gradient_accumulation_steps=shape.accumulation,
        max_length=shape.max_len,
        logging_every=10,
        lr_scheduler="linear",
        dataloader_workers=1,
    )
    ticks: list[None] = []

    class Ticks:
        def tick(self) -> None:
            ticks.append(None)
            clock.tick()

    with gpu_paths(), optimizer_ticks(Ticks()), tempfile.TemporaryDirectory() as out:
        if side == "ours":
            _train_ours(case.trainer, shape, common, {}, {}, built, tok, data, steps, "tiny", Tracker(), out)
        else:
            with trl_paths(tiles):
                trl_run(case, built, tok, data, steps, "tiny", _NoClock(), liger=side == "trl+liger")
    if len(ticks) < steps:
        raise SystemExit(f"{case.key} ({side}) ran {len(ticks)} optimizer steps of {steps}")


def run(
    trainer: str,
    layers: int,
    width: int,
    batch: int,
    tokens: int,
    warmup: int,
    steps: int,
    assets: str,
    users_head: bool = False,
    side: str = "ours",
) -> dict:
    """Train `trainer` (ours, or TRL's with `side`) for `warmup` + 3 × `steps` steps with the GPU's paths open (and
    the users' head: `head_limits`, `trl_head_tiles`); the figures of its steady steps."""
    from alignpipe.modeling import load_tokenizer

    if side != "ours" and trainer == "kto":
        raise SystemExit("--side: TRL's sides run sft, dpo and reward here (the GPU table's offline trainers)")
    tok = load_tokenizer(f"{assets}/model")
    total = warmup + 3 * steps
    prompt = min(8, tokens // 2)
    shape = Shape(
        f"{batch}×{tokens}",
        batch=batch,
        # SFT packs rows into blocks of two; a reward pair longer than `max_length` is dropped (as TRL drops it),
        # and the synthetic rows overshoot `tokens`; DPO and KTO cut theirs
        max_len=2 * tokens if trainer in ("sft", "reward") else tokens,
        prompt_tokens=prompt,
        completion_tokens=tokens - prompt,
        packed=trainer == "sft",
        log_every=10,  # TRL's side; ours' is `common`'s
    )
    data = rows(assets, Case(trainer, shape), total, tok)
    windows = Windows(warmup, steps)
    scales = users_head_scales(trainer, batch, tokens, len(tok)) if users_head else (1.0, 1.0)
    tiles = trl_head_tiles(trainer, batch, tokens, len(tok)) if users_head and side != "ours" else None
    with head_limits(*scales):
        train_side(side, Case(trainer, shape), model(trainer, tok, layers, width), tok, data, total, windows, tiles)
    stats = pstats.Stats(windows.python)
    ops = top_level_ops(windows.ops)
    by_own_time = io.StringIO()
    pstats.Stats(windows.python, stream=by_own_time).sort_stats("tottime").print_stats(20)
    ms = windows.step_ms()
    if tiles:
        head = f", TRL's head in tiles of {tiles[0]} tokens × {tiles[1]} entries (the users' head)"
    elif users_head:
        head = f", the head's limits / {scales[0]:,.0f} a step, / {scales[1]:,.0f} a row (the users' head)"
    else:
        head = ""
    return {
        "trainer": trainer,
        "side": side,
        "shape": f"{layers} layers × {width} wide, {batch} rows × {tokens} tokens" + head,
        "step_ms": [round(t, 1) for t in ms],
        "median_ms": round(statistics.median(ms), 1),
        "python_calls": round(stats.total_calls / steps),  # type: ignore[attr-defined]  # pstats keeps it
        "aten_ops": round(sum(ops.values()) / steps),
        "launches": {name: round(n / steps, 1) for name, n in sorted(LAUNCHES.items())},
        "ops_by_count": [(name, round(n / steps, 1)) for name, n in ops.most_common(25)],
        "by_own_time": by_own_time.getvalue(),
    }


def sides_parser(prog: str, doc: str, trainers: tuple[str, ...]) -> argparse.ArgumentParser:
    """The command line `host_work` and `device_work` share: TRAINER (the first of `trainers` by default), `--side`,
    `--compare` and `--json`."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("trainer", nargs="?", default=trainers[0], choices=trainers)
    parser.add_argument("--side", default="ours", choices=SIDES, help="whose trainer runs the step")
    parser.add_argument("--compare", action="store_true", help="run every side, each in a fresh process: one table")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line instead")
    return parser


def compare(module: str, argv: list[str] | None) -> list[dict]:
    """`python -m MODULE` for each of `SIDES`, each in a fresh process, with the command line's arguments (`argv`, or
    the process's) but `--compare`: their figures."""
    passed = [a for a in (sys.argv[1:] if argv is None else argv) if a not in ("--compare", "--json")]
    try:
        return [fresh_json([module, *passed, "--side", side, "--json"]) for side in SIDES]
    except RuntimeError as failed:
        raise SystemExit(str(failed)) from None


def comparison_table(runs: list[dict]) -> str:
    """The sides' figures as one markdown table: a row a side, ratios to ours."""
    ours = next(r for r in runs if r["side"] == "ours")
    lines = [
        f"{ours['trainer']}: {ours['shape'].split(', the head')[0]}"
        + (", the LM head in the users' pieces" if "users' head" in ours["shape"] else "")
        + ", a steady step each",
        "",
        "| side | Python calls | aten operators (top level) | Triton launches | ms on this CPU (median) |",
        "|---|---|---|---|---|",
    ]

    def cell(r: dict, key: str) -> str:
        return f"{r[key]:,}" + ("" if r is ours else f" ({r[key] / ours[key]:.2f}× ours)")

    for r in runs:
        lines.append(
            f"| {r['side']} | {cell(r, 'python_calls')} | {cell(r, 'aten_ops')} | {sum(r['launches'].values()):g} "
            f"| {cell(r, 'median_ms')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = sides_parser("python -m bench.host_work", __doc__, TRAINERS)
    parser.add_argument("--layers", type=int, default=QWEN_05B["num_hidden_layers"])
    parser.add_argument("--width", type=int, default=64, help="hidden size (heads of 16)")
    parser.add_argument("--rows", type=int, default=8, help="rows (DPO, reward: pairs) a step")
    parser.add_argument("--tokens", type=int, default=16, help="tokens a row, about")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps in each window (timed, Python, operators)")
    parser.add_argument("--assets", default=str(Path(__file__).resolve().parents[1] / "assets" / "tiny"))
    parser.add_argument(
        "--users-head", action="store_true", help="the LM head in as many pieces as at the users' shape (sft, dpo)"
    )
    parser.add_argument("--functions", action="store_true", help="also print the 20 functions by own time")
    args = parser.parse_args(argv)
    if args.compare:
        if args.trainer == "kto":
            parser.error("--compare: TRL's sides run sft, dpo and reward here")
        runs = compare("bench.host_work", argv)
        print(json.dumps(runs) if args.json else comparison_table(runs))
        return
    torch.set_num_threads(1)  # host work is single-threaded; one thread keeps the wall times comparable
    got = run(
        args.trainer, args.layers, args.width, args.rows, args.tokens, args.warmup, args.steps, args.assets,
        args.users_head, args.side,
    )  # fmt: skip
    if args.json:
        print(json.dumps(got))
        return
    print(f"{got['trainer']} ({got['side']}): {got['shape']}")
    print(f"  step ms        {got['median_ms']} (median; each: {got['step_ms']})")
    print(f"  Python calls   {got['python_calls']:,} a step")
    print(f"  aten operators {got['aten_ops']:,} a step (top level)")
    print("  Triton launches a step: " + ", ".join(f"{k} {n:g}" for k, n in got["launches"].items()))
    print("  operators a step: " + ", ".join(f"{name.removeprefix('aten::')} {n:g}" for name, n in got["ops_by_count"]))
    if args.functions:
        print(got["by_own_time"])


if __name__ == "__main__":
    main()
