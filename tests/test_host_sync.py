"""An offline training step reads nothing back from the device: each read would stall a GPU until its queue drains
(`float(loss)` per micro-batch is the classic, a boolean index of a device tensor another). The step runs with tensor-to-host conversions made to fail; metrics
stay device tensors until the loop reads them at a log point. (Reads inside transformers, e.g. its check of an SDPA
padding mask, are outside this test: they are the same for every trainer built on it.) Nor does a step copy from the
host in a way that waits: a plain `.to("cuda")` of a host tensor synchronises the stream too (`HostCopies`); the
online trainers' updates, which build their micro-batches' pieces on the host, queue them (`device_copies.to_device`)."""

from __future__ import annotations

import copy
import os
import sys
from collections import namedtuple
from typing import Any

import pytest
import torch
from support import known, tiny_split
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from alignpipe import device_copies
from alignpipe.modeling import load_causal_lm, load_sequence_scorer
from alignpipe.tracking import Tracker
from alignpipe.trainers import common, dpo, kto, reward, sft
from alignpipe.trainers.configs import DPOConfig, KTOConfig, RewardConfig, SFTConfig
from alignpipe.trainers.loss_watch import LossWatch

READS = ("__float__", "__int__", "item", "tolist")


class HostRead(AssertionError):
    pass


def _syncs(func, args, kwargs) -> bool:
    """Whether this operator makes the host wait for a CUDA device: it returns a Python scalar, or the size of its
    result depends on tensor values (the device must count them before the host can allocate)."""
    aten = torch.ops.aten
    if func in (
        aten._local_scalar_dense.default,  # item(), float(), int(), bool(), `if t:`
        aten.nonzero.default,  # nonzero_static is the one that does not wait
        aten.masked_select.default,
        aten.is_nonzero.default,
        aten.equal.default,
    ) or func.__name__.startswith(("unique", "_unique")):
        return True
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
        return kwargs.get("output_size") is None
    if func.__name__.startswith(("index.", "index_put", "_index_put_impl")):  # a boolean index runs nonzero
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    return False


def _from_transformers() -> bool:
    """Whether the innermost frame outside torch is transformers' (its SDPA padding-mask check, say)."""
    frame = _outside_torch(sys._getframe(2))
    return frame is not None and f"{os.sep}transformers{os.sep}" in frame.f_code.co_filename


def _outside_torch(frame):
    """The innermost frame from `frame` outward that is neither torch's nor this file's (`HostCopies`' mode)."""
    while frame is not None and (
        f"{os.sep}torch{os.sep}" in frame.f_code.co_filename or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    return frame


class DeviceReads(TorchDispatchMode):
    """Raises at any operator that would wait for a CUDA device (`_syncs`): the boolean index and the `.item()` that
    Python-level patching cannot see, found on a CPU. Outside transformers' own code unless `strict`: on `varlen`
    our batches leave transformers nothing to read (its packed-row check included: `attention.documents_mask`)."""

    def __init__(self, strict: bool = False):
        super().__init__()
        self.strict = strict

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _syncs(func, args, kwargs) and (self.strict or not _from_transformers()):
            raise HostRead(f"a training step ran {func}, which waits for the device")
        return func(*args, **kwargs)


def _names_a_device(args: tuple, kwargs: dict) -> bool:
    """Whether a `Tensor.to` call moves to a device (rather than only changing the dtype)."""
    return kwargs.get("device") is not None or any(isinstance(a, (str, torch.device, torch.Tensor)) for a in args)


def _waits(args: tuple, kwargs: dict) -> bool:
    """Whether a `Tensor.to(device, dtype, non_blocking, copy)` call leaves `non_blocking` off."""
    flags = [a for a in args if isinstance(a, bool)]
    return not kwargs.get("non_blocking", flags[0] if flags else False)


def _from_alignpipe() -> bool:
    """Whether the move is alignpipe's own: the innermost frame outside torch (and outside accelerate's
    `send_to_device`, which moves what it is handed) is alignpipe's code. torch's, transformers' and accelerate's
    own moves (of tensors already on the device: gradient norms, rotary tables) are not copies from the host."""
    frame = _outside_torch(sys._getframe(2))
    while frame is not None and frame.f_code.co_filename.endswith(f"accelerate{os.sep}utils{os.sep}operations.py"):
        frame = frame.f_back
    return frame is not None and f"{os.sep}alignpipe{os.sep}" in frame.f_code.co_filename


class BlockingCopy(AssertionError):
    pass


class HostCopies(TorchFunctionMode):
    """Raises at a copy from the host that would make the host wait on a GPU: alignpipe's `t.to(device)` without
    `non_blocking=True`, `torch.tensor(..., device=...)` / `torch.as_tensor(..., device=...)`, or `t[list]` /
    `t[list] = x` (torch copies the list to the device; a copy from pageable memory synchronises the stream;
    `device_copies.to_device` stages and queues it instead)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "to" and _names_a_device(args[1:], kwargs) and _waits(args[1:], kwargs) and _from_alignpipe():
            raise BlockingCopy(f"a training step copied a tensor with .to{args[1:]}, which waits on a GPU")
        if name in ("tensor", "as_tensor") and kwargs.get("device") is not None and _from_alignpipe():
            raise BlockingCopy(f"a training step built torch.{name}(..., device=...), which waits on a GPU")
        if name in ("__getitem__", "__setitem__") and _lists_in(args[1]) and _from_alignpipe():
            raise BlockingCopy(
                f"a training step indexed a tensor with a host list ({args[1]!r}): on a GPU the list is copied to the "
                "device from pageable memory, and the host waits for the queue to drain"
            )
        return func(*args, **kwargs)


def _lists_in(index) -> bool:
    """Whether a tensor index holds a Python list (alone or in a tuple of indices)."""
    return isinstance(index, list) or (isinstance(index, tuple) and any(isinstance(i, list) for i in index))


@pytest.fixture
def guard(monkeypatch):
    """`guard(fn)`: fn wrapped so that inside it `float(t)`, `int(t)`, `t.item()`, `t.tolist()`, every operator
    that waits for a CUDA device (`DeviceReads`) and every copy from the host that would (`HostCopies`) raise. The
    loop's loss check and optimizer step are guarded too."""
    inside = {"step": False}
    for name in READS:
        original = getattr(torch.Tensor, name)

        def guarded(self, *args, _name=name, _original=original, **kwargs):
            if inside["step"]:
                raise HostRead(f"a training step read a tensor back with {_name}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, guarded)

    class Guard:
        strict = False  # `DeviceReads(strict=True)`: transformers' own code's device reads fail the step too

        def __call__(self, fn):
            def run(*args, **kwargs):
                inside["step"] = True
                try:
                    with DeviceReads(self.strict), HostCopies():
                        return fn(*args, **kwargs)
                finally:
                    inside["step"] = False

            return run

        @staticmethod
        def host_side(fn):
            """`fn` exempt from the Python-level reads' check: CPU-only code that reads host tensors (varlen's
            per-document loop, which the CUDA kernel replaces)."""

            def run(*args, **kwargs):
                was, inside["step"] = inside["step"], False
                try:
                    return fn(*args, **kwargs)
                finally:
                    inside["step"] = was

            return run

    inside_a_step = Guard()
    for name in ("_optimizer_step", "_watch_loss"):
        monkeypatch.setattr(common.TrainLoop, name, inside_a_step(getattr(common.TrainLoop, name)))
    return inside_a_step


def varlen_on_cpu(monkeypatch, guard, attention: str) -> list[int]:
    """`model.attention: varlen` as a GPU runs it, on CPU: its per-document loop, which stands in for the CUDA kernel
    and reads the host offsets, exempt from the guard; on `attention` "varlen", transformers' reads are not exempt
    (`DeviceReads`' `strict`). Returns the list that counts the attention calls."""
    from alignpipe import attention as kernels

    guard.strict = attention == "varlen"
    calls: list[int] = []
    loop = kernels._per_document
    monkeypatch.setattr(kernels, "_per_document", lambda *a: calls.append(1) or guard.host_side(loop)(*a))
    return calls


@pytest.fixture
def steps_read_nothing(monkeypatch, guard):
    """A whole offline step (the step function, the loss check, the optimizer step) under `guard`."""
    run = common.TrainLoop.run
    monkeypatch.setattr(common.TrainLoop, "run", lambda self, step_fn, eval_fn=None: run(self, guard(step_fn), eval_fn))


def test_the_guard_catches_what_python_cannot_see():
    """A boolean index and a tensor in an `if` wait for a CUDA device without calling a patched Python method."""
    t = torch.arange(6.0)
    with pytest.raises(HostRead), DeviceReads():
        t[t > 2].sum()
    with pytest.raises(HostRead), DeviceReads():
        bool(t.sum() > 1)
    with DeviceReads():  # what does not wait passes
        idx = (t > 2).nonzero_static(size=3).squeeze(1)
        torch.zeros(6).index_copy(0, idx, t.index_select(0, idx))


@pytest.mark.parametrize(
    "packing, attention", [(False, "sdpa"), (True, "sdpa"), (False, "varlen"), (True, "varlen")], ids=str
)
def test_an_sft_step_reads_nothing_back(tiny, tmp_path, monkeypatch, guard, steps_read_nothing, packing, attention):
    """Packed or not; on varlen the blocks' documents (an unpacked batch runs as one block) are counted by `collate`."""
    documents = varlen_on_cpu(monkeypatch, guard, attention)
    tok, train, evals = tiny_split(tiny, "sentiment_sft", "prompt_completion", rows=120, max_length=64)
    cfg = SFTConfig(max_steps=3, batch_size=4, gradient_accumulation_steps=2, packing=packing, max_length=128)
    tracker = Tracker()
    sft.train(cfg, load_causal_lm(str(tiny / "model"), attention=attention), tok, train, evals, tracker, tmp_path)
    assert known(tracker.last("train/loss")) > 0 and known(tracker.last("train/num_tokens")) > 0
    assert bool(documents) == (attention == "varlen")


@pytest.mark.parametrize(
    "share, attention",
    [(False, "sdpa"), (True, "sdpa"), (True, "varlen")],
    ids=["whole-rows", "shared-prompts-fused-head", "padding-free-varlen-fused-head"],
)
def test_dpo_and_reward_steps_read_nothing_back(
    tiny, tmp_path, monkeypatch, guard, steps_read_nothing, share, attention
):
    """Sharing each pair's prompt (what pays at long prompts on a GPU) is decided from host flags `collate` sets;
    DPO's fused head (what a GPU batch's logits take) groups its pairs and gathers their tokens from host counts.
    On varlen the batches run padding-free from offsets and positions `collate` laid out on the host."""
    from alignpipe import logprobs

    calls: list[str] = []
    documents = varlen_on_cpu(monkeypatch, guard, attention)
    if share:
        monkeypatch.setattr(logprobs, "WHOLE_LOGITS_MAX", 0)
        fused = dpo.fused_pair_loss
        monkeypatch.setattr(
            dpo,
            "fused_pair_loss",
            lambda *a: (lambda out: (out is not None and calls.append("fused")) or out)(fused(*a)),
        )
        monkeypatch.setattr(logprobs, "SHARE_MIN_SAVED", 0)
        for module in (logprobs, reward):
            shared = module.shared_prefix_hidden
            monkeypatch.setattr(
                module, "shared_prefix_hidden", lambda *a, _f=shared, _m=module: calls.append(_m.__name__) or _f(*a)
            )
    tok, train, evals = tiny_split(tiny, "sentiment_preferences", "preference", rows=80, max_length=64)
    policy = load_causal_lm(str(tiny / "model"), attention=attention)
    tracker = Tracker()
    cfg = DPOConfig(max_steps=2, batch_size=4, gradient_accumulation_steps=2, rpo_alpha=0.5)
    dpo.train(cfg, policy, tok, train, evals, tracker, tmp_path / "dpo", ref_model=copy.deepcopy(policy))
    assert tracker.last("train/rewards/accuracies") is not None and known(tracker.last("train/nll_loss")) > 0
    scorer = load_sequence_scorer(str(tiny / "model"), "float32", pad_token_id=tok.pad_token_id, attention=attention)
    tracker = Tracker()
    reward.train(RewardConfig(max_steps=2, batch_size=4), scorer, tok, train, evals, tracker, tmp_path / "rm")
    assert tracker.last("train/accuracy") is not None and tracker.last("eval/accuracy") is not None
    assert bool(documents) == (attention == "varlen")
    if attention == "varlen":
        assert "fused" in calls and "alignpipe.logprobs" not in calls, "padding-free, not shared prompts"
    elif share:
        assert {"alignpipe.logprobs", "alignpipe.trainers.reward"} <= set(calls), "both took the shared path"
        assert "fused" in calls


@pytest.mark.parametrize(
    "loss_type, attention", [("kto", "sdpa"), ("apo_zero_unpaired", "sdpa"), ("kto", "varlen")], ids=str
)
def test_a_kto_step_reads_nothing_back(tiny, tmp_path, monkeypatch, guard, steps_read_nothing, loss_type, attention):
    """KTO's sides are told apart with `where` on the labels, and counted on the host by `collate`; its fused head
    (a GPU batch's) groups completions by host counts; on varlen its halves run padding-free."""
    from alignpipe import logprobs

    documents = varlen_on_cpu(monkeypatch, guard, attention)
    monkeypatch.setattr(logprobs, "SHARE_MIN_SAVED", 0)
    monkeypatch.setattr(logprobs, "WHOLE_LOGITS_MAX", 0)
    fused: list = []
    answers_loss = dpo.fused_answers_loss
    monkeypatch.setattr(dpo, "fused_answers_loss", lambda *a: fused.append(answers_loss(*a)) or fused[-1])
    tok, train, evals = tiny_split(tiny, "sentiment_preferences", "unpaired", rows=80, max_length=64)
    policy = load_causal_lm(str(tiny / "model"), attention=attention)
    tracker = Tracker()
    cfg = KTOConfig(max_steps=2, batch_size=4, gradient_accumulation_steps=2, loss_type=loss_type)
    kto.train(cfg, policy, tok, train, evals, tracker, tmp_path, ref_model=copy.deepcopy(policy))
    assert tracker.last("train/rewards/margins") is not None and tracker.last("eval/logps/chosen") is not None
    assert fused and all(out is not None for out in fused), "the fused head ran"
    assert bool(documents) == (attention == "varlen")


def test_the_loss_watch_reports_the_first_bad_step_and_forgets():
    watch = LossWatch()
    watch.watch(1, torch.tensor(0.5))
    watch.watch(2, None)  # a step that reported no loss
    watch.watch(3, float("inf"))
    watch.watch(4, torch.tensor(float("nan")))
    assert watch.first_bad() == (3, float("inf"))
    assert watch.first_bad() is None
    watch.watch(5, torch.tensor(1.0))
    assert watch.first_bad() is None


def test_a_host_read_keeps_the_value_it_was_given():
    """`HostRead` off a GPU reads the value as it was when taken, as the GPU's stream-ordered copy does: an in-place
    change after it (the decode loop's `done |= now`) does not reach it."""
    from alignpipe.host_reads import HostRead

    done = torch.tensor([True, False])
    read = HostRead(done.all())
    flags = HostRead(done)
    done |= torch.tensor([False, True])
    assert not bool(read.get()) and flags.get().tolist() == [True, False] and bool(done.all())


@pytest.mark.parametrize("save_every", [None, 2])
def test_a_nan_loss_stops_the_run_one_step_late_and_before_any_checkpoint(tiny, tmp_path, monkeypatch, save_every):
    """Step 2's loss is read while step 3 is queued (no wait for the device in step 2), and never after a
    checkpoint of the diverged model was written: a save point settles the watch first."""
    calls: list[Any] = []
    run = common.TrainLoop.run

    def nan_at_step_two(self, step_fn, eval_fn=None):
        def step(window):
            calls.append(len(calls) + 1)
            metrics = dict(step_fn(window))
            if len(calls) == 2:
                metrics["loss"] = metrics["loss"] * float("nan")
            return metrics

        return run(self, step, eval_fn)

    monkeypatch.setattr(common.TrainLoop, "run", nan_at_step_two)
    tok, train, evals = tiny_split(tiny, "sentiment_sft", "prompt_completion", rows=120, max_length=64)
    cfg = SFTConfig(max_steps=5, batch_size=4, logging_every=100, save_every=save_every)
    with pytest.raises(FloatingPointError, match=r"sft: loss is nan at step 2; last checkpoint kept: none"):
        sft.train(cfg, load_causal_lm(str(tiny / "model")), tok, train, evals, Tracker(), tmp_path)
    assert calls == ([1, 2] if save_every else [1, 2, 3])
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


# GRPO with everything its update may add: the sampling correction's weights, the off-policy mask, an adaptive entropy
# bonus (its coefficient kept on the device), two optimizer steps per generation batch
GRPO_EXTRAS = dict(
    sampling_correction="token_truncate", off_policy_mask_threshold=0.5, entropy_coef=0.01, use_adaptive_entropy=True,
    steps_per_generation=2,
)  # fmt: skip


@pytest.mark.parametrize(
    "algorithm, attention",
    [("grpo", "sdpa"), ("rloo", "sdpa"), ("grpo", "varlen"), ("rloo", "varlen"), ("grpo-extras", "sdpa")],
    ids=str,
)
def test_an_online_update_reads_nothing_back(tiny, tmp_path, monkeypatch, guard, algorithm, attention):
    """GRPO's and RLOO's update (forward and backward over the rollout, loss check, optimizer step) reads nothing
    back: the training tokens are counted on the host when the rollout is built, and on varlen its padding-free
    layout is built from the host token lists the rollout keeps; masks, advantages and layouts are queued to the
    device, not copied with a wait. Rollouts read by design (the decode loop looks every 4 tokens on a GPU), so only
    the update is guarded."""
    from alignpipe.judges.reward_set import LoadedReward, RewardSet
    from alignpipe.trainers import grpo, rloo
    from alignpipe.trainers.configs import GRPOConfig, RLOOConfig

    extras = GRPO_EXTRAS if algorithm == "grpo-extras" else {}
    algorithm = algorithm.split("-")[0]
    module = {"grpo": grpo, "rloo": rloo}[algorithm]
    updates = []
    update = module.update
    monkeypatch.setattr(module, "update", lambda *a: updates.append(1) or guard(update)(*a))
    tok, train, _ = tiny_split(tiny, "reverse", "prompt_completion", rows=40)
    rows = [{"prompt": r["prompt"]} for r in train]
    config = {"grpo": GRPOConfig, "rloo": RLOOConfig}[algorithm]
    cfg = config(
        max_steps=2, batch_size=8, num_generations=4, max_completion_length=6, beta=0.04, num_iterations=2, **extras
    )
    rewards = RewardSet([LoadedReward("len", lambda p, c, **_: [len(x) / 10 for x in c])])
    tracker = Tracker()
    documents = varlen_on_cpu(monkeypatch, guard, attention)
    policy = load_causal_lm(str(tiny / "model"), attention=attention)
    module.train(cfg, policy, tok, rows, rewards, tracker, tmp_path, ref_model=copy.deepcopy(policy))
    assert len(updates) == 2 and tracker.last("train/loss") is not None
    assert bool(documents) == (attention == "varlen")


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
def test_an_online_dpo_update_reads_nothing_back(tiny, tmp_path, monkeypatch, guard, attention):
    """Online DPO's update (policy and reference log-probs of each micro-batch of ranked pairs, loss, backward, and
    the step's statistics) reads nothing back and copies without a wait: the pairs are ranked and laid out on the host
    (`sample_pairs`) before it, tied pairs are masked on the device, the ranker's scores queued to it."""
    from alignpipe.judges.reward_set import LoadedReward, RewardSet
    from alignpipe.trainers import online_dpo
    from alignpipe.trainers.configs import OnlineDPOConfig

    updates = []
    update = online_dpo.update
    monkeypatch.setattr(online_dpo, "update", lambda *a: updates.append(1) or guard(update)(*a))
    tok, train, _ = tiny_split(tiny, "reverse", "prompt_completion", rows=40)
    rows = [{"prompt": r["prompt"]} for r in train]
    cfg = OnlineDPOConfig(max_steps=2, batch_size=4, gradient_accumulation_steps=2, max_completion_length=6)
    rewards = RewardSet([LoadedReward("len", lambda p, c, **_: [len(x) / 10 for x in c])])
    tracker = Tracker()
    documents = varlen_on_cpu(monkeypatch, guard, attention)
    policy = load_causal_lm(str(tiny / "model"), attention=attention)
    ranker = online_dpo.RewardRanker(rewards, 1.0)
    online_dpo.train(cfg, policy, tok, rows, ranker, tracker, tmp_path, ref_model=copy.deepcopy(policy))
    assert len(updates) == 2 and tracker.last("train/loss") is not None
    assert tracker.last("train/objective/scores") is not None
    assert bool(documents) == (attention == "varlen")


@pytest.mark.parametrize(("lora", "attention"), [(False, "sdpa"), (True, "sdpa"), (False, "varlen")], ids=str)
def test_a_ppo_update_reads_nothing_back(tiny, tmp_path, monkeypatch, guard, lora, attention):
    """PPO's epochs over a rollout (policy and value forward and backward, gradient clipping, optimizer and schedule
    steps) read nothing back with TRL 0.7's opt-in host decisions (`ratio_threshold`, `early_stopping`) off: the
    mini-batch permutation and each micro-batch's token count are host ints. The statistics are read once after
    the epochs. On varlen the micro-batches' padding-free layouts come from the rollout's host token lists; each
    micro-batch's episode index and layout are queued to the device, not copied with a wait."""
    from support import run_ppo

    from alignpipe.trainers import ppo

    passes = []
    epochs = ppo._epochs
    monkeypatch.setattr(ppo, "_epochs", lambda *a: passes.append(1) or guard(epochs)(*a))
    documents = varlen_on_cpu(monkeypatch, guard, attention)
    _, tracker, _ = run_ppo(tiny, tmp_path, lora=lora, attention=attention, max_steps=2)
    assert len(passes) == 2 and len(tracker.series("loss/policy_avg")) == 2
    assert bool(documents) == (attention == "varlen")


def test_the_next_window_is_collated_before_a_log_point_waits_for_the_device(tiny, tmp_path, monkeypatch):
    """A log point reads the step's metrics, so it waits for the device. The loop collates the next step's batches
    (and queues their copies, non-blocking on a GPU) before that wait, while the device still runs the step: at the
    log of step k the batches of step k + 1 are already collated, and accelerate's loader has collated one more, as it
    always does. Before, the host collated after the wait, with the device idle. The run trains as before."""
    tok, train, _ = tiny_split(tiny, "sentiment_sft", "prompt_completion", rows=120, max_length=64)
    collated: list[int] = []
    at_log: list[tuple[int, int]] = []
    original = sft.collate
    monkeypatch.setattr(sft, "collate", lambda *a, **k: collated.append(1) or original(*a, **k))
    tracker = Tracker()
    log_metrics = tracker.log_metrics

    def logged(metrics, step):
        if "train/loss" in metrics:
            at_log.append((step, len(collated)))
        return log_metrics(metrics, step)

    tracker.log_metrics = logged  # type: ignore[method-assign]
    cfg = SFTConfig(learning_rate=1e-3, max_steps=4, batch_size=4, gradient_accumulation_steps=2, logging_every=1)
    sft.train(cfg, load_causal_lm(str(tiny / "model")), tok, train, [], tracker, tmp_path / "sft")
    # 2 batches a step: at step k's log, steps 1 … k + 1 collated (2k + 2) and the loader one ahead; the last step
    # fetches nothing more
    assert at_log == [(1, 5), (2, 7), (3, 9), (4, 9)]
    assert len(tracker.series("train/loss")) == 4


def test_to_device_stages_host_tensors_in_pinned_memory_and_queues_their_copies():
    """On CUDA each host tensor of a nest is page-locked, then copied `non_blocking` (queued behind the device's work
    instead of synchronising the stream); other values pass through; elsewhere it is a plain move. Recorded on a CPU
    by a mode that answers `pin_memory` and `to` itself (the GPU side is `bench/gpu_checks.py`'s host-copies line)."""
    calls: list = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            if name == "pin_memory":
                calls.append("pin")
                return args[0]
            if name == "to":
                calls.append(("to", str(args[1]), kwargs.get("non_blocking")))
                return args[0]
            return func(*args, **kwargs)

    data: dict[str, Any] = {"mask": torch.ones(2, 3), "rows": [torch.arange(2), 5], "longest": 7, "name": "x"}
    with Record():
        moved = device_copies.to_device(data, "cuda")
    assert calls == ["pin", ("to", "cuda", True)] * 2
    assert moved["rows"][1] == 5 and moved["longest"] == 7 and moved["name"] == "x"
    assert torch.equal(moved["mask"], data["mask"]) and torch.equal(moved["rows"][0], data["rows"][0])
    calls.clear()
    with Record():
        device_copies.to_device(data, torch.device("cpu"))
    assert calls == [("to", "cpu", True)] * 2, "no page-locking off CUDA"


_EXIT_HOOK_OF_A_DEAD_THREAD = """
import os, threading, torch
from accelerate import Accelerator
from alignpipe.trainers import common

parent = os.getpid()


def drain():  # as Prefect 3's API-log and event services drain their thread at exit: that thread is the parent's
    assert os.getpid() == parent, "no service thread to drain in a forked child"


threading._register_atexit(drain)
loader = common.batch_loader(Accelerator(cpu=True), list(range(6)), 2, lambda rows: {"x": torch.tensor(rows)},
                             shuffle=False, workers=1)
for _ in range(2):
    print([b["x"].tolist() for b in loader], flush=True)
"""


def test_loader_workers_exit_cleanly_from_a_process_whose_libraries_left_thread_exit_hooks():
    """A trainer called in a process where Prefect had run a flow: the forked loader worker inherited Prefect's
    thread exit hooks, one failed there, the worker exited with status 1 and the loader raised at the end of each
    pass. (In a subprocess: the hook cannot be taken back from a test worker.)"""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _EXIT_HOOK_OF_A_DEAD_THREAD], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["[[0, 1], [2, 3], [4, 5]]"] * 2


def test_a_worker_s_batch_crosses_in_one_buffer_and_unpacks_as_it_was_collated():
    """A loader worker's batch travels as one `OneBuffer`: one shared-memory storage, pinned once and copied to the
    device once on CUDA (recorded here by a mode that answers `pin_memory` and `to`), then unpacked by the loader's
    device placement into the batch as collated: the same nest (dicts, lists, tuples, named tuples, other values),
    every tensor's dtype, shape and values (non-contiguous and empty ones too), each a view of one buffer at an
    aligned offset."""
    from accelerate import Accelerator
    from accelerate.utils import send_to_device
    from torch.utils.data._utils.pin_memory import pin_memory

    def collate(rows):
        n = len(rows)
        return {
            "input_ids": torch.arange(3 * n).view(n, 3) + rows[0],
            "mask": torch.tensor([True, False, True]),
            "weights": torch.arange(6, dtype=torch.float32).view(2, 3).t(),  # not contiguous
            "half": torch.full((5,), 0.5, dtype=torch.bfloat16),
            "empty": torch.zeros(0, 4, dtype=torch.int64),
            "documents": {"cu_seq_lens_q": torch.tensor([0, 2, 5], dtype=torch.int32), "max_length_q": 3},
            "offsets": [0, 2, 5],
            "parts": (torch.ones(1, dtype=torch.int8), "x", None),
            "pair": Pair(torch.tensor([7, 8]), 2),
            "prompts_nonempty": True,
        }

    def same(a, b):
        assert type(a) is type(b), (a, b)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        elif isinstance(a, dict):
            assert list(a) == list(b)
            for k in a:
                same(a[k], b[k])
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                same(x, y)
        else:
            assert a == b

    def views_of_one_buffer(batch) -> set[int]:
        tensors = [t for t in _tensors(batch) if t.numel()]
        assert all(t.data_ptr() % device_copies.OneBuffer.ALIGN == 0 for t in tensors)
        return {t.untyped_storage().data_ptr() for t in tensors}

    packed = device_copies.OneBuffer.of(collate([4, 5]))
    unpacked = packed.to("cpu")
    same(unpacked, collate([4, 5]))
    assert views_of_one_buffer(unpacked) == {packed.buffer.data_ptr()}

    acc = Accelerator(cpu=True)
    for workers in (0, 1):
        loader = common.batch_loader(acc, list(range(6)), 2, collate, shuffle=False, workers=workers)
        batches = list(loader)
        assert len(batches) == 3
        for batch, first in zip(batches, (0, 2, 4)):
            same(batch, collate([first, first + 1]))
            assert len(views_of_one_buffer(batch)) == (1 if workers else 7), "from a worker: one storage a batch"

    calls: list = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("pin_memory", "to"):
                calls.append((name, *(str(a) for a in args[1:]), *(kwargs or {}).values()))
                return args[0]
            return func(*args, **(kwargs or {}))

    with Record():
        on_device = send_to_device(pin_memory(packed), "cuda", non_blocking=True)
    assert calls == [("pin_memory",), ("to", "cuda", True)], "one pinning, one copy a batch"
    same(on_device, collate([4, 5]))
    with pytest.raises(ValueError, match="on the host, not meta"):
        device_copies.OneBuffer.of({"x": torch.empty(2, device="meta")})


Pair = namedtuple("Pair", "ids count")  # at module level: a worker's batch is pickled


def _tensors(nest) -> list[torch.Tensor]:
    if isinstance(nest, torch.Tensor):
        return [nest]
    if isinstance(nest, dict):
        nest = list(nest.values())
    if isinstance(nest, (list, tuple)):
        return [t for x in nest for t in _tensors(x)]
    return []


def test_host_tensors_built_through_numpy_are_what_torch_tensor_builds():
    """`int64_tensor`, `pad_rows` and the collates fill their host tensors through NumPy (~4x faster from Python lists
    than `torch.tensor`): the same int64 values, shapes and padding as `torch.tensor` of the lists, an empty row and a
    one-row batch included."""
    from alignpipe.trainers import sft
    from alignpipe.trainers.common import pad_rows

    for values in ([3, 1, 2], [[1, 2], [3, 4]], []):
        got = device_copies.int64_tensor(values)
        want = torch.tensor(values, dtype=torch.long)
        assert got.dtype == torch.int64 and got.shape == want.shape and torch.equal(got, want)
    rows = [[5, 6, 7], [], [8]]
    for left in (False, True):
        ids, mask = pad_rows(rows, pad_id=0, left=left)
        padded = [[5, 6, 7], [0, 0, 0], [0, 0, 8] if left else [8, 0, 0]]
        assert ids.dtype == mask.dtype == torch.int64 and ids.tolist() == padded
        assert mask.tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 1] if left else [1, 0, 0]]
    assert pad_rows([[]], 9)[0].tolist() == [[9]], "at least one column"
    blocks = [
        {"input_ids": [4, 5, 6], "labels": [-100, 5, 6], "position_ids": [0, 0, 1]},
        {"input_ids": [7], "labels": [-100], "position_ids": [0]},
    ]
    out = sft.collate(blocks, pad_id=1)
    assert out["input_ids"].tolist() == [[4, 5, 6], [7, 1, 1]]
    assert out["labels"].tolist() == [[-100, 5, 6], [-100, -100, -100]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 0, 1], [0, 0, 1]], "the padding after a block counts from 0"
    assert out["num_targets"] == 2 and isinstance(out["num_targets"], int)
    assert all(out[k].dtype == torch.int64 for k in ("input_ids", "labels", "attention_mask", "position_ids"))


def test_batches_collated_in_a_worker_process_train_as_those_collated_in_the_loop(tiny, tmp_path, monkeypatch):
    """`dataloader_workers: 1` (the default on a GPU) tokenizes and collates DPO's batches in a worker process beside
    training: the same batches in the same order, so the same losses and gradient norms step for step, across an
    epoch's end (a new loader, a new worker); the tokenizing happened in the worker, not here. The loader of a resumed
    run skips its first batches alike with a worker or without."""
    from accelerate import Accelerator

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)  # restored after: the loader sets it for its workers
    tok, train, _ = tiny_split(tiny, "sentiment_preferences", "preference", rows=24, max_length=64)
    where = tmp_path / "tokenized-in"
    tokenize = dpo.tokenize

    def recorded(rows, *args):
        if rows:  # (the evaluation rows, none here, are tokenized up front)
            with open(where, "a") as f:  # a file: a worker's memory is its own
                f.write(f"{os.getpid()}\n")
        return tokenize(rows, *args)

    monkeypatch.setattr(dpo, "tokenize", recorded)
    curves = {}
    for workers in (0, 1):
        where.write_text("")
        policy = load_causal_lm(str(tiny / "model"))
        tracker = Tracker()
        cfg = DPOConfig(learning_rate=1e-3, max_steps=8, batch_size=4, logging_every=1, dataloader_workers=workers)
        dpo.train(cfg, policy, tok, train, [], tracker, tmp_path / str(workers), ref_model=copy.deepcopy(policy))
        curves[workers] = tracker.series("train/loss"), tracker.series("train/grad_norm")
        pids = set(where.read_text().split())
        assert (str(os.getpid()) in pids) == (workers == 0) and len(pids) == (1 if workers == 0 else 2), pids
    assert len(curves[0][0]) == 8 and curves[1] == curves[0]  # 6 batches an epoch: the second epoch's worker too

    assert common.loader_workers(DPOConfig(), torch.device("cpu")) == 0
    assert common.loader_workers(DPOConfig(), torch.device("cuda", 0)) == 1
    assert common.loader_workers(DPOConfig(dataloader_workers=2), torch.device("cpu")) == 2
    assert common.loader_workers(DPOConfig(), torch.device("cuda", 0), collates=False) == 0, "an online trainer's rows"
    acc = Accelerator(cpu=True)
    rows = list(range(10))
    skipped = {}
    for workers in (0, 1):
        loader = common.batch_loader(acc, rows, 2, torch.tensor, torch.Generator().manual_seed(0), workers=workers)
        skipped[workers] = [b.tolist() for b in acc.skip_first_batches(loader, 2)]
    assert len(skipped[0]) == 3 and skipped[1] == skipped[0]


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def _clipped_pair(layers: int):
    """A model of bf16 and float32 linears with random gradients (the last bias without one), and a copy."""
    torch.manual_seed(layers)
    model = torch.nn.Sequential(
        *(torch.nn.Linear(16, 16).to(torch.bfloat16 if i % 2 else torch.float32) for i in range(layers))
    )
    model[-1].bias.requires_grad_(False)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p) * 3
    theirs = copy.deepcopy(model)
    for p, q in zip(model.parameters(), theirs.parameters(), strict=True):
        q.grad = None if p.grad is None else p.grad.clone()
    return model, theirs


@pytest.mark.parametrize("max_norm", [1e-3, 1e3, None])
def test_the_step_s_clipping_gives_torch_s_norm_and_gradients_bit_for_bit_without_a_copy_a_parameter(max_norm):
    """`common.clip_and_measure` off FSDP: the norm and the clipped gradients (bf16 and float32 parameters, a
    parameter without a gradient) equal `torch.nn.utils.clip_grad_norm_`'s bit for bit, clipped or not, in as many
    operators for 3 layers as for 12 (torch copies each parameter's norm to the first device: one a parameter)."""
    from accelerate import Accelerator

    counts = []
    for layers in (3, 12):
        model, theirs = _clipped_pair(layers)
        with _OpCount() as counted:
            norm = common.clip_and_measure(Accelerator(cpu=True), model, max_norm)
        want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm or float("inf"))
        assert torch.equal(norm, want)
        for (name, p), q in zip(model.named_parameters(), theirs.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name
        counts.append(len(counted.ops))
    assert counts[0] == counts[1], (counts, counted.ops)
    assert "_to_copy" not in counted.ops and "detach" not in counted.ops
