"""The Triton kernels `triton_kernels` launches (its docstring says what each computes and why by hand).

A module of its own because Triton resolves a kernel's calls to other kernels among its module's globals, and because
whether they run interpreted (`TRITON_INTERPRET=1`) is fixed when they are decorated: `triton_kernels` imports (and
re-imports) this module when it first launches one. Importing it needs Triton."""

import triton
import triton.language as tl


@triton.jit
def silu_mul_forward(gate, up, out, cols, gate_stride, up_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = col < cols
    g = tl.load(gate + row * gate_stride + col, mask=keep, other=0.0).to(tl.float32)
    u = tl.load(up + row * up_stride + col, mask=keep, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    y = g * sig * u
    tl.store(out + row * cols + col, y.to(out.dtype.element_ty), mask=keep)


@triton.jit
def silu_mul_backward(
    grad,
    gate,
    up,
    d_gate,
    d_up,
    product,
    cols,
    grad_stride,
    gate_stride,
    up_stride,
    WITH_PRODUCT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = col < cols
    dy = tl.load(grad + row * grad_stride + col, mask=keep, other=0.0).to(tl.float32)
    g = tl.load(gate + row * gate_stride + col, mask=keep, other=0.0).to(tl.float32)
    u = tl.load(up + row * up_stride + col, mask=keep, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    out = row * cols + col
    tl.store(d_gate + out, (dy * u * sig * (1 + g * (1 - sig))).to(d_gate.dtype.element_ty), mask=keep)
    tl.store(d_up + out, (dy * g * sig).to(d_up.dtype.element_ty), mask=keep)
    if WITH_PRODUCT:
        tl.store(product + out, (g * sig * u).to(product.dtype.element_ty), mask=keep)


@triton.jit
def rotate_heads(
    x,
    out,
    c1,
    c2,
    s1,
    s2,
    batch,
    token,
    tokens,
    heads,
    x_batch,
    x_head,
    x_token,
    x_dim,
    HALF: tl.constexpr,
    HEADS: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """One token's heads of `x` (B, heads, T, D, any strides) rotated into `out` ((B, T, heads, D), contiguous)
    with that token's cos and sin halves (float32, (1, HALF_BLOCK) each); the gradient's rotation with BACKWARD."""
    head = tl.arange(0, HEADS)[:, None]
    dim = tl.arange(0, HALF_BLOCK)[None, :]
    keep = (head < heads) & (dim < HALF)
    first = x + batch * x_batch + token * x_token + head * x_head + dim * x_dim
    a = tl.load(first, mask=keep, other=0.0).to(tl.float32)
    b = tl.load(first + HALF * x_dim, mask=keep, other=0.0).to(tl.float32)
    if BACKWARD:  # d x = grad · cos + rotate_halfᵀ(grad · sin), rotate_halfᵀ(z) = (z₂, −z₁)
        lo = a * c1 + b * s2
        hi = b * c2 - a * s1
    else:  # x · cos + rotate_half(x) · sin, rotate_half(x) = (−x₂, x₁)
        lo = a * c1 - b * s1
        hi = b * c2 + a * s2
    written = out + ((batch * tokens + token) * heads + head) * (2 * HALF) + dim
    tl.store(written, lo.to(out.dtype.element_ty), mask=keep)
    tl.store(written + HALF, hi.to(out.dtype.element_ty), mask=keep)


@triton.jit(do_not_specialize=["tokens"])  # the token count: a decode step's 1 would be a variant of its own
def rotary(
    q,
    k,
    q_out,
    k_out,
    cos,
    sin,
    tokens,
    q_heads,
    k_heads,
    q_batch,
    q_head,
    q_token,
    q_dim,
    k_batch,
    k_head,
    k_token,
    k_dim,
    c_batch,
    c_token,
    c_dim,
    HALF: tl.constexpr,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    batch = pid // tokens
    token = pid % tokens
    dim = tl.arange(0, HALF_BLOCK)[None, :]
    row = batch * c_batch + token * c_token + dim * c_dim
    keep = dim < HALF
    c1 = tl.load(cos + row, mask=keep, other=0.0).to(tl.float32)
    c2 = tl.load(cos + row + HALF * c_dim, mask=keep, other=0.0).to(tl.float32)
    s1 = tl.load(sin + row, mask=keep, other=0.0).to(tl.float32)
    s2 = tl.load(sin + row + HALF * c_dim, mask=keep, other=0.0).to(tl.float32)
    rotate_heads(
        q, q_out, c1, c2, s1, s2, batch, token, tokens, q_heads, q_batch, q_head, q_token, q_dim,
        HALF, Q_HEADS, HALF_BLOCK, BACKWARD,
    )  # fmt: skip
    rotate_heads(
        k, k_out, c1, c2, s1, s2, batch, token, tokens, k_heads, k_batch, k_head, k_token, k_dim,
        HALF, K_HEADS, HALF_BLOCK, BACKWARD,
    )  # fmt: skip


@triton.jit
def bf16_block(address, offs, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointers to the bf16 values at `offs` of the slice at `address` (an integer read from a table); with ALIGNED,
    Triton is told what it cannot see in an address read at run time: that the block's values are adjacent and
    start on a 16-byte boundary, so that they load and store 8 at a time."""
    values = address.to(tl.pointer_type(tl.bfloat16)) + offs
    if ALIGNED:
        values = tl.max_contiguous(tl.multiple_of(values, [16]), [BLOCK])
    return values


@triton.jit
def kahan_adamw(
    pointers,
    numels,
    block_piece,
    block_start,
    weight1,
    beta2,
    weight2,
    step_size,
    root_correction,
    lr_decay,
    eps,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """One block of one slice: AdamW's moments and step in float32 (torch's arithmetic, operation for operation),
    the weight rounded to bf16 with Kahan's compensation. `pointers` holds each slice's (weight, gradient, exp_avg,
    exp_avg_sq, compensation) addresses, all bf16; `block_piece` and `block_start` say which slice and where in it each
    program's block lies (a block starts at a multiple of BLOCK). ALIGNED: every slice's addresses are multiples of 16
    bytes and its size a multiple of 8 values (`triton_kernels.kahan_adamw_at` checks it), so its values go 16 bytes a
    load and store (without: 2 bytes, and ~210 registers a thread instead of ~64: one block of 8 warps an SM)."""
    piece = tl.load(block_piece + tl.program_id(0))
    start = tl.multiple_of(tl.load(block_start + tl.program_id(0)), BLOCK)
    numel = tl.load(numels + piece)
    if ALIGNED:
        numel = tl.multiple_of(numel, 8)  # so a mask never splits 8 adjacent values
    offs = start + tl.arange(0, BLOCK)
    keep = offs < numel
    row = pointers + piece * 5
    weight = bf16_block(tl.load(row), offs, BLOCK, ALIGNED)
    grad = bf16_block(tl.load(row + 1), offs, BLOCK, ALIGNED)
    exp_avg = bf16_block(tl.load(row + 2), offs, BLOCK, ALIGNED)
    exp_avg_sq = bf16_block(tl.load(row + 3), offs, BLOCK, ALIGNED)
    comp = bf16_block(tl.load(row + 4), offs, BLOCK, ALIGNED)
    g = tl.load(grad, mask=keep, other=0.0).to(tl.float32)
    m = tl.load(exp_avg, mask=keep, other=0.0).to(tl.float32)
    # torch's lerp(m, g, weight1), either branch of its formula, with the multiply-add fused as its vectorised CPU
    # kernel and nvcc's build of its CUDA kernel fuse it
    if weight1 < 0.5:  # noqa: SIM108 - a runtime condition: Triton takes a ternary on constants only
        m = tl.fma(weight1, g - m, m)
    else:
        m = tl.fma(-(g - m), 1 - weight1, g)
    v = tl.load(exp_avg_sq, mask=keep, other=0.0).to(tl.float32) * beta2 + weight2 * g * g
    tl.store(exp_avg, m.to(tl.bfloat16), mask=keep)
    tl.store(exp_avg_sq, v.to(tl.bfloat16), mask=keep)
    denom = tl.div_rn(tl.sqrt_rn(v), root_correction) + eps
    w = tl.load(weight, mask=keep, other=0.0).to(tl.float32)
    update = -(tl.div_rn(m, denom) * step_size) - w * lr_decay
    update = update + tl.load(comp, mask=keep, other=0.0).to(tl.float32)
    new = (w + update).to(tl.bfloat16)
    tl.store(weight, new, mask=keep)
    tl.store(comp, (update - (new.to(tl.float32) - w)).to(tl.bfloat16), mask=keep)


@triton.jit
def weighted_gaps(e, x, high):
    """Σ e · (x − high) over a block; a column of −inf (past the vocabulary, or a masked logit) weighs 0, where its
    0 · −inf would be NaN."""
    return tl.sum(e * tl.where(x > -float("inf"), x - high, 0.0), 0)


@triton.jit
def token_scores(
    logits, labels, lse_out, token_out, second_out, stride, temperature,
    VOCAB: tl.constexpr, BLOCK: tl.constexpr, SECOND: tl.constexpr,
):  # fmt: skip
    """One position's log-sum-exp of its logits / temperature (float32, read once in blocks, the running maximum m
    rescaling the running sum Σe, e = exp(x − m)) and its label's log-prob; and its `SECOND` statistic of that
    softmax, from a second running sum rescaled with the first: 1, the entropy, H = log Σe − Σe·(x − m) / Σe;
    2, log Σ p² = log Σe² − 2 log Σe (DPO's WPO weights). The vocabulary is a constant (one compile a model): the
    loop's bound then needs no runtime value, which Triton's interpreter cannot take with NumPy 2."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    cols = tl.arange(0, BLOCK)
    x = tl.div_rn(tl.load(base + cols, mask=cols < VOCAB, other=-float("inf")).to(tl.float32), temperature)
    high = tl.max(x, 0)
    e = tl.exp(x - high)
    total = tl.sum(e, 0)
    second = 0.0
    if SECOND == 1:
        second = weighted_gaps(e, x, high)
    if SECOND == 2:
        second = tl.sum(e * e, 0)
    for start in range(BLOCK, VOCAB, BLOCK):
        at = start + cols
        x = tl.div_rn(tl.load(base + at, mask=at < VOCAB, other=-float("inf")).to(tl.float32), temperature)
        new_high = tl.maximum(high, tl.max(x, 0))
        shift = high - new_high
        scale = tl.exp(shift)
        e = tl.exp(x - new_high)
        if SECOND == 1:  # Σ e·(x − m) about the new maximum: each old term gains `shift` times its old weight
            second = scale * (second + shift * total) + weighted_gaps(e, x, new_high)
        if SECOND == 2:
            second = scale * scale * second + tl.sum(e * e, 0)
        total = total * scale + tl.sum(e, 0)
        high = new_high
    lse = high + tl.log(total)
    label = tl.load(labels + row)
    picked = tl.div_rn(tl.load(base + label).to(tl.float32), temperature)
    tl.store(lse_out + row, lse)
    tl.store(token_out + row, picked - lse)
    if SECOND == 1:
        tl.store(second_out + row, tl.log(total) - second / total)
    if SECOND == 2:
        tl.store(second_out + row, tl.log(second) - 2 * tl.log(total))


@triton.jit
def token_grads(
    logits, lse, labels, coef, spread, spread_coef, grad, vocab, stride, temperature,
    BLOCK: tl.constexpr, ENTROPY: tl.constexpr,
):  # fmt: skip
    """coef · (one-hot(label) − p) of one block of one position's logits, p = softmax(logits / temperature), written
    in the gradient's dtype; with `ENTROPY`, minus spread_coef · p · (log p + H), H the position's entropy (`spread`):
    the entropy's gradient with respect to the scaled logits, −p (log p + H), times its coefficient."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < vocab
    x = tl.div_rn(tl.load(logits + row * stride + cols, mask=keep, other=0.0).to(tl.float32), temperature)
    logp = x - tl.load(lse + row)
    p = tl.exp(logp)
    hit = (cols == tl.load(labels + row)).to(tl.float32)
    g = tl.load(coef + row) * (hit - p)
    if ENTROPY:  # a logit of −inf (p = 0) adds nothing, where its 0 · −inf would be NaN
        g -= tl.load(spread_coef + row) * p * (tl.where(p > 0, logp, 0.0) + tl.load(spread + row))
    tl.store(grad + row * vocab + cols, g.to(grad.dtype.element_ty), mask=keep)


@triton.jit
def token_kl(
    logits, ref_logits, labels, token_out, ref_token_out, kl_out, stride, ref_stride, temperature,
    VOCAB: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One position's KL(π ‖ π_ref) = Σ p (log p − log q) of the softmaxes p of logits / temperature and q of
    ref_logits / temperature, both read once in blocks, and each side's label log-prob. Each side keeps
    `token_scores`' running maximum and sum; a third running sum, Σ e·(x − y) with e = exp(x − m) of the policy's
    side, is rescaled with the policy's maximum, and KL = Σ e·(x − y) / Σ e − lse(x) + lse(y). A column where e is 0
    (past the vocabulary, a masked logit) weighs 0, where its 0 · ∞ would be NaN."""
    row = tl.program_id(0).to(tl.int64)
    base, ref_base = logits + row * stride, ref_logits + row * ref_stride
    cols = tl.arange(0, BLOCK)
    keep = cols < VOCAB
    x = tl.div_rn(tl.load(base + cols, mask=keep, other=-float("inf")).to(tl.float32), temperature)
    y = tl.div_rn(tl.load(ref_base + cols, mask=keep, other=-float("inf")).to(tl.float32), temperature)
    high, ref_high = tl.max(x, 0), tl.max(y, 0)
    e = tl.exp(x - high)
    total, ref_total = tl.sum(e, 0), tl.sum(tl.exp(y - ref_high), 0)
    cross = tl.sum(tl.where(e > 0, e * (x - y), 0.0), 0)
    for start in range(BLOCK, VOCAB, BLOCK):
        at = start + cols
        keep = at < VOCAB
        x = tl.div_rn(tl.load(base + at, mask=keep, other=-float("inf")).to(tl.float32), temperature)
        y = tl.div_rn(tl.load(ref_base + at, mask=keep, other=-float("inf")).to(tl.float32), temperature)
        new_high, new_ref_high = tl.maximum(high, tl.max(x, 0)), tl.maximum(ref_high, tl.max(y, 0))
        scale = tl.exp(high - new_high)
        e = tl.exp(x - new_high)
        cross = cross * scale + tl.sum(tl.where(e > 0, e * (x - y), 0.0), 0)
        total = total * scale + tl.sum(e, 0)
        ref_total = ref_total * tl.exp(ref_high - new_ref_high) + tl.sum(tl.exp(y - new_ref_high), 0)
        high, ref_high = new_high, new_ref_high
    lse, ref_lse = high + tl.log(total), ref_high + tl.log(ref_total)
    label = tl.load(labels + row)
    tl.store(token_out + row, tl.div_rn(tl.load(base + label).to(tl.float32), temperature) - lse)
    tl.store(ref_token_out + row, tl.div_rn(tl.load(ref_base + label).to(tl.float32), temperature) - ref_lse)
    tl.store(kl_out + row, cross / total - lse + ref_lse)
