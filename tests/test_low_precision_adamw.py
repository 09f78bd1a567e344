"""`low_precision_updates`: AdamW on bf16 weights keeps the updates bf16 rounding drops (Kahan compensation, or
unbiased stochastic rounding), equals torch's AdamW where rounding does not matter, and resumes from its state."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from support import tiny_split

from alignpipe import low_precision_adamw
from alignpipe.low_precision_adamw import LowPrecisionAdamW
from alignpipe.modeling import load_causal_lm
from alignpipe.tracking import Tracker
from alignpipe.trainers import sft
from alignpipe.trainers.common import build_optimizer
from alignpipe.trainers.configs import SFTConfig


def _run(weight: torch.Tensor, dtype, optimizer, lr: float, steps: int, **kwargs):
    """`steps` AdamW steps on one (128, 128) weight from a drifting gradient: (the parameter, its optimizer)."""
    p = torch.nn.Parameter(weight.to(dtype, copy=True))
    opt = optimizer([p], lr=lr, weight_decay=0.0, fused=True, **kwargs)
    gen = torch.Generator().manual_seed(1)
    drift = torch.randn(weight.shape, generator=gen)
    for _ in range(steps):
        p.grad = (drift + 0.1 * torch.randn(weight.shape, generator=gen)).to(dtype)
        opt.step()
    return p, opt


@pytest.mark.parametrize("lr", [1e-6, 1e-5])
def test_small_updates_accumulate_in_bf16_as_in_float32(lr):
    """At RL learning rates torch's AdamW on bf16 weights drops most of the float32 trajectory. With Kahan
    compensation weight + buffer follows it to ~2%, and the weights themselves to within a rounding step each;
    stochastic rounding follows it in expectation, each weight within a rounding step or so of it."""
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    steps = 400
    ref, _ = _run(w, torch.float32, torch.optim.AdamW, lr, steps)
    rounded, _ = _run(w, torch.bfloat16, torch.optim.AdamW, lr, steps)
    ours, opt = _run(w, torch.bfloat16, LowPrecisionAdamW, lr, steps)
    stochastic, _ = _run(w, torch.bfloat16, LowPrecisionAdamW, lr, steps, updates="stochastic")
    start = w.bfloat16().float()
    moved = ref.detach() - w
    carried = ours.detach().float() + opt.state[ours]["kahan_comp"].float() - start

    def gap(x):
        return ((x - moved).norm() / moved.norm()).item()

    def along(x):  # how far x went in float32's direction, as a share of float32's distance
        return ((x * moved.sign()).mean() / moved.abs().mean()).item()

    assert gap(rounded.detach().float() - start) > (0.9 if lr == 1e-6 else 0.5)
    assert along(rounded.detach().float() - start) < 0.2
    assert gap(carried) < 0.03
    assert gap(ours.detach().float() - start) < 0.2  # what the buffer holds is under one rounding step a weight
    stochastic_moved = stochastic.detach().float() - start
    assert 0.97 < along(stochastic_moved) < 1.03 and gap(stochastic_moved) < (0.6 if lr == 1e-6 else 0.2)


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    """Each value rounds to one of the two bf16 values around it, on average to itself, for either sign."""
    x = torch.tensor([1.0 + 2**-9, -(1.0 + 2**-9), 0.02 + 1e-5, 3.0 + 0.75 * 2**-6, 0.5])
    rounded = low_precision_adamw.round_stochastically(x.repeat(100_000, 1), salt=12345).float()
    nearest = x.bfloat16()
    for i in range(len(x)):
        seen = set(rounded[:, i].unique().tolist())
        toward_x = torch.tensor(float("-inf") if nearest[i].float() > x[i] else float("inf"), dtype=torch.bfloat16)
        neighbours = {nearest[i].item(), torch.nextafter(nearest[i], toward_x).item()}
        assert seen <= neighbours, (i, seen, neighbours)
    spacing = torch.finfo(torch.bfloat16).eps * x.abs()
    assert ((rounded.mean(0) - x).abs() < 0.01 * spacing).all()
    assert torch.equal(rounded[:, 4], torch.full((100_000,), 0.5))  # exact values stay


def test_rounding_on_the_bits_equals_the_cast_to_bf16_everywhere():
    """`round_to_bf16` (what Kahan's step rounds with, so that no compiler can skip the rounding) is the cast's value
    for every kind of float32: ties to even both ways, subnormals, the largest finite values (rounding to ±inf),
    zeros of both signs, infinities and NaN."""
    gen = torch.Generator().manual_seed(0)
    scales = torch.logspace(-44, 38, 200_000, dtype=torch.float64).float()
    random = torch.randn(200_000, generator=gen) * scales
    one = torch.tensor(1.0).view(torch.int32)
    ties = (one + torch.tensor([0x8000, 0x18000, 0x7FFF, 0x8001], dtype=torch.int32)).view(torch.float32)
    special = torch.tensor([0.0, -0.0, 3.3895314e38, -3.3895314e38, 3.4e38, 1e-40, -1e-40, float("inf"), float("-inf")])
    x = torch.cat([random, -random, ties, -ties, special])
    assert torch.equal(low_precision_adamw.round_to_bf16(x), x.bfloat16().float())
    assert torch.equal(low_precision_adamw.round_to_bf16(x).view(torch.int32)[-9:-7], torch.tensor([0, -(1 << 31)]))
    # NaNs whose payload is in the low bits only, positive and negative (0xFF800001), and a quiet one
    nans = torch.tensor([0x7F800001, 0xFF800001 - (1 << 32), 0x7FC00000], dtype=torch.int32).view(torch.float32)
    assert low_precision_adamw.round_to_bf16(nans).isnan().all()


def test_stochastic_steps_are_the_same_on_every_process_whatever_its_generator_state():
    """The rounding's random bits hash the step, the parameter and the position, so DDP's replicas, whose global
    generators differ (dropout, sampling), round alike and stay equal; other steps draw other bits."""
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    runs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        runs.append(_run(w, torch.bfloat16, LowPrecisionAdamW, 1e-5, 20, updates="stochastic")[0])
    assert torch.equal(runs[0], runs[1])
    x = torch.full((4096,), 1.0 + 2**-9)  # a quarter of the way from 1 to the next bf16 value, 1 + 2**-7
    first, second = (low_precision_adamw.round_stochastically(x, salt) for salt in (1, 2))
    assert not torch.equal(first, second)
    assert all(0.22 < (r > 1).float().mean().item() < 0.28 for r in (first, second))


def test_one_step_equals_torch_adamw_in_bf16_and_float32_parameters_are_torch_s():
    """From a zero buffer, a step rounds to torch's fused AdamW's bf16 result (within one rounding step); the moments
    equal torch's bit for bit over several steps, and float32 parameters in the same optimizer take torch's steps
    exactly."""
    gen = torch.Generator().manual_seed(0)
    low = torch.randn(64, 96, generator=gen)
    full = torch.randn(96, generator=gen)
    grads = [torch.randn(64, 96, generator=gen), torch.randn(96, generator=gen)]

    def run(optimizer, steps):
        params = [torch.nn.Parameter(low.bfloat16()), torch.nn.Parameter(full.clone())]
        groups = [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]
        opt = optimizer(groups, lr=1e-2, betas=(0.9, 0.95), fused=True)
        for _ in range(steps):
            for p, g in zip(params, grads):
                p.grad = g.to(p.dtype)
            opt.step()
        return params, opt

    (ours_low, ours_full), ours = run(LowPrecisionAdamW, 3)
    (ref_low, ref_full), ref = run(torch.optim.AdamW, 3)
    assert torch.equal(ours_full, ref_full)
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(ours.state[ours_low][name], ref.state[ref_low][name])
    assert "kahan_comp" in ours.state[ours_low] and "kahan_comp" not in ours.state[ours_full]
    (ours_low, _), _ = run(LowPrecisionAdamW, 1)
    (ref_low, _), _ = run(torch.optim.AdamW, 1)
    ulp = torch.finfo(torch.bfloat16).eps * ref_low.detach().float().abs()
    assert ((ours_low.detach().float() - ref_low.detach().float()).abs() <= ulp).all()


def test_slices_strided_parameters_and_a_resumed_state_give_the_same_steps(monkeypatch):
    """The step slices large parameters (here 1,000 values a slice) with the same result as whole, updates a
    non-contiguous parameter in place, and continues from a saved state_dict as if never stopped."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(50, 70, generator=gen), torch.randn(70, 50, generator=gen).t()]
    grads = [torch.randn(50, 70, generator=gen) for _ in range(6)]

    def fresh():
        params = [torch.nn.Parameter(w.bfloat16()) for w in weights]
        params[1] = torch.nn.Parameter(weights[1].t().bfloat16().t())  # strided, as the transpose of a weight
        return params, LowPrecisionAdamW(params, lr=1e-3, weight_decay=0.01)

    def steps(params, opt, which):
        for i in which:
            for p in params:
                p.grad = grads[i].bfloat16()
            opt.step()

    whole_params, whole = fresh()
    steps(whole_params, whole, range(6))
    monkeypatch.setattr(low_precision_adamw, "CHUNK", 1000)
    sliced_params, sliced = fresh()
    assert not sliced_params[1].is_contiguous()
    steps(sliced_params, sliced, range(3))
    saved = sliced.state_dict()
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in sliced_params]
    resumed = LowPrecisionAdamW(resumed_params, lr=1e-3, weight_decay=0.01)
    resumed.load_state_dict(saved)
    steps(resumed_params, resumed, range(3, 6))
    for a, b in zip(whole_params, resumed_params):
        assert torch.equal(a, b)
    assert torch.equal(whole.state[whole_params[0]]["kahan_comp"], resumed.state[resumed_params[0]]["kahan_comp"])


@pytest.mark.parametrize(
    ("updates", "dtype"), [("kahan", torch.bfloat16), ("stochastic", torch.bfloat16), ("kahan", torch.float16)]
)
def test_the_eager_step_in_cache_sized_parts_gives_the_values_of_the_whole_slice(monkeypatch, updates, dtype):
    """On a CPU the eager step goes over each slice in parts (`EAGER_CPU_PART` values; here 1,024, so the last part
    is short): weights and states equal, to the bit, those of the slice stepped whole, stochastic rounding's random
    bits included (each part hashes its positions in the slice, not from 0). A strided parameter is stepped whole.
    The parts are a multiple of 64 values, as `EAGER_CPU_PART` is, so that they run the same values through torch's
    vector code as the whole slice does (its last n mod 64 values take the scalar code either way): the two codes
    may round a multiply-add differently."""
    gen = torch.Generator().manual_seed(3)
    weights = [
        torch.randn(10_000, generator=gen) * 0.02,
        torch.randn(50, 70, generator=gen),
        torch.randn(40, 30, generator=gen),
    ]
    grads = [[torch.randn(w.shape, generator=gen) * 1e-3 for w in weights] for _ in range(4)]

    def run(part: int):
        monkeypatch.setattr(low_precision_adamw, "EAGER_CPU_PART", part)
        params = [torch.nn.Parameter(w.to(dtype)) for w in weights[:2]]
        params.append(torch.nn.Parameter(weights[2].t().to(dtype).t()))  # strided: no flat view
        opt = LowPrecisionAdamW(params, lr=1e-4, weight_decay=0.01, updates=updates)
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.to(dtype)
            opt.step()
        return params, opt

    whole_params, whole = run(1 << 30)
    part_params, parted = run(1024)
    for a, b in zip(whole_params, part_params, strict=True):
        assert not torch.equal(a, a.new_zeros(a.shape))
        assert torch.equal(a, b)
        for name in ("exp_avg", "exp_avg_sq", "kahan_comp"):
            if name in whole.state[a]:
                assert torch.equal(whole.state[a][name], parted.state[b][name]), name
    assert ("kahan_comp" in parted.state[part_params[0]]) == (updates == "kahan")


def test_the_stage_picks_it_for_bf16_weights_only_and_fp16_ones_keep_a_buffer(tiny):
    """bf16 weights get `LowPrecisionAdamW` unless `low_precision_updates: nearest`; a float32 model keeps torch's
    AdamW. Under `stochastic`, fp16 weights (whose rounding this does not implement) take Kahan's buffer."""
    bf16 = load_causal_lm(str(tiny / "model"), dtype="bfloat16")
    assert type(build_optimizer(bf16, SFTConfig())) is LowPrecisionAdamW
    stochastic = build_optimizer(bf16, SFTConfig(low_precision_updates="stochastic"))
    assert isinstance(stochastic, LowPrecisionAdamW) and stochastic.updates == "stochastic"
    assert type(build_optimizer(bf16, SFTConfig(low_precision_updates="nearest"))) is torch.optim.AdamW
    assert type(build_optimizer(load_causal_lm(str(tiny / "model")), SFTConfig())) is torch.optim.AdamW
    half = torch.nn.Parameter(torch.randn(64, 64).half())
    opt = LowPrecisionAdamW([half], lr=1e-3, updates="stochastic")
    half.grad = torch.randn(64, 64).half()
    opt.step()
    assert "kahan_comp" in opt.state[half]


def test_bf16_sft_at_a_small_learning_rate_learns_with_it_and_barely_without(tiny, tmp_path):
    """SFT of the bf16 tiny model at 3e-5: the loss falls further with Kahan-compensated or stochastically rounded
    updates than with rounded ones, which leave most of the decoder's weights where they started."""
    tok, train, _ = tiny_split(tiny, "sentiment_sft", "prompt_completion", rows=96, max_length=48)
    falls, unchanged = {}, {}
    torch.manual_seed(0)
    for mode in ("kahan", "stochastic", "nearest"):
        model = load_causal_lm(str(tiny / "model"), dtype="bfloat16")
        start = model.model.layers[0].mlp.up_proj.weight.detach().clone()
        tracker = Tracker()
        cfg = SFTConfig(learning_rate=3e-5, max_steps=12, batch_size=8, logging_every=3, lr_scheduler="constant",
                        low_precision_updates=mode)  # fmt: skip
        sft.train(cfg, model, tok, train, [], tracker, tmp_path / mode)
        losses = tracker.series("train/loss")
        falls[mode] = losses[0] - losses[-1]
        unchanged[mode] = (model.model.layers[0].mlp.up_proj.weight == start).float().mean().item()
    assert min(falls["kahan"], falls["stochastic"]) > 1.5 * falls["nearest"] and falls["kahan"] > 0, falls
    assert unchanged["nearest"] > 0.5 > max(unchanged["kahan"], unchanged["stochastic"]), unchanged


@pytest.mark.parametrize("updates", ["kahan", "stochastic"])
def test_the_compiled_update_is_one_graph_a_call_length_for_every_size_and_learning_rate_and_keeps_the_rounding(
    monkeypatch, updates
):
    """With `fused_kernels` on (the gate opened on CPU) the slices are updated `MAX_PIECES` to a call (4 here: two
    calls of 4, one of 1), one graph for each call length whatever the slices' sizes (four of one size in the first
    call, of four sizes in the second: no duck sizing) and every step's learning rate (torch 2.11 recompiled for
    each learning rate until the step stopped negating a float input). Under `kahan` it rounds each new weight to
    bf16 on its bits before taking the compensation from it (inductor would read the float32 sum in place of a cast;
    torch 2.11's even under `emulate_precision_casts`): the weights equal the eager step's. Stochastic rounding
    hashes the same bits compiled as eagerly: the weights equal the eager step's too."""
    from alignpipe import fused_kernels

    monkeypatch.setattr(low_precision_adamw, "MAX_PIECES", 4)
    gen = torch.Generator().manual_seed(0)
    shapes = [(16, 9)] * 4 + [(40, 30), (70,), (33,), (5, 11), (12, 12)]
    weights = [torch.randn(shape, generator=gen) for shape in shapes]
    grads = [[torch.randn(shape, generator=gen) for shape in shapes] for _ in range(4)]

    def run(compiled: bool):
        monkeypatch.setattr(fused_kernels, "wanted", lambda enabled, device: enabled)
        params = [torch.nn.Parameter(w.bfloat16()) for w in weights]
        opt = LowPrecisionAdamW(params, lr=1e-3, weight_decay=0.01, updates=updates, fused_kernels=compiled)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.bfloat16()
            opt.step()
            scheduler.step()
        return params, opt

    assert [len(b) for b in low_precision_adamw._buckets([((w.reshape(-1),), None) for w in weights])] == [4, 4, 1]
    torch._dynamo.reset()
    low_precision_adamw._compiled.cache_clear()
    stats = torch._dynamo.utils.counters["stats"]
    before = stats["unique_graphs"]
    compiled, opt = run(True)
    assert stats["unique_graphs"] - before == 2
    eager, ref = run(False)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
        if updates == "stochastic":
            assert "kahan_comp" not in opt.state[a]
            continue
        comp_gap = (opt.state[a]["kahan_comp"].float() - ref.state[b]["kahan_comp"].float()).abs().max()
        assert comp_gap <= 1e-3 * a.detach().float().abs().max() * torch.finfo(torch.bfloat16).eps
        assert opt.state[a]["kahan_comp"].abs().max() > 0


def test_calls_hold_powers_of_two_up_to_max_pieces_and_chunk_values_and_strided_tensors_alone(monkeypatch):
    """A run of slices is cut at `MAX_PIECES` slices or `CHUNK` values, and each run into powers of two (the only
    call lengths, so the only graphs); a tensor with no flat view (2-D here) is a call of its own."""
    monkeypatch.setattr(low_precision_adamw, "CHUNK", 100)

    def piece(n, dim=1):
        return ((torch.zeros(n) if dim == 1 else torch.zeros(n, 1)),), None

    strided = piece(7, dim=2)
    batch = [piece(10)] * 11 + [piece(60), piece(50), strided] + [piece(5)] * 6
    buckets = low_precision_adamw._buckets(batch)
    assert [len(b) for b in buckets] == [8, 4, 1, 4, 2, 1]  # the last run, 7 slices, as 4 + 2 + 1
    assert [sum(item[0][0].numel() for item in b) for b in buckets] == [80, 90, 7, 65, 10, 5]
    assert buckets[2] == [strided]
    assert low_precision_adamw._buckets([]) == []


def test_kept_slices_follow_a_new_weight_and_a_loaded_state(monkeypatch):
    """The slices of a weight and its states are kept between steps; a parameter given a new `.data` and an
    optimizer given a saved state are stepped in their new tensors, as a fresh optimizer steps them."""
    gen = torch.Generator().manual_seed(0)
    first, second = torch.randn(30, 20, generator=gen), torch.randn(30, 20, generator=gen)
    grads = [torch.randn(30, 20, generator=gen) for _ in range(4)]

    def steps(p, opt, which):
        for i in which:
            p.grad = grads[i].bfloat16()
            opt.step()

    p = torch.nn.Parameter(first.bfloat16())
    opt = LowPrecisionAdamW([p], lr=1e-2)
    steps(p, opt, range(2))
    p.data = second.bfloat16()  # as a reload of the weights does
    saved = {k: v.clone() for k, v in opt.state[p].items()}
    steps(p, opt, range(2, 4))
    q = torch.nn.Parameter(second.bfloat16())
    ref = LowPrecisionAdamW([q], lr=1e-2)
    ref.state[q].update({k: v.clone() for k, v in saved.items()})
    steps(q, ref, range(2, 4))
    assert torch.equal(p, q) and not torch.equal(p, second.bfloat16())
    loaded = copy.deepcopy(ref.state_dict())  # torch's load keeps the tensors it is given
    steps(p, opt, range(4))
    opt.load_state_dict(loaded)
    p.data = q.detach().clone()
    steps(p, opt, range(2))
    steps(q, ref, range(2))
    assert torch.equal(p, q)
    assert torch.equal(opt.state[p]["kahan_comp"], ref.state[q]["kahan_comp"])


def test_a_compiler_failure_falls_back_to_the_eager_step_once(monkeypatch, caplog):
    """Where the compiled step cannot be built the optimizer says so once and takes the eager step, with its
    result, for that slice and every later one."""
    from alignpipe import fused_kernels

    calls = []

    def broken(pieces, scalars, salts):
        calls.append(len(pieces))
        raise torch._inductor.exc.InductorError(RuntimeError("no triton"), None)

    monkeypatch.setattr(fused_kernels, "wanted", lambda enabled, device: enabled)
    monkeypatch.setattr(low_precision_adamw, "_compiled", lambda stochastic: broken)
    gen = torch.Generator().manual_seed(0)
    weight, grads = torch.randn(30, 20, generator=gen), [torch.randn(30, 20, generator=gen) for _ in range(3)]
    runs = []
    for compiled in (True, False):
        p = torch.nn.Parameter(weight.bfloat16())
        opt = LowPrecisionAdamW([p], lr=1e-3, fused_kernels=compiled)
        for g in grads:
            p.grad = g.bfloat16()
            opt.step()
        runs.append(p)
    assert torch.equal(runs[0], runs[1])
    assert len(calls) == 1 and caplog.text.count("the compiled step failed") == 1


def test_fp16_weights_take_the_eager_step_where_bf16_ones_are_compiled(monkeypatch):
    """fp16 rounding is a cast, which a compiled kernel may skip (`round_to_bf16`), so fp16 weights are stepped
    eagerly under `fused_kernels` too, with the eager step's result; bf16 ones in the same optimizer are compiled."""
    from alignpipe import fused_kernels

    compiled_dtypes: list[Any] = []

    def recording(stochastic):
        def step(pieces, scalars, salts):
            compiled_dtypes.extend(piece[0].dtype for piece in pieces)
            low_precision_adamw._kahan_many(pieces, scalars, salts)

        return step

    monkeypatch.setattr(fused_kernels, "wanted", lambda enabled, device: enabled)
    monkeypatch.setattr(low_precision_adamw, "_compiled", recording)
    gen = torch.Generator().manual_seed(0)
    weight, grads = torch.randn(30, 20, generator=gen), [torch.randn(30, 20, generator=gen) for _ in range(3)]
    runs = []
    for compiled in (True, False):
        params = [torch.nn.Parameter(weight.half()), torch.nn.Parameter(weight.bfloat16())]
        opt = LowPrecisionAdamW(params, lr=1e-3, fused_kernels=compiled)
        for g in grads:
            for p in params:
                p.grad = g.to(p.dtype)
            opt.step()
        runs.append(params)
    assert compiled_dtypes == [torch.bfloat16] * 3
    assert all(torch.equal(a, b) for a, b in zip(*runs))
