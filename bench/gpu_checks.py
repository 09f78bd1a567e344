"""Correctness of the code paths only a GPU takes, on the GPU: `python -m bench.gpu_checks` (about a minute).

The CPU tests run every function below through its CPU branch; what they cannot run is the CUDA one: PyTorch's
variable-length flash kernel behind `model.attention: varlen` (packed SFT rows, and padding-free DPO pairs whose
prompt runs once), torch's fused RMSNorm kernel behind `lean_activations`, the fused LM heads and GRPO's and PPO's
trained head in bf16 with their compiled and hand-written kernels on Triton (with the SwiGLU product, its down
projection keeping no product, and the rotary embedding, what `fused_kernels` compiles; each timed eager and
compiled), the loss watch's pinned copies and events, activation offloading's side-stream copies (with the peak
memory they free and the time they cost), whether a training step really leaves the device alone, and the hf
engine's replayed decode steps (compiled, and the eager step recorded as a CUDA graph) against its eager loop, with
rollout tokens/s at GRPO's user shape beside the memory-bandwidth bound and the kernels one decode step runs there.
Each check prints one line (PASS/FAIL, what was compared, by how much); the exit status is 1 if any failed. Run it
first in a GPU session: a failure here makes the benchmark's figures for that path meaningless.

Without CUDA it runs the same checks on CPU in float32 at small sizes (the CUDA-only ones report `skip`), which is
what `tests/test_bench_report.py` does so that the script cannot rot.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

RESULTS: list[tuple[str, bool | None, str]] = []


def check(name: str) -> Callable:
    """Record `fn()`'s (passed, detail) under `name`; an exception is a failure with its message."""

    def wrap(fn: Callable[[], tuple[bool | None, str]]) -> Callable[[], None]:
        def run() -> None:
            try:
                ok, detail = fn()
            except Exception as e:  # a crash is the finding: report it and go on to the next check
                ok, detail = False, f"{type(e).__name__}: {e}"
            RESULTS.append((name, ok, detail))
            print(f"{'skip' if ok is None else 'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)

        return run

    return wrap


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float32."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


class Setup:
    """Device, dtype and sizes: a Qwen2-0.5B-shaped layer stack (2 layers) on a GPU, a tiny one on CPU."""

    def __init__(self, force_cpu: bool = False):
        self.cuda = torch.cuda.is_available() and not force_cpu
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        if self.cuda:
            self.model_shape = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, vocab=151936)
            self.rows, self.length, self.head_tokens = 4, 2048, 4096
        else:
            self.model_shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab=512)
            self.rows, self.length, self.head_tokens = 2, 128, 96
        # bf16 gradients differ from float32 at ~1% of their norm; CPU float32 paths agree to ~1e-5
        self.loss_tol, self.grad_tol = (2e-2, 5e-2) if self.cuda else (1e-5, 1e-4)

    def model(self, attention: str):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from alignpipe.modeling import implementation

        s = self.model_shape
        cfg = Qwen2Config(
            vocab_size=s["vocab"],
            hidden_size=s["hidden_size"],
            intermediate_size=s["intermediate_size"],
            num_hidden_layers=2,
            num_attention_heads=s["num_attention_heads"],
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        )
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
        model.to(self.device, self.dtype)  # type: ignore[arg-type]  # functools.wraps: unbound to mypy
        model.set_attn_implementation(implementation(attention))
        return model

    def packed_blocks(self, rows_per_block: int = 6) -> list[dict]:
        """`sft.pack`'s blocks of `length` tokens holding rows of random lengths (each row its own document)."""
        from alignpipe.trainers import sft

        g = torch.Generator().manual_seed(1)
        vocab = self.model_shape["vocab"]
        rows = []
        for _ in range(self.rows * rows_per_block):
            n = int(torch.randint(self.length // 16, self.length // 2, (1,), generator=g))
            ids = torch.randint(0, vocab, (n,), generator=g).tolist()
            rows.append({"input_ids": ids, "labels": ids})
        return sft.pack(rows, self.length)

    def packed_batch(self) -> dict:
        """`sft.collate` of `rows` packed blocks."""
        from alignpipe.trainers import sft

        return sft.collate(self.packed_blocks()[: self.rows], 0)

    def dpo_batch(self) -> dict:
        """`dpo.collate` of `rows` pairs of random prompts and answers, padding-free with each prompt shared."""
        from alignpipe.trainers import dpo

        g = torch.Generator().manual_seed(2)
        vocab, n = self.model_shape["vocab"], self.length // 4

        def ids(lo: int, hi: int) -> list[int]:
            return torch.randint(0, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

        examples = [
            {"prompt_ids": ids(n // 8, n // 2), "chosen_ids": ids(8, n), "rejected_ids": ids(8, n)}
            for _ in range(self.rows)
        ]
        return dpo.collate(examples, 0, self.length, packed="shared")


def timed(fn: Callable, cuda: bool):
    """(fn(), seconds it took), the device's queue drained before and after on CUDA."""
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def _loss_and_grads(model, batch: dict) -> tuple[float, list[torch.Tensor], float]:
    from alignpipe.trainers import sft

    def step():
        loss, _ = sft.token_loss_sum(model, batch)
        loss.backward()
        return loss

    model.zero_grad()
    loss, took = timed(step, model.device.type == "cuda")
    return float(loss.detach()), [p.grad.detach().clone() for p in model.parameters() if p.grad is not None], took


def check_varlen(setup: Setup) -> Callable[[], None]:
    @check("varlen attention equals SDPA's block-diagonal mask on a packed SFT batch")
    def run():
        import torch.nn.attention.varlen as kernel
        from accelerate.utils import send_to_device

        from alignpipe import attention

        batch = send_to_device(setup.packed_batch(), setup.device)
        sdpa = _loss_and_grads(setup.model("sdpa"), batch)
        calls = {"documents": 0, "flash": 0}  # the flattened path, and the CUDA kernel inside it
        run_documents, run_flash = attention._documents_attention, kernel.varlen_attn

        def documents(*a):
            calls["documents"] += 1
            return run_documents(*a)

        @functools.wraps(run_flash)  # keeps the kernel's signature: `attention` reads it for its keywords
        def flash(*a, **k):
            calls["flash"] += 1
            return run_flash(*a, **k)

        attention._documents_attention, kernel.varlen_attn = documents, flash
        try:
            model = setup.model("varlen")
            _loss_and_grads(model, batch)  # warm-up: the kernel's first call
            varlen = _loss_and_grads(model, batch)
        finally:
            attention._documents_attention, kernel.varlen_attn = run_documents, run_flash
        loss_gap = abs(varlen[0] - sdpa[0]) / abs(sdpa[0])
        grad_gap = max(relative(a, b) for a, b in zip(varlen[1], sdpa[1], strict=True))
        layers = 2 * model.config.num_hidden_layers  # two forwards
        ran = calls["documents"] == layers and calls["flash"] == (layers if setup.cuda else 0)
        # the kernel's own first-call check (`attention._kernel_call`); a failed one runs the rows one by one
        trusted = False not in attention.KERNEL_VERDICTS.values()
        ok = loss_gap < setup.loss_tol and grad_gap < setup.grad_tol and ran and trusted
        docs = len(batch["documents"]["cu_seq_lens_q"]) - 1
        return ok, (
            f"{setup.rows}×{setup.length} tokens, {docs} documents: loss gap {loss_gap:.2e}, worst gradient gap "
            f"{grad_gap:.2e}; attention calls {calls} for {layers} layer forwards; forward+backward "
            f"{sdpa[2] * 1e3:.1f} ms SDPA, {varlen[2] * 1e3:.1f} ms varlen (2 layers); first-call check of the "
            f"kernel: {attention.KERNEL_VERDICTS or 'not run (no CUDA kernel)'}"
        )

    return run


def check_padding_free_dpo(setup: Setup) -> Callable[[], None]:
    @check("padding-free DPO rows on varlen, each prompt once, equal the padded rows on SDPA")
    def run():
        from accelerate.utils import send_to_device

        from alignpipe.trainers import dpo

        batch = send_to_device(setup.dpo_batch(), setup.device)
        out = {}
        for attention in ("sdpa", "varlen"):
            model = setup.model(attention)

            def step(model=model):
                logps = dpo.completion_logps(model, batch)[0]
                logps.float().sum().backward()
                return logps

            for _ in range(2):  # the second timed: the kernels' first calls are warm-ups
                model.zero_grad()
                logps, took = timed(step, setup.cuda)
            grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
            out[attention] = (logps.detach(), grads, took)
        logp_gap = relative(out["varlen"][0], out["sdpa"][0])
        grad_gap = max(relative(a, b) for a, b in zip(out["varlen"][1], out["sdpa"][1], strict=True))
        tokens = batch["packed"]["offsets"][-1]
        padded = batch["input_ids"].numel()
        ok = logp_gap < setup.loss_tol and grad_gap < setup.grad_tol
        return ok, (
            f"{setup.rows} pairs, {tokens} tokens padding-free / {padded} padded: answer log-prob gap {logp_gap:.2e}, "
            f"worst gradient gap {grad_gap:.2e}; forward+backward {out['sdpa'][2] * 1e3:.1f} ms padded SDPA, "
            f"{out['varlen'][2] * 1e3:.1f} ms padding-free varlen (2 layers)"
        )

    return run


def check_fused_norm(setup: Setup) -> Callable[[], None]:
    @check("lean_activations' norm on torch's fused RMSNorm kernel equals transformers' within bf16 rounding")
    def run():
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

        from alignpipe import lean_activations as lean

        if not setup.cuda:
            return None, "no CUDA device (the CPU reference of the op is tests/test_lean_activations.py)"
        if not lean.fused_norm_kernel():
            return False, f"torch {torch.__version__} has no CUDA kernel for _fused_rms_norm: the norms recompute"
        d, tokens = setup.model_shape["hidden_size"], 4 * setup.head_tokens
        torch.manual_seed(0)
        norm = Qwen2RMSNorm(d, eps=1e-6).to(setup.device, setup.dtype)
        with torch.no_grad():
            norm.weight.add_(0.1 * torch.randn_like(norm.weight))
        x = (3 * torch.randn(tokens, d, device=setup.device)).to(setup.dtype).requires_grad_()
        g = torch.randn_like(x)
        runs = {
            "transformers": lambda: norm(x),
            "recomputing": lambda: lean._LeanRMSNorm.apply(x, norm.weight, norm.variance_epsilon),
            "fused": lambda: lean._fused_norm(x, norm.weight, norm.variance_epsilon),
        }
        out, took = {}, {}
        for name, fn in runs.items():

            def forward_backward(fn=fn):
                y = fn()
                return y, torch.autograd.grad(y, (x, norm.weight), g)

            for _ in range(3):  # the last timed
                (y, grads), took[name] = timed(forward_backward, True)
            out[name] = (y.detach(), grads)
        want, got = out["transformers"], out["fused"]
        value_gap = float(((got[0] - want[0]).abs() / want[0].abs().clamp(min=1)).max())
        grad_gap = max(relative(a, b) for a, b in zip(got[1], want[1], strict=True))
        times = ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in took.items())
        ok = value_gap <= 2**-6 and grad_gap < 2e-2  # two bf16 steps: transformers' norm rounds twice
        return ok, f"{tokens} × {d}: value gap {value_gap:.1e}, gradient gap {grad_gap:.1e}; forward+backward {times}"

    return run


@contextlib.contextmanager
def elementwise(which: str):
    """Within: `fused_kernels` runs its SwiGLU and rotary work on `which` kernels (`triton`, hand-written, where
    usable; `compiled`, inductor's)."""
    from alignpipe import fused_kernels

    before = fused_kernels.ELEMENTWISE
    fused_kernels.ELEMENTWISE = which
    try:
        yield
    finally:
        fused_kernels.ELEMENTWISE = before


def queued(fn: Callable, cuda: bool, calls: int = 10):
    """(the last call's result, seconds a call of `fn` takes when `calls` of them are queued back to back), the queue
    drained before and after. The host then runs ahead of the device, as in a training step, so this is the device's
    time a call unless issuing a call takes the host longer (`host_us` says). A single call timed from a drained
    queue (`timed`) adds each kernel's launch latency to it: a kernel of tens of µs then reads as a millisecond."""

    def back_to_back():
        for _ in range(calls):
            out = fn()  # each call's result freed by the next: the allocator reuses its blocks, as a step's do
        return out

    out, took = timed(back_to_back, cuda)
    return out, took / calls


def host_us(fn: Callable, cuda: bool, calls: int = 50) -> float:
    """Microseconds of host time a call of `fn` takes to issue (its kernels queued, not waited for), over `calls`
    calls after a warm one: what a step whose host cannot stay ahead of its GPU pays per call."""
    fn()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    took = time.perf_counter() - start
    if cuda:
        torch.cuda.synchronize()
    return took / calls * 1e6


def _kernel_sides(setup: Setup) -> tuple[str, ...]:
    """The fused kernels to compare with eager: the hand-written ones where Triton runs them, and inductor's."""
    from alignpipe import triton_kernels

    return ("triton", "compiled") if triton_kernels.usable(setup.device) else ("compiled",)


def check_fused_silu(setup: Setup) -> Callable[[], None]:
    @check(
        "fused_kernels' SwiGLU product and down projection (hand-written Triton and compiled kernels, one each way; "
        "`silu_mul_down` keeping no product) equal the eager ones within bf16 rounding; host time a call"
    )
    def run():
        from alignpipe import fused_kernels
        from alignpipe.lean_activations import _LeanSiluMul
        from bench.activation_memory import kept_bytes

        tokens, inner = 4 * setup.head_tokens, setup.model_shape["intermediate_size"]
        hidden = setup.model_shape["hidden_size"]
        torch.manual_seed(0)
        gate, up = (torch.randn(tokens, inner, device=setup.device).to(setup.dtype).requires_grad_() for _ in range(2))
        weight = (torch.randn(hidden, inner, device=setup.device) / inner**0.5).to(setup.dtype).requires_grad_()
        g = torch.randn(tokens, hidden, device=setup.device).to(setup.dtype)
        small = gate[:16].detach(), up[:16].detach()
        variants = {"eager": ("compiled", lambda: torch.nn.functional.linear(_LeanSiluMul.apply(gate, up), weight))}
        for side in _kernel_sides(setup):
            variants[side] = (side, lambda: torch.nn.functional.linear(fused_kernels.silu_mul(gate, up), weight))
            variants[f"{side}, product recomputed"] = (side, lambda: fused_kernels.silu_mul_down(gate, up, weight))
        out, took, kept, host = {}, {}, {}, {}
        for name, (side, fn) in variants.items():

            def forward_backward(fn=fn):
                y = fn()
                return y, torch.autograd.grad(y, (gate, up, weight), g)

            with elementwise(side):
                forward_backward()  # the first call compiles
                (y, grads), took[name] = queued(forward_backward, setup.cuda)
                out[name] = (y.detach(), *grads)
                kept[name] = kept_bytes(fn, (gate, up, weight))
                if name in _kernel_sides(setup):  # a 16-token product forward: the call's host cost alone
                    host[name] = host_us(lambda: fused_kernels.silu_mul(*small), setup.cuda)
        gaps = [
            max(relative(a, b) for a, b in zip(out[name], out["eager"], strict=True)) for name in list(variants)[1:]
        ]
        recomputed = [name for name in variants if name.endswith("recomputed")]
        ok = max(gaps) < (1e-2 if setup.cuda else 1e-5) and all(kept[n] == 0 < kept["eager"] for n in recomputed)
        times = ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in took.items())
        held = ", ".join(f"{name} {b / 1e6:.1f} MB" for name, b in kept.items())
        calls = ", ".join(f"{name} {us:.0f} µs" for name, us in host.items())
        return ok, (
            f"{tokens} × {inner} → {hidden}: value and gradient gaps {max(gaps):.1e}; forward+backward, a call of 10 "
            f"queued: {times}; "
            f"kept for backward beyond the inputs: {held}; host time a product call: {calls}"
        )

    return run


def check_fused_rotary(setup: Setup) -> Callable[[], None]:
    @check(
        "fused_kernels' rotary embedding (hand-written Triton and compiled kernels, one each way) equals "
        "transformers' within bf16 rounding; host time a call"
    )
    def run():
        from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

        from alignpipe import fused_kernels

        original = getattr(apply_rotary_pos_emb, "alignpipe_original", apply_rotary_pos_emb)
        heads, d = setup.model_shape["num_attention_heads"], 64
        tokens = 4 * setup.head_tokens
        torch.manual_seed(0)
        q = torch.randn(1, tokens, heads, d, device=setup.device).to(setup.dtype).transpose(1, 2).requires_grad_()
        k = torch.randn(1, tokens, 2, d, device=setup.device).to(setup.dtype).transpose(1, 2).requires_grad_()
        angles = torch.arange(tokens, device=setup.device)[:, None] * 1e-3 * torch.arange(d, device=setup.device)
        cos, sin = angles.cos()[None].to(setup.dtype), angles.sin()[None].to(setup.dtype)
        grads = (torch.randn_like(q), torch.randn_like(k))
        small = (q[:, :, :16].detach(), k[:, :, :16].detach(), cos[:, :16], sin[:, :16])
        sides = [("transformers", "compiled", original)]
        sides += [(side, side, fused_kernels.rotary) for side in _kernel_sides(setup)]
        out, took, host = {}, {}, {}
        for name, side, fn in sides:

            def forward_backward(fn=fn):
                y = fn(q, k, cos, sin)
                return y, torch.autograd.grad(y, (q, k), grads)

            with elementwise(side):
                forward_backward()  # the first call compiles
                (y, g), took[name] = queued(forward_backward, setup.cuda)
                out[name] = (*(t.detach() for t in y), *g)
                if fn is not original:  # a 16-token forward: the call's host cost alone
                    host[name] = host_us(lambda: fused_kernels.rotary(*small), setup.cuda)
        gap = max(
            relative(a, b) for name, _, _ in sides[1:] for a, b in zip(out[name], out["transformers"], strict=True)
        )
        times = ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in took.items())
        calls = ", ".join(f"{name} {us:.0f} µs" for name, us in host.items())
        ok = gap < (1e-2 if setup.cuda else 1e-5)
        return ok, (
            f"{tokens} tokens × {heads} + 2 heads: value and gradient gaps {gap:.1e}; forward+backward, a call of 10 "
            f"queued: {times}; "
            f"host time a forward call: {calls}"
        )

    return run


def _head_inputs(setup: Setup, seed: int):
    g = torch.Generator().manual_seed(seed)
    d, V, N = setup.model_shape["hidden_size"], setup.model_shape["vocab"], setup.head_tokens
    hidden = torch.randn(N, d, generator=g).to(setup.device, setup.dtype).requires_grad_()
    weight = (torch.randn(V, d, generator=g) * 0.02).to(setup.device, setup.dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g).to(setup.device)
    return hidden, weight, labels


def _full_logits_token_lp(hidden, weight, labels) -> torch.Tensor:
    """Each token's log-prob through whole float32 logits in chunks (autograd, the reference)."""
    parts = []
    for s in range(0, hidden.size(0), 1024):
        x = torch.nn.functional.linear(hidden[s : s + 1024], weight).float()
        parts.append(torch.log_softmax(x, -1).gather(-1, labels[s : s + 1024, None]).squeeze(-1))
    return torch.cat(parts)


def _against(setup: Setup, want: torch.Tensor, inputs: tuple, fused: Callable[[bool], torch.Tensor], by_hand=False):
    """(passed, detail) of a fused head's loss and gradients, eager (`fused(False)`) and compiled, against `want`
    (autograd through float32 logits) with respect to `inputs`; with `by_hand`, also through the hand-written
    Triton kernels (`fused_kernels.ELEMENTWISE`), where Triton runs them."""
    from alignpipe import triton_kernels

    want_grads = torch.autograd.grad(want, inputs)
    sides = [("eager", False, "compiled"), ("compiled", True, "compiled")]
    if by_hand and triton_kernels.head_usable(setup.device):
        sides.append(("hand-written", True, "triton"))
    gaps = []
    for _, compiled, kernels in sides:
        with elementwise(kernels):
            for _ in range(2):  # the second timed: the first compiles
                got, took = timed(lambda compiled=compiled: fused(compiled), setup.cuda)
        grads = torch.autograd.grad(got, inputs)  # formed in the forward: the time above is the whole head's
        loss_gap = abs(float(got.detach()) - float(want.detach())) / abs(float(want.detach()))
        gaps.append((loss_gap, max(map(relative, grads, want_grads)), took))
    ok = all(loss < setup.loss_tol / 10 and grad < setup.grad_tol for loss, grad, _ in gaps)
    return ok, ", ".join(
        f"{name}: loss {a:.1e}, gradients {b:.1e}, {t * 1e3:.1f} ms" for (name, _, _), (a, b, t) in zip(sides, gaps)
    )


def check_sft_head(setup: Setup) -> Callable[[], None]:
    @check("SFT's fused head (eager, compiled and hand-written) equals autograd through float32 logits")
    def run():
        from alignpipe.linear_ce import linear_nll_sum

        hidden, weight, labels = _head_inputs(setup, 2)
        want = -_full_logits_token_lp(hidden, weight, labels).sum()
        ok, text = _against(
            setup,
            want,
            (hidden, weight),
            lambda compiled: linear_nll_sum(hidden, weight, None, labels, 441, compiled),
            by_hand=True,
        )
        return ok, f"{setup.head_tokens} tokens × {weight.size(0)} vocabulary in {setup.dtype}: {text}"

    return run


def check_dpo_head(setup: Setup) -> Callable[[], None]:
    @check("DPO's fused head (eager, compiled and hand-written) equals autograd through float32 logits")
    def run():
        from alignpipe.linear_sequence_loss import linear_sequence_loss
        from alignpipe.losses import dpo_loss

        hidden, weight, labels = _head_inputs(setup, 3)
        N, B = hidden.size(0), 4
        rows = [N // (2 * B)] * (2 * B)
        rows[-1] += N - sum(rows)
        ref = torch.linspace(-3, 3, 2 * B, device=setup.device).chunk(2)

        def pair_loss(sums: torch.Tensor, group: torch.Tensor | list[int]) -> torch.Tensor:
            k = len(group) // 2
            losses, _, _ = dpo_loss(sums[:k], sums[k:], ref[0][group[:k]], ref[1][group[:k]], 0.1)
            return losses.sum() / B

        token_lp = _full_logits_token_lp(hidden, weight, labels)
        sums = torch.stack([part.sum() for part in token_lp.split(rows)])
        want = pair_loss(sums, list(range(2 * B)))
        groups = [[0, 1, B, B + 1], [2, 3, B + 2, B + 3]]
        ok, text = _against(
            setup,
            want,
            (hidden, weight),
            lambda compiled: linear_sequence_loss(hidden, weight, None, labels, rows, groups, pair_loss, compiled)[0],
            by_hand=True,
        )
        return ok, f"{B} pairs, {N} answer tokens in {setup.dtype}: {text}"

    return run


def check_rl_head(setup: Setup) -> Callable[[], None]:
    @check("GRPO's and PPO's trained head (eager, compiled and hand-written) equals autograd through float32 logits")
    def run():
        from alignpipe import logprobs, triton_kernels

        hidden, weight, labels = _head_inputs(setup, 4)
        temperature = 0.9
        advantages = torch.linspace(-1, 1, labels.numel(), device=setup.device)
        x = torch.nn.functional.linear(hidden, weight).float() / temperature  # the reference: whole float32 logits
        logp = torch.log_softmax(x, -1)
        want_entropy = -(logp.exp() * logp).sum(-1).detach()
        want = (logp.gather(-1, labels[:, None]).squeeze(-1) * advantages).sum()
        want_grads = torch.autograd.grad(want, (hidden, weight))
        want = want.detach()
        del x, logp
        sides = [("eager", False, "compiled"), ("compiled", True, "compiled")]
        if triton_kernels.head_usable(setup.device):
            sides.append(("hand-written", True, "triton"))
        gaps, texts = [], []
        for name, compiled, kernels in sides:

            def forward_backward(compiled=compiled):
                lp, entropy = logprobs._head_logprobs(
                    hidden[None], weight, None, labels[None], temperature, 4096, True, compiled=compiled
                )
                loss = (lp[0] * advantages).sum()
                return loss.detach(), entropy[0], torch.autograd.grad(loss, (hidden, weight))

            with elementwise(kernels):
                for _ in range(2):  # the second timed: the first compiles
                    (loss, entropy, grads), took = timed(forward_backward, setup.cuda)
            gap = (
                abs(float(loss) - float(want)) / abs(float(want)),
                relative(entropy, want_entropy),
                max(map(relative, grads, want_grads)),
            )
            gaps.append(gap)
            texts.append(
                f"{name}: loss {gap[0]:.1e}, entropy {gap[1]:.1e}, gradients {gap[2]:.1e}, {took * 1e3:.1f} ms"
            )
        ok = all(a < setup.loss_tol and b < setup.loss_tol and c < setup.grad_tol for a, b, c in gaps)
        return ok, f"{labels.numel()} tokens × {weight.size(0)} vocabulary in {setup.dtype}: {', '.join(texts)}"

    return run


def check_full_kl(setup: Setup) -> Callable[[], None]:
    @check("PPO's full KL of two heads (eager, compiled and hand-written) equals float64 softmaxes' KL")
    def run():
        from alignpipe import logprobs, triton_kernels

        hidden, weight, labels = (t.detach() for t in _head_inputs(setup, 5))
        ref_hidden, ref_weight, _ = (t.detach() for t in _head_inputs(setup, 6))
        temperature = 0.9
        want: tuple[list[torch.Tensor], ...] = (
            [],
            [],
            [],
        )  # the reference: each side's logits (one matmul, as every side's) in float64
        for s in range(0, labels.numel(), 1024):
            sl = slice(s, s + 1024)
            logp, ref_logp = (
                (torch.nn.functional.linear(h[sl], w).double() / temperature).log_softmax(-1)
                for h, w in ((hidden, weight), (ref_hidden, ref_weight))
            )
            idx = labels[sl, None]
            want[0].append(logp.gather(-1, idx).squeeze(-1))
            want[1].append(ref_logp.gather(-1, idx).squeeze(-1))
            want[2].append((logp.exp() * (logp - ref_logp)).sum(-1))
        wanted = [torch.cat(parts) for parts in want]
        sides = [("eager", False, "compiled"), ("compiled", True, "compiled")]
        if triton_kernels.head_usable(setup.device):
            sides.append(("hand-written", True, "triton"))
        gaps, texts = [], []
        for name, compiled, kernels in sides:

            def full_kl(compiled=compiled):
                heads = (weight, None), (ref_weight, None)
                return logprobs.full_kl(
                    hidden[None], heads[0], ref_hidden[None], heads[1], labels[None], temperature, compiled=compiled
                )

            with elementwise(kernels):
                for _ in range(2):  # the second timed: the first compiles
                    got, took = timed(full_kl, setup.cuda)
            gap = relative(got[2][0], wanted[2]), max(relative(a[0], b) for a, b in zip(got[:2], wanted[:2]))
            gaps.append(gap)
            texts.append(f"{name}: KL {gap[0]:.1e}, log-probs {gap[1]:.1e}, {took * 1e3:.1f} ms")
        ok = all(a < setup.loss_tol and b < setup.loss_tol for a, b in gaps)
        mean_kl = float(wanted[2].mean())
        return (
            ok,
            f"{labels.numel()} tokens × {weight.size(0)} vocabulary in {setup.dtype}, mean KL {mean_kl:.3f}: "
            + (", ".join(texts)),
        )

    return run


def check_loss_watch(setup: Setup) -> Callable[[], None]:
    @check("the loss watch finds a NaN loss one step late through its pinned copies")
    def run():
        from alignpipe.trainers.loss_watch import LossWatch

        if not setup.cuda:
            return None, "no CUDA device (the CPU branch is in tests/test_host_sync.py)"
        watch = LossWatch()
        watch.watch(1, torch.tensor(0.5, device="cuda"))
        watch.watch(2, torch.tensor(float("nan"), device="cuda") * torch.ones((), device="cuda"))
        watch.watch(3, torch.tensor(float("inf"), device="cuda"))
        bad = watch.first_bad()
        again = watch.first_bad()
        ok = bad is not None and bad[0] == 2 and again is None
        return ok, f"first bad step {bad}, then {again}"

    return run


def check_activation_offloading(setup: Setup) -> Callable[[], None]:
    @check("activation offloading keeps a packed SFT step's loss and gradients and frees device memory")
    def run():
        from accelerate.utils import send_to_device

        from alignpipe.modeling import enable_activation_checkpointing
        from alignpipe.offload import ActivationOffload

        batch = send_to_device(setup.packed_batch(), setup.device)
        figures = []
        ok = True
        for checkpointed in (False, True):
            model = setup.model("sdpa").train()
            if checkpointed:
                enable_activation_checkpointing(model)
            _loss_and_grads(model, batch)  # warm-up: kernels' first calls, the allocator's pools

            def measured(model):
                if setup.cuda:
                    torch.cuda.reset_peak_memory_stats()
                loss, grads, took = _loss_and_grads(model, batch)
                peak = torch.cuda.max_memory_allocated() if setup.cuda else 0
                # the gradients' copies wait on the host: the next step's peak must not hold them (until session 63 the
                # offloaded step's peak held the plain one's, 0.33 GB on the GPU's model: the checkpointed case then
                # read as 0.26 GB of growth where offloading had freed the 73 MB it moved)
                return loss, [g.cpu() for g in grads], took, peak

            plain = measured(model)
            off = ActivationOffload(setup.device.type).attach(model)
            # warm-up of the offloaded step too: its first run pins its host buffers (cudaHostAlloc, ~1 GB here),
            # which torch's host allocator keeps for every later step; session 42's lease timed that first run
            _loss_and_grads(model, batch)
            off.bytes_moved()
            offloaded = measured(model)
            moved = off.bytes_moved()
            (loss, grads, took, peak), (off_loss, off_grads, off_took, off_peak) = plain, offloaded
            loss_gap = abs(off_loss - loss) / abs(loss)
            grad_gap = max(relative(a, b) for a, b in zip(off_grads, grads, strict=True))
            ok = ok and loss_gap < setup.loss_tol and grad_gap < setup.grad_tol and moved > 0
            # checkpointed, what moves is ~73 MB (the two layers' inputs, 29 MB, and the final norm's saved tensors,
            # 44) beside the LM head's GBs of logits, which set the peak: there the peak must not grow
            ok = ok and (not setup.cuda or off_peak < peak or (checkpointed and off_peak <= peak))
            extra = off_took - took
            figures.append(
                f"{'checkpointed' if checkpointed else 'plain'}: loss gap {loss_gap:.1e}, gradient gap {grad_gap:.1e}, "
                f"{moved / 1e6:.0f} MB moved, peak {peak / 1e9:.2f} → {off_peak / 1e9:.2f} GB, forward+backward "
                f"{took * 1e3:.0f} → {off_took * 1e3:.0f} ms"
                + (f" ({2 * moved / extra / 1e9:.0f} GB/s over the extra time)" if setup.cuda and extra > 0 else "")
            )
        return ok, f"{setup.rows}×{setup.length} tokens, 2 layers; " + "; ".join(figures)

    return run


def qwen05b_parameter_shapes() -> list[tuple[int, ...]]:
    """Every trained tensor's shape in Qwen2-0.5B (494M values: 24 layers, tied embedding)."""
    d, inner, kv = 896, 4864, 128
    layer = [(d, d), (d,), (kv, d), (kv,), (kv, d), (kv,), (d, d), (inner, d), (inner, d), (d, inner), (d,), (d,)]
    return [(151936, d), *layer * 24, (d,)]


ADAMW_BYTES = {"torch": 14, "kahan": 18, "stochastic": 14}
"""Bytes an AdamW step of bf16 weights reads and writes a value: weight, gradient and two moments read, weight and
moments written (2 bytes each), and Kahan's buffer read and written."""


def check_low_precision_adamw(setup: Setup) -> Callable[[], None]:
    @check(
        "AdamW for bf16 weights (Kahan, stochastic): the hand-written and compiled steps keep the eager one's sums, wait "
        "for nothing; their time"
    )
    def run():
        from alignpipe import triton_kernels
        from alignpipe.low_precision_adamw import LowPrecisionAdamW
        from bench.peaks import copy_tb_per_s

        if not setup.cuda:
            return None, "no CUDA device (tests/test_low_precision_adamw.py runs the compiled steps on CPU)"
        g = torch.Generator(device=setup.device).manual_seed(0)
        shapes = qwen05b_parameter_shapes()
        start = [(torch.randn(s, device=setup.device, generator=g) * 0.02).bfloat16() for s in shapes]
        grads = [torch.randn(s, device=setup.device, generator=g).bfloat16() for s in shapes]
        values = sum(t.numel() for t in start)

        def optimizer(kind: str):
            params = [torch.nn.Parameter(t.clone()) for t in start]
            for p, grad in zip(params, grads):
                p.grad = grad
            if kind == "torch":
                return params, torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, fused=True)
            updates = "stochastic" if kind == "stochastic" else "kahan"
            compiled = kind != "eager kahan"  # `kahan`: the hand-written step where Triton runs it
            # a stage's two groups (`build_optimizer`): matrices decayed, vectors not; a launch a group and step
            groups = [
                {"params": [p for p in params if p.ndim >= 2]},
                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
            ]
            return params, LowPrecisionAdamW(
                groups, lr=1e-5, weight_decay=0.01, updates=updates, fused_kernels=compiled
            )

        def step_at(opt, lr: float) -> float:
            """One step at a schedule's learning rate (a new one each step, no new graph): the host's seconds in
            it, the device's queue drained before (timed() drains it after)."""
            for group in opt.param_groups:
                group["lr"] = lr
            start = time.perf_counter()
            opt.step()
            return time.perf_counter() - start

        figures, results, recompiled = [], {}, 0
        graphs = torch._dynamo.utils.counters["stats"]
        rate = copy_tb_per_s()
        for kind in ("torch", "kahan", "compiled kahan", "eager kahan", "stochastic"):
            with elementwise("compiled" if kind == "compiled kahan" else "triton"):
                params, opt = optimizer(kind)
                opt.step()  # first step: states made, the compiled kernels built
                before = graphs["unique_graphs"]
                runs = [timed(functools.partial(step_at, opt, 1e-5 * (1 - i / 10)), cuda=True) for i in range(5)]
                recompiled += graphs["unique_graphs"] - before
                # a step more, after the timed ones, on every side: the sums below compare equal numbers of steps
                # (until session 63 only `kahan` took it, and its weights then stood a step ahead of the eager ones)
                if kind == "kahan":
                    seen, _ = behind_queued_work(setup, opt.step)
                else:
                    opt.step()
            host, times = (sorted(r[i] for r in runs)[2] for i in (0, 1))
            # the bound: every byte a step reads and writes once at the card's copy rate (bf16 weight, gradient and
            # moments, Kahan's buffer too; the stochastic step has none)
            bound = values * ADAMW_BYTES["kahan" if "kahan" in kind else kind] / (rate * 1e12)
            # host time near the whole: the step is bound by its launches and Python, not by the device
            figures.append(f"{kind} {times * 1e3:.1f} ms (host {host * 1e3:.1f}; bound {bound * 1e3:.1f})")
            if "kahan" in kind:
                results[kind] = (params, opt)
            del params, opt
        eager, eager_opt = results.pop("eager kahan")

        def carried(p, opt):  # what Kahan's weight and buffer hold together: the float32 trajectory
            return p.detach().float() + opt.state[p]["kahan_comp"].float()

        # Bit equality needs the same float32 rounding on both sides. Triton's contraction into fused multiply-adds is
        # off (the hand-written step's `enable_fp_fusion=False`, the compiled one's `emulate_precision_casts`), but
        # torch's own CUDA kernels (lerp, addcmul) are nvcc's, which may contract, and its division by a scalar
        # multiplies by the reciprocal: where one rounding of the sum flips, the weight moves one bf16 step and the
        # buffer the opposite way, and what they hold together stays. So the criterion is that sum, and few flips.
        gaps, ok = [], not seen and not recompiled
        for kind, (ours, ours_opt) in results.items():
            same = all(torch.equal(a, b) for a, b in zip(ours, eager))
            carried_gap = max(relative(carried(a, ours_opt), carried(b, eager_opt)) for a, b in zip(ours, eager))
            flipped = max(float((a != b).float().mean()) for a, b in zip(ours, eager))
            moved = max(float((ours_opt.state[p]["kahan_comp"].abs() > 0).float().mean()) for p in ours)
            ok = ok and carried_gap < 1e-4 and flipped < 0.01 and moved > 0
            gaps.append(
                f"{kind} equals eager bit for bit: {same}, weight + buffer gap {carried_gap:.1e}, weights a rounding "
                f"step apart {flipped:.2%}"
            )
        return ok, (
            f"{values / 1e6:.0f}M bf16 values (Qwen2-0.5B's tensors), median of 5 steps at 5 learning rates, each "
            f"beside the time its bytes take at the measured copy rate ({rate:.2f} TB/s): "
            f"{', '.join(figures)}; {'; '.join(gaps)}; graphs compiled after the first step: {recompiled}; "
            f"synchronising calls of `kahan`: {len(seen)}; `kahan` hand-written (Triton runs it): "
            f"{triton_kernels.adamw_usable(setup.device)}"
        )

    return run


def _replayed_against_eager(setup: Setup, step, name: str) -> tuple[bool, str]:
    """Greedy decoding of random prompts through `step` (a replayed decode step), twice, against the eager
    static-cache loop: (every row equal both times and the step not given up, the line to print)."""
    from alignpipe.engine.hf import decode_static
    from alignpipe.engine.sampling import SamplingParams

    model = setup.model("sdpa").float().eval()  # float32: greedy ties are not decided by rounding
    rows, width, new = 16, 64, 48
    ids = torch.randint(2, setup.model_shape["vocab"], (rows, width), generator=torch.Generator().manual_seed(3))
    ids, mask = ids.to(setup.device), torch.ones(rows, width, dtype=torch.long, device=setup.device)
    greedy = SamplingParams(temperature=0, max_new_tokens=new)
    took, out = {}, {}
    with torch.inference_mode():
        for run, kwargs in (("eager", {}), (name, {"step": step}), (f"{name} again", {"step": step})):
            out[run], seconds = timed(lambda kw=kwargs: decode_static(model, ids, mask, greedy, None, 0, **kw)[0], True)
            step.release()
            took[run] = seconds / new * 1e3
    same = [int((out[run] == out["eager"]).all(1).sum()) for run in (name, f"{name} again")]
    times = ", ".join(f"{run} {ms:.2f} ms" for run, ms in took.items())
    fell_back = f"; given up for the eager step: {step.failed}" if step.failed else ""
    return (
        min(same) == rows and not step.failed,
        f"{rows} rows × {new} tokens: rows equal to eager {same}; per token {times}{fell_back}",
    )


def check_compiled_decode(setup: Setup) -> Callable[[], None]:
    @check("the compiled decode step (CUDA graphs) samples the eager static-cache loop's greedy tokens")
    def run():
        from alignpipe.engine.decode_steps import CompiledDecodeStep

        if not setup.cuda:
            return None, "no CUDA device (tests/test_engine_and_judges.py compares them on CPU, inductor's code)"
        return _replayed_against_eager(setup, CompiledDecodeStep(), "compiled")

    return run


def check_graphed_decode(setup: Setup) -> Callable[[], None]:
    @check("the CUDA-graph decode step (the GPU default) samples the eager static-cache loop's greedy tokens")
    def run():
        from alignpipe.engine.decode_steps import GraphedDecodeStep

        if not setup.cuda:
            return None, "no CUDA device (tests/test_engine_and_judges.py checks the recording's plumbing on CPU)"
        return _replayed_against_eager(setup, GraphedDecodeStep(), "graphed")

    return run


def check_rollout_speed(setup: Setup) -> Callable[[], None]:
    @check("hf engine rollouts at GRPO's user shape: the CUDA-graph step generates faster than the eager loops")
    def run():
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from alignpipe import fused_kernels
        from alignpipe.engine.decode_steps import GraphedDecodeStep, takes_fused_kernels
        from alignpipe.engine.hf import decode, decode_static
        from alignpipe.engine.sampling import SamplingParams
        from alignpipe.lean_activations import lean_activations
        from bench.cases import QWEN_05B, decode_bytes_per_step
        from bench.peaks import copy_tb_per_s

        if not setup.cuda:
            return None, "no CUDA device"
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN_05B))
        model.to(setup.device, torch.bfloat16).eval()  # type: ignore[arg-type]  # functools.wraps: unbound to mypy
        rows, width, new = 64, 128, 256  # grpo/8x8x256: 8 prompts × 8 samples, 256 new tokens
        ids = torch.randint(2, QWEN_05B["vocab_size"], (rows, width), generator=torch.Generator().manual_seed(3))
        ids, mask = ids.to(setup.device), torch.ones(rows, width, dtype=torch.long, device=setup.device)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=new)
        step, rate, out = GraphedDecodeStep(), {}, {}

        def rollout(loop, kwargs, seed, keep=False):  # as the engine runs it: recorded, then released (unless kept)
            try:
                return loop(model, ids, mask, sampling, None, 0, seed, **kwargs)[0]
            finally:
                if not keep:
                    step.release()

        loops: tuple[tuple[str, Callable, dict[str, Any]], ...] = (
            ("eager", decode, {}),
            ("eager static", decode_static, {}),
            ("graphed", decode_static, {"step": step}),
        )
        with torch.inference_mode():
            for name, loop, kwargs in (*loops, ("graphed again", decode_static, {"step": step})):
                seed = torch.Generator(device=setup.device).manual_seed(5)
                out[name], seconds = timed(lambda f=loop, kw=kwargs, g=seed: rollout(f, kw, g), True)
                rate[name] = rows * new / seconds
        plain_failed = step.failed
        # as a GRPO stage's policy decodes: patched by `lean_activations` (torch's fused norm), its rotary and SwiGLU
        # kernels fused in the recordings (`fused_kernels.GRAPH_RECORDING`)
        lean_activations(model, fused=True)
        step = GraphedDecodeStep()
        with fused_kernels.without_grad(takes_fused_kernels(model, setup.device)):  # as `HFEngine.generate` runs it
            for name in ("graphed policy", "graphed policy again"):
                seed = torch.Generator(device=setup.device).manual_seed(5)
                kept = name.endswith("again")  # its recording is timed alone below, outside the rollout's time
                _, seconds = timed(lambda g=seed, k=kept: rollout(decode_static, {"step": step}, g, k), True)
                rate[name] = rows * new / seconds
            replay_ms = _replay_ms(step)
        step.release()
        policy_step_ms = rows * 1e3 / rate["graphed policy again"]
        sampling_ms = _sampling_ms(setup, rows, QWEN_05B["vocab_size"], sampling)
        bound = copy_tb_per_s() * 1e12 * rows / decode_bytes_per_step("qwen0.5b", rows, width + new / 2)
        same = int((out["graphed again"] == out["eager static"]).all(1).sum())
        rates = ", ".join(f"{name} {r / 1e3:.1f}k" for name, r in rate.items())
        fell_back = f"; given up for the eager step: {plain_failed}" if plain_failed else ""
        policy = (
            f"given up for the eager step: {step.failed}"
            if step.failed
            else f"fused kernels {'recorded' if step.fused else 'left out after a failed recording'}"
        )
        return (
            not plain_failed and not step.failed and rate["graphed again"] > max(rate["eager"], rate["eager static"]),
            f"{rows} rows × {new} tokens, Qwen2-0.5B bf16: generated tokens/s {rates} (bound {bound / 1e3:.0f}k at "
            f"the measured copy rate; the policy patched as a stage patches it: {policy}); sampled rows of the plain "
            f"model equal to the eager static loop's {same}/{rows}{fell_back}; "
            f"sampling, outside the graph: {sampling_ms:.3f} ms of each {rows * 1e3 / rate['graphed again']:.3f} ms "
            f"graphed step of the plain model; the policy's {policy_step_ms:.3f} ms a token (prefill and recording "
            f"included), its replay alone {_ms(replay_ms)}",
        )

    return run


def check_decode_kernels(setup: Setup) -> Callable[[], None]:
    @check("kernels one decode step at GRPO's shape issues on the GPU: the plain model's, and the policy's as recorded")
    def run():
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from alignpipe.lean_activations import lean_activations
        from bench.cases import QWEN_05B
        from bench.decode_kernels import Kernels

        if setup.cuda:
            shape, rows, width = QWEN_05B, 64, 128
        else:  # the same steps on a small model, operators counted instead of kernels (what the CPU tests run)
            shape, rows, width = {**QWEN_05B, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 512}, 4, 8
            shape.update(num_attention_heads=2, num_key_value_heads=1)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
        model.to(setup.device, setup.dtype).eval()  # type: ignore[arg-type]  # functools.wraps: unbound to mypy
        counts = {}
        for name in ("plain", "policy"):
            if name == "policy":  # patched as a stage patches it, its fused kernels taken as a recording takes them
                lean_activations(model, fused=True)
            step = _one_decode_step(model, rows, width, recorded=name == "policy")
            if setup.cuda:
                counts[name] = _cuda_kernels(step)
            else:
                with Kernels() as counter:
                    step()
                counts[name] = len(counter.names)
        layers = shape["num_hidden_layers"]
        detail = ", ".join(f"{name} {n} ({n / layers:.1f} a layer)" for name, n in counts.items())
        if not setup.cuda:
            return None, f"no CUDA device; operators counted on CPU instead (no fused kernels there): {detail}"
        return counts["policy"] < counts["plain"], (
            f"{rows} rows after a {width}-token prompt, Qwen2-0.5B bf16, CUDA kernels and copies a step: {detail} "
            "(divide the rollout line's graphed milliseconds a step by these for the time a kernel takes)"
        )

    return run


def _one_decode_step(model, rows: int, width: int, recorded: bool) -> Callable[[], None]:
    """A function running one static-cache decode step of `model` as the hf engine's loop runs it (its cache and
    attention bias), after a prefill; `recorded`: as a CUDA-graph recording of a policy runs it (`StepFusions`: fused
    kernels, merged projections, residual adds fused with norms). Run once here first (kernels compile, lazy work
    happens outside a count)."""
    from alignpipe.engine.decode_steps import StepFusions, decode_step
    from bench.decode_kernels import prefilled_step

    args = prefilled_step(model, rows, width)
    with torch.inference_mode():
        fusions = StepFusions(model, model.device) if recorded else None

    def step() -> None:
        with torch.inference_mode(), fusions.active() if fusions else contextlib.nullcontext():
            decode_step(model, *args)

    step()
    return step


def _cuda_kernels(step: Callable[[], None]) -> int:
    """How many kernels, copies and fills `step()` runs on the GPU (torch's profiler, CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _replay_ms(step, cuda: bool = True, replays: int = 64) -> float | str:
    """Milliseconds one replay of `step`'s recording takes alone, its static cache emptied first (so the replays
    write inside it). Beside the graphed loop's time a token, the rest is what the loop runs outside the graph each
    token (the token choice, the input copies, the bookkeeping); a string saying why, where it could not be
    measured."""
    try:
        (recording,) = step.recordings.values()
        for cache in step.caches.values():
            cache.reset()
        recording.replay()
        _, seconds = timed(lambda: [recording.replay() for _ in range(replays)], cuda)
        return seconds / replays * 1e3
    except Exception as err:  # a timing aid: the rollout line stands without it
        return f"not measured ({type(err).__name__}: {err})"


def _ms(value: float | str) -> str:
    return f"{value:.3f} ms" if isinstance(value, float) else str(value)


def _sampling_ms(setup: Setup, rows: int, vocab: int, sampling) -> float:
    """Milliseconds per decode step of the hf engine's token choice (`next_token`, run eagerly after each replayed
    step) on (rows, vocab) bf16 logits: the share of a graphed step that moving sampling into the graph would save."""
    from alignpipe.engine.hf import next_token

    logits = torch.randn(rows, vocab, device=setup.device, dtype=torch.bfloat16)
    generator = torch.Generator(device=setup.device).manual_seed(7)
    with torch.inference_mode():
        next_token(logits, sampling, generator)  # the token; no log-prob asked
        calls = 100
        _, seconds = timed(lambda: [next_token(logits, sampling, generator) for _ in range(calls)], setup.cuda)
    return seconds / calls * 1e3


def innermost_caller() -> str:
    """ "file:line" of the innermost frame of the calling stack outside torch and the warnings machinery: whose call
    a warning raised inside torch (a synchronising operator) came from."""
    frames = [
        f
        for f in traceback.extract_stack()[:-1]
        if "/torch/" not in f.filename and f.filename not in (warnings.__file__, __file__)
    ]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def sync_recorder(seen: list[tuple[str, str]], traced: int | None = None) -> Callable[..., None]:
    """A `warnings.showwarning` that appends (the warning's own line, `innermost_caller()`) of each synchronising
    warning to `seen`; past the first `traced` calls the caller is "" (a walk of the stack costs ~0.1-0.5 ms in a
    deep trainer, where the warning alone costs some µs)."""

    def record(message, category, filename, lineno, file=None, line=None):
        # torch's own words for a synchronising call; `set_sync_debug_mode` itself warns that the mode is a
        # prototype "not yet detecting all synchronizing operations" (session 15's and 29's false finding)
        if "called a synchronizing CUDA operation" in str(message):
            caller = innermost_caller() if traced is None or len(seen) < traced else ""
            seen.append((f"{filename.rsplit('/', 1)[-1]}:{lineno}", caller))

    return record


@contextlib.contextmanager
def recorded_syncs(seen: list[tuple[str, str]], traced: int | None = None):
    """Within: every synchronising CUDA call warns (`torch.cuda.set_sync_debug_mode("warn")`) and is appended to
    `seen` (`sync_recorder`, callers of the first `traced`) instead of printed."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = sync_recorder(seen, traced)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")


def behind_queued_work(setup: Setup, fn: Callable) -> tuple[list[tuple[str, str]], float]:
    """(the synchronising calls `fn` made, its host seconds), run with ~30 ms of matmuls queued on the device, so that
    a call that waits for the device is seen and costs time; the queue is drained after."""
    busy = torch.randn(8192, 8192, device=setup.device, dtype=setup.dtype)
    seen: list[tuple[str, str]] = []
    with recorded_syncs(seen):
        for _ in range(20):
            busy = busy @ busy / 8192**0.5
        _, took = timed(fn, cuda=False)
    torch.cuda.synchronize()
    return seen, took


def check_step_syncs(setup: Setup) -> Callable[[], None]:
    @check("packed SFT and padding-free DPO micro-steps (reference, fused head) on varlen never wait for the device")
    def run():
        from accelerate.utils import send_to_device

        from alignpipe.trainers import dpo, sft
        from alignpipe.trainers.configs import DPOConfig

        if not setup.cuda:
            return None, "no CUDA device (tests/test_host_sync.py runs the CPU proxy of this check)"
        model = setup.model("varlen")
        reference = setup.model("varlen").eval().requires_grad_(False)
        sft_batch = send_to_device(setup.packed_batch(), setup.device)
        dpo_batch = send_to_device(setup.dpo_batch(), setup.device)
        fused: list[bool] = []

        def sft_step():
            sft.token_loss_sum(model, sft_batch)[0].backward()

        def reference_logps(batch):  # as `dpo._Reference.compute` runs a frozen copy
            with torch.inference_mode():
                logps = dpo.completion_logps(reference, batch, compiled=True)[0]
            return logps.clone().chunk(2)

        original = dpo.fused_pair_loss

        def fused_head(*args):  # stands in for `dpo.fused_pair_loss` during the DPO step, noting whether it ran
            out = original(*args)
            fused.append(out is not None)
            return out

        def dpo_step():  # `dpo.batch_loss` as a stage runs it: the reference's pass, then the policy's fused head
            dpo.fused_pair_loss = fused_head
            try:
                dpo.batch_loss(model, dpo_batch, reference_logps, DPOConfig())[0].backward()
            finally:
                dpo.fused_pair_loss = original

        found = []
        for name, step in (("SFT", sft_step), ("DPO", dpo_step)):
            step()  # first call: kernels load, compile caches fill, varlen's one-time check reads the device
            torch.cuda.synchronize()
            seen: list[tuple[str, str]] = []  # (the warning's own line, the innermost caller outside torch)
            with recorded_syncs(seen):
                step()
            where = sorted({f"{line} from {caller.rsplit('/', 1)[-1]}" for line, caller in seen})
            found.append((name, seen, where))
        return (
            not any(seen for _, seen, _ in found),
            "; ".join(
                f"{name}: {len(seen)} synchronising calls ({', '.join(where) or 'none'})" for name, seen, where in found
            )
            + f" (DPO's fused head taken: {bool(fused) and all(fused)})",
        )

    return run


def check_batch_transfer(setup: Setup) -> Callable[[], None]:
    @check("a stage's loader hands over packed SFT batches without waiting for the device (pinned, non-blocking)")
    def run():
        from alignpipe.distributed import make_accelerator
        from alignpipe.trainers import sft
        from alignpipe.trainers.common import batch_loader

        if not setup.cuda:
            return None, "no CUDA device (tests/test_host_sync.py checks the loop collates before a log point waits)"
        blocks = setup.packed_blocks(rows_per_block=24)  # 8 batches of one block or more
        accelerator, ok, said = make_accelerator(), True, []
        for workers in (0, 1):  # collated here, and in a worker process (`dataloader_workers`, a stage's GPU default)
            loader = batch_loader(accelerator, blocks, 1, lambda b: sft.collate(b, 0), workers=workers)
            batches = iter(loader)
            next(batches)  # the first batch: pinned memory is allocated, the worker started
            seen, took = behind_queued_work(setup, lambda it=batches: [next(it) for _ in range(3)])
            ok = ok and not seen
            said.append(
                f"{workers} workers: 3 batches in {took * 1e3:.1f} ms of host time, synchronising calls: {len(seen)} "
                f"({sorted({caller for _, caller in seen}) or 'none'})"
            )
        return ok, "; ".join(said) + " (~30 ms of matmuls queued)"

    return run


def check_host_copies(setup: Setup) -> Callable[[], None]:
    @check("the online trainers' per-micro-batch pieces reach the GPU without a wait (`device_copies.to_device`)")
    def run():
        from alignpipe.device_copies import to_device
        from alignpipe.packed_rows import pack_answers

        if not setup.cuda:
            return None, "no CUDA device (tests/test_host_sync.py checks the online updates copy with to_device)"
        # a GRPO micro-batch's host pieces at 8×8×256: mask, advantages, index, its padding-free layout
        prompts, answers = [list(range(96))] * 8, [list(range(256))] * 8
        piece: dict[str, Any] = {
            "mask": torch.ones(8, 256),
            "advantages": torch.randn(8),
            "index": torch.arange(8),
            "packed": pack_answers(prompts, answers, 256, True, list(range(8))),
        }
        to_device(piece, setup.device)  # the first call: pinned memory is allocated
        ours, ours_took = behind_queued_work(setup, lambda: to_device(piece, setup.device))
        plain, plain_took = behind_queued_work(
            setup, lambda: [t.to(setup.device) for t in (piece["mask"], piece["advantages"])]
        )
        return not ours and bool(plain), (
            f"to_device: {len(ours)} synchronising calls, {ours_took * 1e3:.2f} ms of host time; plain .to (the "
            f"control): {len(plain)} synchronising calls, {plain_took * 1e3:.1f} ms, with ~30 ms of matmuls queued"
        )

    return run


CHECKS = (
    check_varlen,
    check_padding_free_dpo,
    check_fused_norm,
    check_fused_silu,
    check_fused_rotary,
    check_sft_head,
    check_dpo_head,
    check_rl_head,
    check_loss_watch,
    check_activation_offloading,
    check_low_precision_adamw,
    check_full_kl,  # after the AdamW line: `gpu_session.sh n` runs these checks in this order within its limit
    check_step_syncs,
    check_batch_transfer,
    check_host_copies,
    check_compiled_decode,
    check_graphed_decode,
    check_rollout_speed,
    check_decode_kernels,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU even where CUDA is available")
    parser.add_argument(
        "--skip",
        default="",
        help="checks to leave out, by name without `check_` (compiled_decode,rollout_speed): a short lease's minutes",
    )
    parser.add_argument("--only", default="", help="run only these checks, by name without `check_`")
    args = parser.parse_args(argv)
    skipped, only = ({f"check_{name}" for name in names.split(",") if name} for names in (args.skip, args.only))
    if unknown := (skipped | only) - {make.__name__ for make in CHECKS}:
        parser.error(f"no check {', '.join(sorted(unknown))}; known: {', '.join(m.__name__[6:] for m in CHECKS)}")
    if only:
        skipped |= {make.__name__ for make in CHECKS} - only
    setup = Setup(force_cpu=args.cpu)
    print(f"device {setup.device} ({torch.cuda.get_device_name() if setup.cuda else 'CPU'}), {setup.dtype}", flush=True)
    for make in CHECKS:
        if make.__name__ not in skipped:
            make(setup)()
    failed = [name for name, ok, _ in RESULTS if ok is False]
    print(f"{len(RESULTS) - len(failed)} of {len(RESULTS)} passed or skipped; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
