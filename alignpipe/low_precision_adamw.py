"""`low_precision_updates`: AdamW that keeps the small updates of bf16/fp16 weights, which rounding to the nearest
value throws away.

A bf16 number has 8 significant bits: around a weight w the representable values are ~w/256 apart, and an update
smaller than half that is rounded away. Adam's update is about the learning rate per element, so with the weights
in bf16 (`model.dtype: bfloat16`, as TRL's trainers run a bf16-loaded model) and a Qwen-sized weight of 0.02, every
update under ~4e-5 is lost: at the learning rates of DPO, GRPO and PPO (1e-6 to 5e-6) most weights never move.
Measured on CPU (`tests/test_low_precision_adamw.py`): 50 steps at 1e-6 move a 0.02-scale weight matrix 2% as far
as the same steps in float32 do, and 98% of its weights not at all; at 1e-5, 17%.

Two remedies (Zamirai et al. 2020, "Revisiting BFloat16 Training"):
- `kahan` (the default): Kahan summation keeps what each rounding dropped in a buffer of the weights' dtype and
  adds it to the next update (optimi's `kahan_sum`), so weight + buffer follows the float32 trajectory to ~16
  significant bits. +2 bytes a trained parameter (1 GB for Qwen2-0.5B).
- `stochastic` (bf16 weights): each new weight rounds up or down at random, with the probabilities that make its
  expected value the float32 one (torchao's `bf16_stochastic_round`). No buffer, so no memory; the weights follow
  the float32 trajectory in expectation, with noise of about one rounding step. The random bits are a hash of the
  step, the parameter and the position, not a generator's draws: DDP's replicas, whose generators drift apart,
  must round alike. fp16 weights take `kahan`.

On CUDA the `kahan` update of contiguous bf16 weights is one hand-written Triton launch a step for all of them
(`triton_kernels.kahan_adamw`, since session 45; ~18 bytes of traffic a value against torch's fused kernel's ~14), a
launch a parameter group; from a group's second step on it launches from the addresses kept at the first
(`_HandPlan`: ~1.8 ms of host time a step for Qwen2-0.5B's 290 tensors on a CPU where walking their slices took ~10).
Elsewhere there (`stochastic`, a strided parameter, Triton failing its probe, `fused_kernels.ELEMENTWISE =
"compiled"`) it is compiled: one kernel a slice of at most 16M values, up to `MAX_PIECES` slices a call. A call
costs ~0.1-0.3 ms of host time whatever it holds, so one a parameter, 290 for Qwen2-0.5B, took 54 ms a step on an
H200 against torch's fused 3.4 ms (session 42's lease). The eager form, on CPU and for fp16 weights, makes ~25
passes; on a CPU it takes a slice in cache-sized parts (`EAGER_CPU_PART`): Qwen2-0.5B's step on CI's 2-core Xeon
went from 5.8-7.7 s to 2.1 s (its first, which also fills the states, from 13.4 to 5.0 s). The moments stay in the weights' dtype, as torch's AdamW keeps them; the arithmetic is float32, as in its
fused kernel. Float32 parameters (LoRA adapters, which peft keeps in float32) take torch's fused AdamW unchanged.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
from torch.fx.experimental import _config as shape_config

from alignpipe import fused_kernels, triton_kernels
from alignpipe.compiled import chunk_bounds

log = logging.getLogger(__name__)

LOW_PRECISION = (torch.bfloat16, torch.float16)

STATES = ("exp_avg", "exp_avg_sq", "kahan_comp")
"""A parameter's states beside its step count: torch's moments, then Kahan's compensation (not under `stochastic`)."""

CHUNK = 1 << 24
"""Values per slice of the element-wise passes: the float32 temporaries of a step stay under ~0.5 GB however large
a parameter (an embedding) is."""

EAGER_CPU_PART = 1 << 18
"""Values per call of the eager step on a CPU: its ~25 element-wise passes then go over float32 temporaries of 1 MB,
which stay in the cache, rather than over a `CHUNK` slice's 64 MB in memory. On CI's 2-core Xeon (4 MiB of L2) a
64M-value bf16 tensor's Kahan step took 16.5 ns a value in 16M-value slices and 4.1 in these (5.2 at 1M values, 4.9
at 64K, where the calls' host time starts to weigh). A multiple of 64 values, so that a part adds no values to those
torch's element-wise kernels run outside their vector code (`tests/test_low_precision_adamw.py` checks the values
are the slice's stepped whole)."""

MAX_PIECES = 8
"""Slices a compiled call updates (fewer where that many would pass `CHUNK` values). A call's host time is nearly all
dynamo's and AOT's wrappers, so 8 slices a call cost ~1/8 of one call each; the graphs compiled are one per length,
and the lengths are powers of two (8, 4, 2, 1): at most four graphs of each kind (Kahan, stochastic) a process. A
graph of 8 slices takes ~25 s in inductor's C++ on CPU, which runs it only in tests; on a GPU its compile time is
not yet measured (each run of the bench reports its graphs and their seconds)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this process (FSDP2); other tensors as they are. Every pass here is element-wise, and a
    parameter's gradient and states are sharded alike."""
    return t.to_local() if hasattr(t, "to_local") else t


def _flat(t: torch.Tensor) -> torch.Tensor:
    """`t` as a 1-D tensor that is itself no view (`detach` drops the link to a parameter or gradient): a compiled
    step guards on its inputs' bases, so a matrix's rows and a vector would otherwise be graphs of their own."""
    return t.detach().reshape(-1).detach()


class LowPrecisionAdamW(torch.optim.AdamW):
    """torch's AdamW for float32 parameters; for bf16/fp16 ones, the same update computed in float32 and added with
    Kahan compensation (state `kahan_comp`, beside torch's `exp_avg` and `exp_avg_sq`) or, for bf16 under
    `updates="stochastic"`, rounded stochastically. With `fused_kernels` (a stage's setting) on a CUDA device, the
    `kahan` update is one hand-written launch a step (`_update_by_hand`) and the rest is compiled: one kernel a
    slice, `MAX_PIECES` slices a call."""

    def __init__(self, params, *args, updates: str = "kahan", fused_kernels: bool = False, **kwargs):
        if updates not in ("kahan", "stochastic"):
            raise ValueError(f"updates must be 'kahan' or 'stochastic', not {updates!r}")
        super().__init__(params, *args, **kwargs)
        self.updates = updates
        self.fused_kernels = fused_kernels
        # each parameter's slices of its weight and states, kept from step to step (making them anew was most of a
        # step's host time): what they were taken of (`_identity`), their bounds and the slices (None where a tensor
        # has no flat view)
        self._views: dict[torch.Tensor, tuple] = {}
        self._blocks: dict[int, triton_kernels.AdamWBlocks] = {}  # the hand-written step's table of blocks a group
        self._plans: dict[int, _HandPlan] = {}  # a group's whole step by hand, kept while it holds (`_HandPlan`)

    def load_state_dict(self, state_dict) -> None:
        self._views.clear()  # the slices of the states replaced, which would stay alive otherwise
        self._plans.clear()
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("LowPrecisionAdamW.step takes no closure")
        low: list[list[torch.Tensor]] = []  # each group's bf16/fp16 parameters with a gradient
        rest = False  # whether any float32 one has a gradient: torch's step, which skips those without
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            low.append([p for p in with_grad if p.dtype in LOW_PRECISION])
            rest = rest or len(low[-1]) < len(with_grad)
        if rest:
            held = [(p, p.grad) for params in low for p in params]
            for p, _ in held:
                p.grad = None
            try:
                super().step()
            finally:
                for p, grad in held:
                    p.grad = grad
        for group_index, (group, params) in enumerate(zip(self.param_groups, low)):
            if params:
                self._low_precision_step(group_index, group, params)
        return None

    def _low_precision_step(self, group_index: int, group: dict, params: list[torch.Tensor]) -> None:
        plan = self._plans.pop(group_index, None)
        by_hand = self.fused_kernels and fused_kernels.ELEMENTWISE == "triton"
        if plan is not None and by_hand and plan.step(params, self.state, group, self._blocks[group_index]):
            self._plans[group_index] = plan
            return
        compiles = self.fused_kernels and fused_kernels.wanted(True, params[0].device)
        pending: dict[tuple[bool, int], list] = {}  # (stochastic, step) → [(slice, salt)] for the compiled calls
        scalars = functools.cache(functools.partial(_scalars, group))  # one step count for nearly all parameters
        eager = False  # whether a slice took the eager step
        states = [self.state[p] for p in params]
        for state in states:
            if not state:
                state["step"] = torch.tensor(0.0)
            elif state["step"].device.type != "cpu":  # torch's load_state_dict moves it for fused steps
                state["step"] = state["step"].cpu()
        torch._foreach_add_([state["step"] for state in states], 1)  # host tensors, one call: no device read
        for position, (p, state) in enumerate(zip(params, states)):
            stochastic = rounds_stochastically(self.updates, p.dtype)
            names = STATES[:2] if stochastic else STATES
            for name in names:  # all at the first step; the buffer too where a run resumes under `kahan`
                if name not in state:
                    state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
            step = int(state["step"])
            for index, piece in enumerate(self._slices(p, state, names)):
                # the rounding's random bits: a hash of where and when, the same on every process of a DDP stage,
                # whose replicas must round alike (the global generator's state differs between ranks)
                salt = _mix(step, group_index, position, index) if stochastic else None
                # fp16 weights take the eager step: their rounding is a cast, which a compiled kernel may skip
                if compiles and p.dtype == torch.bfloat16:
                    pending.setdefault((stochastic, step), []).append((piece, salt))
                else:
                    eager = True
                    _update(piece, scalars(step), salt)
        for (stochastic, step), batch in pending.items():  # one step count for nearly all: one entry
            if not stochastic:
                batch = self._update_by_hand(group_index, batch, scalars(step))
                if not batch and not eager and len(pending) == 1:
                    # every slice of the group went into the one launch: the next steps may go as this one did
                    self._plans[group_index] = _HandPlan(params, states, [self._views[p] for p in params], step)
            for bucket in _buckets(batch):
                self._update_compiled(bucket, scalars(step), stochastic)

    def _update_by_hand(self, group_index: int, batch: list, scalars: tuple[float, ...]) -> list:
        """Kahan's update of `batch`'s flat bf16 slices in one launch of the hand-written kernel, where
        `fused_kernels.ELEMENTWISE` asks for it and Triton runs it (`triton_kernels.adamw_usable`); the items left
        for the compiled step (a strided parameter's whole tensors; all of them otherwise)."""
        if not self.fused_kernels or fused_kernels.ELEMENTWISE != "triton":
            return batch
        taken = [triton_kernels.kahan_adamw_takes([piece]) for piece, _ in batch]
        pieces = [piece for (piece, _), take in zip(batch, taken, strict=True) if take]
        if not pieces or not triton_kernels.adamw_usable(pieces[0][0].device):
            return batch
        blocks = self._blocks.setdefault(group_index, triton_kernels.AdamWBlocks())
        triton_kernels.kahan_adamw(pieces, scalars, blocks)
        return [item for item, take in zip(batch, taken, strict=True) if not take]

    def _slices(self, p: torch.Tensor, state: dict, names: tuple[str, ...]) -> list[tuple[torch.Tensor, ...]]:
        """(weight, gradient, *states) of `p` in flat slices of at most `CHUNK` values (no one-value slice, which
        would compile again), or whole where the weight or a state is not contiguous, so has no flat view. The
        weight's and states' slices are kept while they are the same tensors (`_same`)."""
        kept = [_local(t) for t in (p, *(state[name] for name in names))]
        assert p.grad is not None  # `step` hands over only parameters with a gradient
        grad = _local(p.grad)
        cached = self._views.get(p)
        if cached is None or not _same(cached[0], kept):
            if all(t.is_contiguous() for t in kept):
                flat = [_flat(t) for t in kept]
                bounds = chunk_bounds(flat[0].numel(), CHUNK)
                cached = (_identity(kept), bounds, [tuple(f[start:stop] for f in flat) for start, stop in bounds])
            else:
                cached = (_identity(kept), None, None)
            self._views[p] = cached
        _, bounds, slices = cached
        if bounds is None:
            return [(kept[0].detach(), grad.detach(), *(t.detach() for t in kept[1:]))]
        g = _flat(grad)
        return [(w, g[start:stop], *rest) for (start, stop), (w, *rest) in zip(bounds, slices)]

    def _update_compiled(self, bucket: list, scalars: tuple[float, ...], stochastic: bool) -> None:
        """One compiled call over `bucket`'s slices, eagerly from the first bucket the compiler fails on (said once;
        compilation fails before the kernels write anything)."""
        pieces, salts = [piece for piece, _ in bucket], [salt for _, salt in bucket]
        if self.fused_kernels:
            try:
                # one symbol a slice's length (no duck sizing): slices of equal length in one call and of unequal
                # ones in the next would otherwise be two graphs
                with shape_config.patch(use_duck_shape=False):  # type: ignore[attr-defined]
                    _compiled(stochastic)(pieces, scalars, salts if stochastic else None)
                return
            except (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.InductorError) as err:
                log.warning("low_precision_updates: the compiled step failed (%s); the eager step runs instead", err)
                self.fused_kernels = False
        for piece, salt in bucket:
            _update(piece, scalars, salt)


class _HandPlan:
    """A group's Kahan step as one launch by hand, kept from a step in which the group's every slice went into it:
    the next steps launch from the addresses kept, without walking the parameters' slices (~25 µs of host time a
    parameter on this project's CI machines, 290 parameters for Qwen2-0.5B). It holds while the group steps the same
    parameters (those with a gradient), each weight at the same storage with the same states, every gradient bf16 and
    contiguous, and all at one step count; otherwise the step goes the long way and keeps a plan anew."""

    def __init__(self, params: list[torch.Tensor], states: list[dict], views: list[tuple], step: int):
        self.params = params
        self.states = [(state, *(state[name] for name in STATES)) for state in states]
        self.steps = [state["step"] for state in states]
        self.count = step
        self.views = views  # the kept slices: they hold the storages whose addresses the plan launches with
        self.weights = [_local(p).data_ptr() for p in params]
        self.numels = [_local(p).numel() for p in params]
        self.device = params[0].device
        # a row a slice: its parameter, its offset in bytes (the gradient's is the weight's), and the addresses of the
        # slices of weight and states
        self.rows: list[tuple[int, ...]] = []
        sizes = []
        for index, (_, bounds, slices) in enumerate(views):
            for (start, stop), (w, *rest) in zip(bounds, slices, strict=True):
                self.rows.append((index, start * w.element_size(), w.data_ptr(), *(t.data_ptr() for t in rest)))
                sizes.append(stop - start)
        self.sizes = tuple(sizes)

    def holds(self, params: list[torch.Tensor], state: dict) -> bool:
        """Whether `params` are the plan's, at their storages, with the same states: `_same`'s test written out for
        the plan's parameters (a list built a parameter for `_same` doubled the planned step's host time)."""
        if len(params) != len(self.params) or any(a is not b for a, b in zip(params, self.params, strict=True)):
            return False
        for p, pointer, (kept, *tensors) in zip(params, self.weights, self.states, strict=True):
            now = state.get(p)
            if (
                _local(p).data_ptr() != pointer
                or now is not kept
                or any(now.get(name) is not t for name, t in zip(STATES, tensors, strict=True))
            ):
                return False
        return True

    def step(self, params: list[torch.Tensor], state: dict, group: dict, blocks: triton_kernels.AdamWBlocks) -> bool:
        """The group's step from the plan, if it holds (`holds`, and every gradient as the kernel takes it); False,
        with nothing done, otherwise."""
        if not self.holds(params, state):
            return False
        grads = [_local(p.grad) for p in params if p.grad is not None]  # `LowPrecisionAdamW.step` hands over those
        if len(grads) < len(params) or not all(
            g.dtype == torch.bfloat16 and g.is_contiguous() and g.numel() == n
            for g, n in zip(grads, self.numels, strict=True)
        ):
            return False
        pointers = [g.data_ptr() for g in grads]
        torch._foreach_add_(self.steps, 1)
        self.count += 1
        rows = [(w, pointers[index] + offset, *rest) for index, offset, w, *rest in self.rows]
        triton_kernels.kahan_adamw_at(rows, self.sizes, self.device, _scalars(group, self.count), blocks)
        return True


def _identity(kept: list[torch.Tensor]) -> tuple:
    """What says that a parameter's weight and states are still the tensors whose slices were kept: the weight's
    storage pointer, shape and dtype (a parameter is one object whatever `.data` it is given; no other storage can
    take a pointer the kept slices hold alive), and the states themselves (compared as objects: `is`)."""
    weight = kept[0]
    return (weight.data_ptr(), weight.shape, weight.dtype), kept[1:]


def _same(identity: tuple, kept: list[torch.Tensor]) -> bool:
    """Whether `kept` are the tensors `identity` was taken of (`_identity`)."""
    (pointer, shape, dtype), states = identity
    weight = kept[0]
    return (
        weight.data_ptr() == pointer
        and weight.shape == shape
        and weight.dtype == dtype
        and len(states) == len(kept) - 1
        and all(a is b for a, b in zip(states, kept[1:]))
    )


def _scalars(group: dict, step: int) -> tuple[float, ...]:
    """A group's step terms after `step` steps: β₁, β₂, the step size lr / (1 − β₁ᵗ), √(1 − β₂ᵗ), lr × decay, ε."""
    beta1, beta2 = (float(b) for b in group["betas"])
    lr, eps, decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
    return beta1, beta2, lr / (1 - beta1**step), math.sqrt(1 - beta2**step), lr * decay, eps


def _update(piece: tuple[torch.Tensor, ...], scalars: tuple[float, ...], salt: int | None) -> None:
    """One slice's eager update, rounded stochastically where it has a `salt`; on a CPU in parts of
    `EAGER_CPU_PART` values (the same values: every pass is element-wise, and each part's random bits are those of
    its positions in the slice)."""
    weight = piece[0]
    part = EAGER_CPU_PART if weight.device.type == "cpu" and weight.dim() == 1 else weight.numel()
    for start in range(0, weight.numel(), max(part, 1)):
        parts = piece if part >= weight.numel() else tuple(t[start : start + part] for t in piece)
        if salt is None:
            kahan_update(*parts, *scalars)
        else:
            stochastic_update(*parts, *scalars, salt, offset=start)


def _buckets(batch: list) -> list[list]:
    """`batch` (slices with their salts) in calls of `MAX_PIECES` or a smaller power of two, each of at most `CHUNK`
    values where its slices allow; a whole tensor (no flat view: a strided parameter) alone, since its shape is a
    graph's."""
    buckets: list[list] = []
    run: list = []
    values = 0

    def close():
        while run:  # the lengths 8, 4, 2, 1 only: one graph each
            size = 1 << (len(run).bit_length() - 1)
            buckets.append(run[:size])
            del run[:size]

    for item in batch:
        piece = item[0]
        if piece[0].dim() != 1:
            buckets.append([item])
            continue
        if run and (len(run) == MAX_PIECES or values + piece[0].numel() > CHUNK):
            close()
            values = 0
        run.append(item)
        values += piece[0].numel()
    close()
    return buckets


def _adamw_step(weight, grad, exp_avg, exp_avg_sq, beta1, beta2, step_size, root_correction, lr_decay, eps):
    """The moments (written back) and the step in float32, torch's fused AdamW's arithmetic: (weight, step), both
    float32."""
    g = grad.float()
    m = exp_avg.float().lerp_(g, 1 - beta1)
    v = exp_avg_sq.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    denom = v.sqrt_().div_(root_correction).add_(eps)
    w = weight.float()
    # the decay as a product, not `alpha=` or a branch, which would make a compiled step specialise on its value;
    # `neg_()` after the product, not `mul_(-step_size)`: torch 2.11's dynamo guards on a negated float input's value,
    # which recompiled the step for every learning rate (the same bits: negation is exact)
    return w, m.div_(denom).mul_(step_size).neg_().sub_(w * lr_decay)


def kahan_update(weight, grad, exp_avg, exp_avg_sq, comp, *scalars) -> None:
    """weight ← round(weight + step + comp), comp ← what that rounding dropped."""
    w, update = _adamw_step(weight, grad, exp_avg, exp_avg_sq, *scalars)
    update.add_(comp.float())
    new = round_to_bf16(w + update) if weight.dtype == torch.bfloat16 else (w + update).to(weight.dtype).float()
    weight.copy_(new)
    comp.copy_(update.sub_(new.sub_(w)))


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 → the nearest bf16 value (ties to even), as float32: `x.to(torch.bfloat16)`'s value, worked out on the
    bits. Kahan's compensation is taken from the rounded value, and a compiled kernel may read the float32 sum in
    place of a cast or of the bf16 weight it just wrote: inductor does by default, and torch 2.11's also under
    `emulate_precision_casts` (the buffer then holds ~nothing: off by up to 3e-3 on unit-scale weights, about half a
    rounding step, and the weights drift from the eager step's). Integer arithmetic cannot be skipped. NaN stays
    NaN."""
    bits = x.view(torch.int32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))).bitwise_and_(-(1 << 16)).view(torch.float32)
    return torch.where(x.isnan(), x, rounded)


def stochastic_update(weight, grad, exp_avg, exp_avg_sq, *scalars, offset: int = 0) -> None:
    """weight (bf16) ← weight + step, rounded up or down at random in proportion to its distance from each (the last
    scalar: the salt of the random bits; `offset`: where `weight` starts in the slice the salt is for)."""
    w, update = _adamw_step(weight, grad, exp_avg, exp_avg_sq, *scalars[:-1])
    weight.copy_(round_stochastically(w.add_(update), scalars[-1], offset))


def round_stochastically(x: torch.Tensor, salt: int, offset: int = 0) -> torch.Tensor:
    """float32 → bf16, rounding away from zero with probability (the 16 bits bf16 drops) / 2^16: a float's bits are
    sign and magnitude, so adding uniform noise below the kept bits and truncating is unbiased for either sign. The
    noise is a hash of each value's position (counted from `offset`) and `salt` (so the same on every process), not a
    generator's draw."""
    bits = x.view(torch.int32)
    position = torch.arange(offset, offset + bits.numel(), device=x.device, dtype=torch.int64).view(bits.shape)
    noise = (_lowbias32(position ^ salt) >> 16).to(torch.int32)
    return (bits + noise).bitwise_and_(-(1 << 16)).view(torch.float32).to(torch.bfloat16)


_MASK32 = 0xFFFFFFFF


def _lowbias32(h):
    """Wellons' lowbias32 integer hash of each value's low 32 bits (tensors of int64, or an int): every output bit
    depends on every input bit."""
    h = h & _MASK32
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _MASK32
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & _MASK32
    return h ^ (h >> 16)


def _mix(*parts: int) -> int:
    """One 32-bit salt from a few small integers (step, group, parameter, slice)."""
    h = 0
    for part in parts:
        h = _lowbias32(h ^ (part & _MASK32) ^ 0x9E3779B9)
    return h


def _kahan_many(pieces: list, scalars: tuple[float, ...], salts: None) -> None:
    """`kahan_update` of each of `pieces` (a slice of a weight, its gradient and states)."""
    for piece in pieces:
        kahan_update(*piece, *scalars)


def _stochastic_many(pieces: list, scalars: tuple[float, ...], salts: list[int]) -> None:
    """`stochastic_update` of each of `pieces`, with its salt."""
    for piece, salt in zip(pieces, salts):
        stochastic_update(*piece, *scalars, salt)


@functools.cache
def _compiled(stochastic: bool):
    """`_kahan_many` or `_stochastic_many` compiled, a graph a process for each number of slices (two functions, not
    one with a flag: dynamo's limit of 8 graphs is a function's): dynamic sizes, and the learning rate's terms as
    inputs, not constants (no graph per step). Every rounding whose result the step reads again is done on the bits
    (`round_to_bf16`, `round_stochastically`), so the compiled step equals the eager one whatever inductor does with
    casts; `emulate_precision_casts` also keeps Triton from contracting a product and a sum into one fused
    multiply-add, which rounds once where the eager step rounds twice (on an H200 the compiled step's weights
    differed from the eager step's by a rounding step here and there without it, session 42)."""
    many = _stochastic_many if stochastic else _kahan_many
    return torch.compile(many, dynamic=True, options={"emulate_precision_casts": True})


def rounds_stochastically(updates: str, dtype: torch.dtype) -> bool:
    """Whether `low_precision_updates: updates` rounds weights of `dtype` stochastically (bf16 only; fp16 weights
    keep Kahan's buffer)."""
    return updates == "stochastic" and dtype == torch.bfloat16


def low_precision_params(params) -> list[torch.Tensor]:
    """The bf16/fp16 parameters among `params` (those `LowPrecisionAdamW` steps itself)."""
    return [p for p in params if p.dtype in LOW_PRECISION]
