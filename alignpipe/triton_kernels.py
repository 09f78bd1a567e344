"""Kernels of `fused_kernels`, `low_precision_adamw` and the LM head's losses written in Triton by hand: the SwiGLU
product and its gradients, the rotary embedding of queries and keys and its gradient, the Kahan AdamW step of bf16
weights, and the head's per-position log-sum-exp, label log-prob, entropy (or log Σp²) and their gradient.

Why by hand, where inductor writes the same kernels from the eager expressions (the compiled path, which stays as
the fallback): a compiled function's call goes through dynamo's guards, AOT autograd's runtime wrappers and
inductor's Python `call` before its launch. A DPO step on a 24-layer model makes ~144 such calls for the element-wise
kernels (each layer's rotary and SwiGLU, forward for the policy and the reference, backward for the policy) and 37
for the AdamW step (calls of 8 slices), at ~0.2–0.4 ms of host time each on this project's CPUs (docs/benchmarks-log.md,
sessions 43 and 44), where a step's device time is ~190 ms: a step whose host cannot stay ahead of its GPU pays them
all. A Triton kernel's call is its launch: its arguments bound and its compiled variant looked up (tens of µs). The
kernels compute in float32 and round once, as the compiled ones do.

Each kernel is compiled by Triton at its first launch in a process: once per dtype and layout, not per size. Triton
specialises an integer argument only on whether it is 1 or a multiple of 16, and where a kernel reads adjacent values
that is what lets it load 16 bytes at a time; the rotary kernel's token count, which a decode step makes 1, is left
unspecialised (`do_not_specialize`). `tests/triton_build_check.py` builds every kernel for A100s, H100s and B200s on
the CPU and reads its loads, stores and registers. `usable`, `adamw_usable` and `head_usable` try each kernel once
per device and process against the eager expressions; where one fails to build or computes otherwise, they say so
once and the compiled kernels run.

On a CPU, these run only under Triton's interpreter (`TRITON_INTERPRET=1`, set before the first call), which is how
the tests check them against the eager expressions."""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys

import torch

log = logging.getLogger(__name__)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""What the kernels take (they compute in float32); other dtypes go to `fused_kernels`' compiled kernels."""

SWIGLU_BLOCK = 1024
"""Columns of one (row, column block) program of the SwiGLU kernels: 4 warps of 8 values per thread."""


def interpreted() -> bool:
    """Whether Triton runs its kernels in its interpreter (on the host, from numpy): `TRITON_INTERPRET=1`."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _kernels():
    """`triton_jit`, its kernels decorated now: under the interpreter if `TRITON_INTERPRET=1` now (tests clear this
    cache to switch). Their builds go to the compiler's cache (`share_compile_cache`)."""
    share_compile_cache()
    from alignpipe import triton_jit

    return importlib.reload(triton_jit)


def share_compile_cache() -> None:
    """Where `TRITON_CACHE_DIR` is unset, set it to the folder `torch.compile` gives its own Triton kernels: under
    `TORCHINDUCTOR_CACHE_DIR` (default `/tmp/torchinductor_<user>`), for the current device.

    Triton keeps each build of these kernels in `TRITON_CACHE_DIR`, by default `~/.triton/cache`. Inductor sets that
    variable to its own folder when it loads its first kernel, if nobody has. So a stage whose first Triton kernel
    was one of these (every default SFT, DPO, reward and KTO stage on a GPU, which compiles nothing) built them into
    the home folder, which a docker or kubernetes job loses when it ends, although the work-pool templates keep
    `TORCHINDUCTOR_CACHE_DIR` on the shared volume for that reason: every such job built them again. And a process
    whose first kernel was inductor's looked for them in another folder than one whose first was ours. Set before the
    first build, the folder is the same whichever kind comes first, and lies where the compiler's cache lies."""
    if "TRITON_CACHE_DIR" in os.environ:  # set by the user, or by inductor already
        return
    try:
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
    except ImportError:  # inductor's layout moved: Triton's own default stays
        return
    device = torch.cuda.current_device() if torch.cuda.is_available() else 0
    os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(device)


def variants_compiled() -> int:
    """How many compiled variants of the kernels this process holds (Triton compiles one at the first launch of each
    dtype, layout and specialisation): a count that grows between a run's steady steps says that a launch compiled
    in the middle of training (a size specialised after all). 0 before the first launch, under the interpreter, and
    where Triton keeps its cache otherwise than in `device_caches` (its 3.x layout)."""
    jit = sys.modules.get("alignpipe.triton_jit")
    if jit is None:
        return 0
    kernels = [fn for fn in vars(jit).values() if hasattr(fn, "device_caches")]
    return sum(len(caches[0]) for fn in kernels for caches in fn.device_caches.values())


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: dtypes in `DTYPES`, on a CUDA device (or any, interpreted)."""
    return all(t.dtype in DTYPES for t in tensors) and (interpreted() or tensors[0].device.type == "cuda")


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """A 2-D `t` whose columns are adjacent (rows may be strided: a merged projection's slices)."""
    return t if t.stride(1) == 1 or t.size(1) == 1 else t.contiguous()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of (rows, cols) tensors, computed in float32, rounded once to up's dtype; (rows, cols),
    contiguous."""
    gate, up = _row_major(gate), _row_major(up)
    rows, cols = gate.shape
    out = torch.empty((rows, cols), dtype=up.dtype, device=up.device)
    if out.numel():
        grid = (rows, _cdiv(cols, SWIGLU_BLOCK))
        _kernels().silu_mul_forward[grid](
            gate, up, out, cols, gate.stride(0), up.stride(0), BLOCK=SWIGLU_BLOCK, num_warps=4
        )
    return out


def silu_mul_grads(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, product: bool = False):
    """(d gate, d up) of silu(gate) · up for (rows, cols) tensors, in float32, each rounded once to its input's
    dtype; with `product`, also the product again (up's dtype). Contiguous (rows, cols) each."""
    grad, gate, up = _row_major(grad), _row_major(gate), _row_major(up)
    rows, cols = gate.shape
    d_gate = torch.empty((rows, cols), dtype=gate.dtype, device=gate.device)
    d_up = torch.empty((rows, cols), dtype=up.dtype, device=up.device)
    again = torch.empty((rows, cols) if product else (0,), dtype=up.dtype, device=up.device)
    if d_gate.numel():
        grid = (rows, _cdiv(cols, SWIGLU_BLOCK))
        _kernels().silu_mul_backward[grid](
            grad, gate, up, d_gate, d_up, again if product else d_up, cols,
            grad.stride(0), gate.stride(0), up.stride(0), WITH_PRODUCT=product, BLOCK=SWIGLU_BLOCK, num_warps=4,
        )  # fmt: skip
    return (d_gate, d_up, again) if product else (d_gate, d_up)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `apply_rotary_pos_emb(q, k, cos, sin)` for (B, heads, T, D) queries and keys (any strides) and
    (B or 1, T, D) cos and sin, in float32, rounded once to q's and k's dtypes; with `backward`, the gradients
    (d q, d k) of that map given the outputs' gradients as q and k. The results are (B, heads, T, D) views of
    (B, T, heads, D) tensors, the layout a projection hands attention."""
    batch, q_heads, tokens, dim = q.shape
    k_heads = k.size(1)
    if dim % 2:
        raise ValueError(f"rotary: the head dimension must be even, not {dim}")
    if cos.size(0) == 1 and batch > 1:
        cos, sin = cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty((batch, tokens, q_heads, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((batch, tokens, k_heads, dim), dtype=k.dtype, device=k.device)
    if q_out.numel() and k_out.numel():
        half = dim // 2
        _kernels().rotary[(batch * tokens,)](
            q, k, q_out, k_out, cos, sin, tokens, q_heads, k_heads, *q.stride(), *k.stride(), *cos.stride(),
            HALF=half, Q_HEADS=_power_of_two(q_heads), K_HEADS=_power_of_two(k_heads),
            HALF_BLOCK=_power_of_two(half), BACKWARD=backward, num_warps=4 if q_heads * half >= 1024 else 2,
        )  # fmt: skip
    return q_out.transpose(1, 2), k_out.transpose(1, 2)


VOCAB_BLOCK = 2048
"""Logits a program of the head's kernels reads at a time (the scores' loop, the gradients' blocks)."""


SECOND_STATISTICS = {"entropy": 1, "log_sum_sq": 2}
"""The second statistics `token_scores` computes beside the log-probs (`logprobs._second_statistic`'s), by the
number its kernel is compiled for."""


def token_scores(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, second: str | None = None
) -> tuple[torch.Tensor, ...]:
    """(log-sum-exp, the label's log-prob) per position of (positions, vocabulary) `logits` divided by `temperature`,
    in float32, the logits read once: `linear_sequence_loss._scores_fusable` and `logprobs._chunk_logprobs`; with
    `second`, also each position's `second` statistic of that softmax from the same read: "entropy", −Σ p log p (the
    RL trainers' logged entropy or bonus), or "log_sum_sq", log Σ p² (DPO's WPO weights). `labels`: (positions,) in
    the vocabulary."""
    logits = _row_major(logits)
    rows, vocab = logits.shape
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    token = torch.empty(rows, dtype=torch.float32, device=logits.device)
    statistic = torch.empty(rows if second else 0, dtype=torch.float32, device=logits.device)
    if rows:
        _kernels().token_scores[(rows,)](
            logits, labels, lse, token, statistic if second else lse, logits.stride(0), float(temperature),
            VOCAB=vocab, BLOCK=VOCAB_BLOCK, SECOND=SECOND_STATISTICS[second] if second else 0, num_warps=8,
        )  # fmt: skip
    return (lse, token, statistic) if second else (lse, token)


def token_grads(
    logits: torch.Tensor,
    lse: torch.Tensor,
    labels: torch.Tensor,
    coef: torch.Tensor,
    temperature: float = 1.0,
    entropy: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """coef · (one-hot(label) − softmax(logits / temperature)) per position, computed in float32 from `token_scores`'
    `lse` (at the same temperature), written in the logits' dtype as a contiguous (positions, vocabulary) tensor:
    `linear_sequence_loss._grad_fusable`. The gradient of the label's log-prob with respect to the logits is this
    with coef = (its upstream gradient) / temperature. `entropy`: (H, c), each position's entropy from `token_scores`
    and a coefficient, adds c · ∂H/∂(logits / temperature) = −c · p (log p + H): with c = (the entropy's upstream
    gradient) / temperature, its gradient with respect to the logits."""
    logits = _row_major(logits)
    rows, vocab = logits.shape
    grad = torch.empty((rows, vocab), dtype=logits.dtype, device=logits.device)
    spread, spread_coef = entropy if entropy is not None else (lse, coef)
    if grad.numel():
        _kernels().token_grads[(rows, _cdiv(vocab, VOCAB_BLOCK))](
            logits, lse, labels, coef, spread, spread_coef, grad, vocab, logits.stride(0), float(temperature),
            BLOCK=VOCAB_BLOCK, ENTROPY=entropy is not None, num_warps=8,
        )  # fmt: skip
    return grad


def token_kl(
    logits: torch.Tensor, ref_logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the label's log-prob, the reference's, KL(π ‖ π_ref)) per position of (positions, vocabulary) `logits` and
    `ref_logits` divided by `temperature`, in float32, each read once: PPO's `kl_penalty: full`
    (`logprobs.full_kl`), where the eager chunk forms two float32 log-softmaxes and their difference. `labels`:
    (positions,) in the vocabulary."""
    if logits.shape != ref_logits.shape:
        raise ValueError(f"token_kl: logits {tuple(logits.shape)} and ref_logits {tuple(ref_logits.shape)} differ")
    logits, ref_logits = _row_major(logits), _row_major(ref_logits)
    rows, vocab = logits.shape
    out = torch.empty((3, rows), dtype=torch.float32, device=logits.device)
    if rows:
        _kernels().token_kl[(rows,)](
            logits, ref_logits, labels, out[0], out[1], out[2], logits.stride(0), ref_logits.stride(0),
            float(temperature), VOCAB=vocab, BLOCK=VOCAB_BLOCK, num_warps=8,
        )  # fmt: skip
    token, ref_token, kl = out.unbind(0)
    return token, ref_token, kl


ADAMW_BLOCK = 4096
"""Values a program of the AdamW kernel updates: 8 warps of 16 values per thread."""

ALIGNMENT = 16
"""Bytes a vector load or store moves: 8 bf16 values. The AdamW kernel moves its values that many at a time where
every slice of a launch starts at an address that is a multiple of it and holds a multiple of 8 values
(`kahan_adamw_at`)."""


def kahan_adamw_takes(pieces: list[tuple[torch.Tensor, ...]]) -> bool:
    """Whether `kahan_adamw` takes these slices: each (weight, gradient, exp_avg, exp_avg_sq, compensation) flat,
    contiguous and bf16, on a CUDA device (or any, interpreted)."""
    return all(
        len(piece) == 5 and all(t.dim() == 1 and t.is_contiguous() and t.dtype == torch.bfloat16 for t in piece)
        for piece in pieces
    ) and (interpreted() or pieces[0][0].device.type == "cuda")


class AdamWBlocks:
    """Which slice and where in it each program of `kahan_adamw`'s launch updates, for one list of slice sizes, on
    the device: made once while the sizes stay (a model's parameters keep theirs from step to step; one a parameter
    group, whose sizes differ)."""

    def __init__(self) -> None:
        self.sizes: tuple[int, ...] = ()
        self.tables: tuple[torch.Tensor, ...] = ()
        self.whole_vectors = False  # whether every size is a multiple of the values a vector load moves

    def of(self, sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
        """(numels, each block's slice, each block's start), made anew where `sizes` changed (copied to the device
        without a wait: a plain `.to` of host memory waits for every kernel queued)."""
        from alignpipe.device_copies import to_device

        if sizes != self.sizes or self.tables[0].device != torch.device(device):
            counts = [_cdiv(n, ADAMW_BLOCK) for n in sizes]
            piece = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), torch.tensor(counts))
            first = torch.tensor([0, *counts[:-1]]).cumsum(0).repeat_interleave(torch.tensor(counts))
            start = ((torch.arange(len(piece)) - first) * ADAMW_BLOCK).to(torch.int32)
            numels = torch.tensor(sizes, dtype=torch.int32)
            self.sizes, self.tables = sizes, tuple(to_device([numels, piece, start], device))
            self.whole_vectors = all(n * torch.bfloat16.itemsize % ALIGNMENT == 0 for n in sizes)
        return self.tables


def kahan_adamw(pieces: list[tuple[torch.Tensor, ...]], scalars: tuple[float, ...], blocks: AdamWBlocks) -> None:
    """`low_precision_adamw.kahan_update` of every slice in `pieces` (`kahan_adamw_takes`) in one launch: a
    compiled call a few slices took ~0.1–0.3 ms of host time each (37 calls a step for Qwen2-0.5B), this is one
    launch and a table of addresses copied without a wait. `scalars`: `low_precision_adamw._scalars`' terms.
    Triton's contraction of a product and a sum into one fused multiply-add is off, and the divisions and the root
    are rounded as IEEE's, so each value is computed as torch's eager kernels compute it (CUDA's eager division by a
    scalar multiplies by its reciprocal: at most a rounding step apart there)."""
    rows = [[t.data_ptr() for t in piece] for piece in pieces]
    kahan_adamw_at(rows, tuple(piece[0].numel() for piece in pieces), pieces[0][0].device, scalars, blocks)


def kahan_adamw_at(
    rows: list, sizes: tuple[int, ...], device: torch.device, scalars: tuple[float, ...], blocks: AdamWBlocks
) -> None:
    """`kahan_adamw` of slices given by their addresses: each row the (weight, gradient, exp_avg, exp_avg_sq,
    compensation) addresses of `sizes`' values of bf16 on `device` (`low_precision_adamw`'s kept plan of a step).
    The kernel moves 8 values a load where every address is `ALIGNMENT`-aligned and every size a multiple of 8 (a
    tensor of its own always starts aligned; a view into a shared buffer, such as a gradient in DDP's bucket, may
    not), and one value a load otherwise."""
    from alignpipe.device_copies import to_device

    numels, piece, start = blocks.of(sizes, device)
    table = torch.tensor(rows, dtype=torch.int64)
    aligned = blocks.whole_vectors and not bool(table.remainder(ALIGNMENT).any())
    pointers = to_device(table, device)
    beta1, beta2, step_size, root_correction, lr_decay, eps = scalars
    _kernels().kahan_adamw[(len(piece),)](
        pointers, numels, piece, start, 1 - beta1, beta2, 1 - beta2, step_size, root_correction, lr_decay, eps,
        BLOCK=ADAMW_BLOCK, ALIGNED=aligned, num_warps=8, enable_fp_fusion=False,
    )  # fmt: skip


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def usable(device: torch.device) -> bool:
    """Whether the SwiGLU and rotary kernels build and run on `device` and compute what the eager expressions do
    (tried once per device and process, each kernel each way on a few bf16 rows, `disagreement`); a failure is said
    once, and `fused_kernels` runs its compiled kernels instead. False off CUDA unless interpreted."""
    return _tried(device, disagreement, "the compiled kernels run")


@functools.cache
def adamw_usable(device: torch.device) -> bool:
    """`usable` for `kahan_adamw` (`adamw_disagreement`); where it fails, the compiled AdamW step runs."""
    return _tried(device, adamw_disagreement, "the compiled AdamW step runs")


@functools.cache
def head_usable(device: torch.device) -> bool:
    """`usable` for the LM head's `token_scores` and `token_grads` (`head_disagreement`); where they fail, the compiled
    head kernels run."""
    return _tried(device, head_disagreement, "the compiled head kernels run")


@functools.cache
def kl_usable(device: torch.device) -> bool:
    """`usable` for `token_kl` (`kl_disagreement`), tried apart from the other head kernels so that a card where it
    fails keeps them; there PPO's full KL runs compiled."""
    return _tried(device, kl_disagreement, "the full KL runs compiled")


def _tried(device: torch.device, disagreement_on, fallback: str) -> bool:
    if torch.device(device).type != "cuda" and not interpreted():
        return False
    try:
        wrong = disagreement_on(device)
    except Exception as err:  # whatever Triton raises (import, compiler, driver): the fallback is safe
        log.warning("triton_kernels: Triton cannot run its kernels on %s (%s); %s", device, err, fallback)
        return False
    if wrong is not None:
        log.warning("triton_kernels: %s on %s differs from the eager expression; %s", wrong, device, fallback)
    return wrong is None


def head_disagreement(device: torch.device) -> str | None:
    """ "the head's scores" or "the head's gradients" where `token_scores` (at temperatures 1 and 0.7) or `token_grads`
    on a few bf16 positions over two vocabulary blocks and a part compute otherwise than the compiled kernels' eager
    expressions (`linear_sequence_loss`, `logprobs`); None where they agree."""
    from alignpipe.linear_sequence_loss import _grad_fusable, _scores_fusable

    g = torch.Generator(device=device).manual_seed(0)
    vocab = 2 * VOCAB_BLOCK + 100
    logits = (torch.randn(3, vocab, generator=g, device=device) * 4).to(torch.bfloat16)
    labels = torch.tensor([0, vocab - 1, 7], device=device)
    coef = torch.tensor([0.5, -1.0, 2.0], device=device)
    lse, token = token_scores(logits, labels)
    want_lse, want_token = _scores_fusable(logits, labels, torch.float32)
    scaled = (logits.float() / 0.7).log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1)
    if not all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-5)
        for a, b in ((lse, want_lse), (token, want_token), (token_scores(logits, labels, 0.7)[1], scaled))
    ):
        return "the head's scores"
    grad = token_grads(logits, lse, labels, coef).float()
    if not torch.allclose(
        grad, _grad_fusable(logits, want_lse, labels, coef, torch.float32).float(), rtol=2**-7, atol=1e-6
    ):
        return "the head's gradients"
    return None


def kl_disagreement(device: torch.device) -> str | None:
    """ "the heads' KL" where `token_kl` on a few bf16 positions over two vocabulary blocks and a part, at temperature
    0.7, computes otherwise than the eager float32 log-softmaxes (`logprobs.logits_kl`); None where they agree."""
    from alignpipe.logprobs import logits_kl

    g = torch.Generator(device=device).manual_seed(1)
    vocab = 2 * VOCAB_BLOCK + 100
    logits = torch.randn(3, vocab, generator=g, device=device) * 4
    ref_logits = (logits + torch.randn(3, vocab, generator=g, device=device)).to(torch.bfloat16)
    logits, labels = logits.to(torch.bfloat16), torch.tensor([0, vocab - 1, 7], device=device)
    got, want = token_kl(logits, ref_logits, labels, 0.7), logits_kl(logits, ref_logits, labels, 0.7)
    if not all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(got, want, strict=True)):
        return "the heads' KL"
    return None


def adamw_disagreement(device: torch.device) -> str | None:
    """ "the Kahan AdamW step" where `kahan_adamw` on two small bf16 slices updates the moments otherwise than
    `low_precision_adamw.kahan_update` (beyond a rounding step), or the weights plus their compensation beyond 1e-6
    (the eager CUDA kernel divides by a scalar through its reciprocal); None where they agree. Tried on slices of
    whole vectors (8 values a load) and on slices with a value over (one a load)."""
    from alignpipe.low_precision_adamw import _scalars, kahan_update

    g = torch.Generator(device=device).manual_seed(0)

    def slices(sizes: tuple[int, ...]) -> list[tuple[torch.Tensor, ...]]:
        g.manual_seed(0)
        made = []
        for n in sizes:
            w, grad, m, v, c = (torch.randn(n, generator=g, device=device) * s for s in (0.02, 1e-3, 1e-4, 1e-7, 1e-5))
            made.append(tuple(t.to(torch.bfloat16) for t in (w, grad, m, v.abs(), c)))
        return made

    scalars = _scalars({"betas": (0.9, 0.999), "lr": 1e-5, "eps": 1e-8, "weight_decay": 0.01}, 3)
    for sizes in ((ADAMW_BLOCK + 104, 24), (ADAMW_BLOCK + 100, 17)):
        got, want = slices(sizes), slices(sizes)
        kahan_adamw(got, scalars, AdamWBlocks())
        for piece in want:
            kahan_update(*piece, *scalars)
        for (w, _, m, v, c), (w0, _, m0, v0, c0) in zip(got, want, strict=True):
            moments = all(torch.allclose(a.float(), b.float(), rtol=2**-7, atol=1e-12) for a, b in ((m, m0), (v, v0)))
            tracked = torch.allclose(w.float() + c.float(), w0.float() + c0.float(), rtol=0, atol=1e-6)
            if not (moments and tracked):
                return "the Kahan AdamW step"
    return None


def disagreement(device: torch.device) -> str | None:
    """Which kernel (and direction) computes something other than `fused_kernels`' eager expressions on small bf16
    inputs laid out as a training step hands them over (a merged projection's strided halves, transposed queries and
    keys, cos and sin of batch 1 for two rows); None where all agree within a rounding step."""
    from alignpipe import fused_kernels as eager

    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device).to(torch.bfloat16)

    merged, grad = rand(3, 2 * 96), rand(3, 96)
    gate, up = merged[:, :96], merged[:, 96:]
    q, k = rand(2, 5, 3, 16).transpose(1, 2), rand(2, 5, 1, 16).transpose(1, 2)
    cos, sin = rand(1, 5, 16), rand(1, 5, 16)
    pairs = {
        "the SwiGLU forward": ((silu_mul(gate, up),), (eager._silu_mul_forward(gate, up),)),
        "the SwiGLU backward": (
            silu_mul_grads(grad, gate, up, product=True),
            eager._silu_mul_backward_and_product(grad, gate, up),
        ),
        "the rotary forward": (rotary(q, k, cos, sin), eager._rotary_forward(q, k, cos, sin)),
        "the rotary backward": (rotary(q, k, cos, sin, backward=True), eager._rotary_backward(q, k, cos, sin)),
    }
    for name, (got, want) in pairs.items():
        for a, b in zip(got, want, strict=True):
            if a.shape != b.shape or not torch.allclose(a.float(), b.float(), rtol=2**-7, atol=1e-3):
                return name
    return None
