"""The hf engine's fixed-shape decode steps: one token per row through the model with a static KV cache, replayed
instead of issued op by op.

An eager decode step of a 24-layer model issues a few hundred kernels from Python, ~8 ms of host work per token
(`python -m bench.decode_overhead`), while a 0.5B model's step needs ~1 ms of an H100. Both steps here replay the
whole step as one CUDA graph:

- `GraphedDecodeStep` (the default on a GPU, `rollout: {cuda_graphs: true}`) records the eager step itself with
  `torch.cuda.CUDAGraph`: about two eager steps of host time per rollout, no compilation, and the static cache and
  graph freed when the rollout ends.
- `CompiledDecodeStep` (`rollout: {compile: true}`) compiles the step with `torch.compile(mode="reduce-overhead")`
  first: inductor's fused kernels inside the graph, paid for by a compilation per shape. So that shapes are few, its
  prompt widths round up to a power of two that never falls below the widest so far, and its static caches are kept
  per (model, rows, length) and reset between rollouts (a graph reads the cache it was recorded with).

Shared by both (`FixedShapeStep`): the first replay of each shape is checked against the eager step on the same
inputs, and a step that fails to record or replays wrong logits warns once and the eager step runs from then on (the
same tokens, slower).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from alignpipe import fused_kernels, lean_activations
from alignpipe.engine import merged_projections, static_cache
from alignpipe.engine.fused_residuals import FusedResiduals
from alignpipe.engine.merged_projections import MergedProjections

log = logging.getLogger(__name__)

# The narrowest prompt width of a fixed-shape decode; wider prompts round up to a power of two.
WIDTH_BUCKET = 64

# The compiled step's logits are compared with the eager step's at this call of each shape: the first replay of its
# CUDA graph (torch.compile's reduce-overhead mode runs a shape once to warm up and once to record it).
CHECK_CALL = 3

# Worst per-row relative gap of a replayed step's logits from the eager step's: bf16 rounding in another order
# gives ~1e-2; a graph reading stale inputs or cache entries is off by order one.
CHECK_TOLERANCE = 5e-2


def decode_step(model, token, mask, pos, cache, cache_position) -> torch.Tensor:
    """One token per row through the model with a static cache: the next-token logits, (rows, V)."""
    return model(
        input_ids=token,
        attention_mask=mask,
        position_ids=pos,
        past_key_values=cache,
        cache_position=cache_position,
        use_cache=True,
    ).logits[:, -1]


class FixedShapeStep(abc.ABC):
    """What the replayed decode steps share: prompt widths and static caches per (model, rows, length), the check of a
    shape's first replay against the eager step, and the fallback to the eager step. Subclasses say how a step is
    run (`_run`), which call of a shape is checked (`_first_replay`), and what a rollout's end frees (`release`)."""

    what = "replayed decode step"
    off_switch = ""
    shared_positions = True
    """Whether its static caches' layers share one write position per step (`static_cache.static_cache`)."""

    def __init__(self):
        self.caches: dict[tuple[int, int, int], Any] = {}
        self.failed: str | None = None
        """Why the step was given up for the eager one, once it was."""

    def width(self, width: int) -> int:
        """The prompt width a rollout of prompts `width` tokens wide decodes at (left-padded to it)."""
        return width

    def cache(self, model, rows: int, length: int):
        """The static cache of (model, rows, length), emptied for a new rollout (a new cache object would be a new
        recording); once the width grows, the narrower caches are never run again and are dropped."""
        key = (id(model), rows, length)
        cache = self.caches.get(key)
        if cache is None:
            self.caches = {k: c for k, c in self.caches.items() if k[2] == length}
            self._forget(lambda k: k[2] != length)
            cache = self.caches[key] = new_cache(model, length, self.shared_positions)
        else:
            cache.reset()
        return cache

    def __call__(self, model, token, mask, pos, cache, cache_position) -> torch.Tensor:
        args = (model, token, mask, pos, cache, cache_position)
        if self.failed:
            return decode_step(*args)
        shape = (id(model), *token.shape, mask.size(-1))
        check = self._first_replay(shape)
        restore = _counters_restorer(cache) if check else None
        try:
            logits = self._run(args, shape)
        except Unrecorded as err:
            self._give_up(str(err))
            return decode_step(*args)
        if restore is not None:
            restore()  # the eager step from the same cache state: it writes the same entries again (to rounding)
            eager = decode_step(*args)
            want = eager.float()
            gap = ((logits.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-6)).max().item()
            if gap > CHECK_TOLERANCE:  # the eager step has run this token already: its logits are the ones
                self._give_up(f"its logits are off from the eager step's by {gap:.2g}")
                return eager
        return logits

    def release(self) -> None:  # noqa: B027  (a hook: nothing to free by default)
        """A rollout ended: free what only it needs (the compiled step keeps its caches: a new one is a new
        compilation)."""

    @abc.abstractmethod
    def _run(self, args: tuple, shape: tuple) -> torch.Tensor:
        """The step's logits for `args`, replayed; `Unrecorded` where it cannot be."""

    @abc.abstractmethod
    def _first_replay(self, shape: tuple) -> bool:
        """Whether this call, the next of `shape`'s, is to be checked against the eager step."""

    def _forget(self, narrower: Callable[[tuple], bool]) -> None:  # noqa: B027  (a hook: nothing recorded here)
        """Drop what was recorded for the caches keyed `narrower` (they were just dropped)."""

    def _give_up(self, why: str) -> None:
        self.failed = why
        log.warning(
            "rollout: the %s is given up because %s; the eager static-cache step runs instead (the same tokens, "
            "slower on a GPU). Set `rollout: {%s}` to skip the attempt",
            self.what,
            why,
            self.off_switch,
        )
        self.caches.clear()
        self._forget(lambda key: True)


class Unrecorded(RuntimeError):
    """A decode step could not be compiled or recorded as a graph; the message says why."""


class CompiledDecodeStep(FixedShapeStep):
    """`rollout: {compile: true}`: the decode step compiled with `torch.compile(mode="reduce-overhead")`, which on a
    GPU records it as a CUDA graph of inductor's kernels and replays it for every token; on CPU it is inductor's
    compiled code. The model is an input of the graph, not a constant: optimizer steps update its weights in place and
    the next rollout replays the same graph on them. Every new shape compiles again."""

    what = "compiled decode step"
    off_switch = "compile: false"
    shared_positions = False  # inductor fuses the position arithmetic itself; dynamo need not trace the sharing

    def __init__(self):
        super().__init__()
        self.fn = torch.compile(decode_step, mode="reduce-overhead", dynamic=False)
        self.calls: dict[tuple, int] = {}
        self.widest = WIDTH_BUCKET

    def width(self, width: int) -> int:
        """A power of two, at least `WIDTH_BUCKET` and the widest so far: every new width is a new compilation."""
        self.widest = max(self.widest, 1 << max(0, width - 1).bit_length())
        return self.widest

    def _first_replay(self, shape: tuple) -> bool:
        self.calls[shape] = self.calls.get(shape, 0) + 1
        return self.calls[shape] == CHECK_CALL

    def _run(self, args: tuple, shape: tuple) -> torch.Tensor:
        # a new replay: the last step's logits (read by `next_token` already) may be overwritten
        torch.compiler.cudagraph_mark_step_begin()
        try:
            return self.fn(*args)
        except (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.InductorError) as err:
            raise Unrecorded(f"it did not compile ({_first_line(err)})") from err


Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]
"""Records a step: takes a function of no arguments that runs the step on fixed input buffers, returns a function
that replays the recording and the tensor each replay writes the step's output into."""


def cuda_graph_capture(step: Callable[[], torch.Tensor], pool=None) -> tuple[Callable[[], None], torch.Tensor]:
    """Record `step` as a CUDA graph, its temporaries in memory pool `pool`. It runs once first, on the side stream the
    capture then uses (lazy initialisation and that stream's cuBLAS workspace happen outside the recording), with
    synchronising operations made errors, so a step that reads the device fails there with a clear message rather
    than inside the capture.

    The capture is begun and ended directly rather than through `torch.cuda.graph`, whose entry empties the CUDA
    caching allocator (and the pinned host cache): once per rollout, that would hand every block the training step
    keeps cached back to the driver, and the step would allocate them again."""
    if torch.is_autocast_enabled("cuda"):
        raise RuntimeError("autocast is on: the weights' casts it caches would be freed under the recording")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(stream):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(mode)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        # other threads' CUDA calls (a data loader's pinned copies) do not invalidate this capture
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            out = step()
        except BaseException:
            with contextlib.suppress(RuntimeError):  # the capture is invalid anyway: report the step's error
                graph.capture_end()
            raise
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return graph.replay, out


class StepFusions:
    """What a recording of a patched policy changes in its decode step while `active`: the fused rotary and SwiGLU
    kernels taken (`fused_kernels.GRAPH_RECORDING`), the sibling projections merged into one matmul each where their
    weights fit (`merged_projections`; the merged weights live as long as this object, as long as the graph that
    reads them), and each residual add fused with the norm after it (`fused_residuals`)."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.merged = MergedProjections(model, merged_projections.budget(device))
        self.residuals = FusedResiduals(model)

    @contextlib.contextmanager
    def active(self):
        recording = fused_kernels.GRAPH_RECORDING.set(True)
        try:
            with self.merged.active(), self.residuals.active():
                yield
        finally:
            fused_kernels.GRAPH_RECORDING.reset(recording)


class Recording:
    """One recorded decode step: the input tensors it reads and the output it writes. Its inputs are the tensors of
    the call that recorded it, kept (not copied): `hf.decode_static` hands every step the same tensors, advanced in
    place, so a replay reads them where they lie, with no copy a token. A later call that hands other tensors has
    their values copied into those first. The weights and the static cache are read where they lie; with `fused`,
    the patched policy's step is recorded with its `StepFusions` (kept here, as long as the graph)."""

    def __init__(self, args: tuple, capture: Capture, fused: bool = False):
        model, token, mask, pos, cache, cache_position = args
        self.inputs = [token, mask, pos, cache_position]
        restore = _counters_restorer(cache)
        token_in, mask_in, pos_in, cache_position_in = self.inputs
        self.fusions = StepFusions(model, token.device) if fused else None
        # streams and graphs belong to the current device: the model's, also where another one is current
        on_device = torch.cuda.device(token.device) if token.is_cuda else contextlib.nullcontext()
        try:
            with on_device, self.fusions.active() if self.fusions else contextlib.nullcontext():
                if fused:  # the kernels compile for this step here, not under the capture's warm-up and its sync check
                    decode_step(model, token_in, mask_in, pos_in, cache, cache_position_in)
                    restore()
                self.replay, self.out = capture(
                    lambda: decode_step(model, token_in, mask_in, pos_in, cache, cache_position_in)
                )
        finally:  # the warm-up wrote this step's entries and advanced the counters; the replay does it again
            restore()

    def __call__(self, token, mask, pos, cache_position) -> torch.Tensor:
        for buffer, value in zip(self.inputs, (token, mask, pos, cache_position), strict=True):
            if value is not buffer:
                buffer.copy_(value)
        self.replay()
        return self.out


class GraphedDecodeStep(FixedShapeStep):
    """`rollout: {cuda_graphs: true}` (the default on a GPU): the eager decode step recorded as a CUDA graph and
    replayed for every token. A recording costs about two eager steps of host time and no compilation, so each
    rollout records its own (prompts at their own width, no padding to a bucket) and `release` frees its static cache
    and graph when the rollout ends: the training step that follows gets that memory back, and a model reloaded or
    moved between rollouts is simply recorded again. Optimizer steps between the tokens of one rollout do not happen.
    The first replay of each (rows, length) is checked against the eager step, once per process. `capture` records
    a step (by default `cuda_graph_capture`, each recording in a memory pool of its own)."""

    what = "CUDA-graph decode step"
    off_switch = "cuda_graphs: false"

    def __init__(self, capture: Capture | None = None):
        super().__init__()
        self.capture = capture
        self.recordings: dict[tuple[int, int, int], Recording] = {}
        self.checked: set[tuple[int, int]] = set()
        self.fused = True
        """Whether recordings of a patched policy take its `StepFusions` (fused rotary, SwiGLU and residual-add
        kernels, merged projections); off from the first recording with them that failed on."""

    def release(self) -> None:
        self.caches.clear()
        self.recordings.clear()

    def _first_replay(self, shape: tuple) -> bool:
        rows_length = (shape[1], shape[-1])
        first = rows_length not in self.checked
        self.checked.add(rows_length)
        return first

    def _run(self, args: tuple, shape: tuple) -> torch.Tensor:
        key = _recording_key(shape)
        recording = self.recordings.get(key)
        if recording is None:
            self.recordings.clear()  # one recording alive at a time
            recording = self.recordings[key] = self._record(args)
        _, token, mask, pos, _, cache_position = args
        return recording(token, mask, pos, cache_position)

    def _record(self, args: tuple) -> Recording:
        """A new recording of the step on `args`; a policy patched with the fused kernels has them recorded too,
        unless such a recording failed before (then, and from then on, it is recorded without them)."""
        model, token = args[0], args[1]
        if self.fused and takes_fused_kernels(model, token.device):
            try:
                return Recording(args, self._capture(), fused=True)
            except RuntimeError as err:
                self.fused = False
                log.warning(
                    "rollout: a CUDA-graph decode step with the fused kernels and merged projections could not be recorded "
                    "(%s); recordings leave them out from now on",
                    _first_line(err),
                )
        try:
            return Recording(args, self._capture())
        except RuntimeError as err:
            raise Unrecorded(f"it could not be recorded ({_first_line(err)})") from err

    def _capture(self) -> Capture:
        # Each recording gets a memory pool of its own. A pool id shared with a dropped graph is refused by the
        # allocator while that pool still holds blocks (an internal assert in `capture_begin`, seen on an H200 with
        # torch 2.11), and that failure leaves the CUDA generator in capture mode for the process.
        return self.capture or functools.partial(cuda_graph_capture, pool=torch.cuda.graph_pool_handle())

    def _forget(self, narrower: Callable[[tuple], bool]) -> None:
        self.recordings = {k: r for k, r in self.recordings.items() if not narrower(k)}


def takes_fused_kernels(model, device: torch.device) -> bool:
    """Whether `model`'s forwards on `device` take `fused_kernels`' rotary and SwiGLU kernels: a policy patched with
    them (`lean_activations`), on a device where they compile. Its multi-token forwards (a prefill) always do, its
    one-position steps while recorded (`fused_kernels.GRAPH_RECORDING`)."""
    return lean_activations.takes_fused_kernels(model) and fused_kernels.wanted(True, device)


def new_cache(model, length: int, shared_positions: bool = True):
    """An empty static KV cache of `length` positions for `model`'s decode loop: by default with the positions each
    forward writes at worked out once for all layers (`static_cache`, for a model on one device), else transformers'
    own `StaticCache`."""
    devices = {p.device for p in model.parameters()}
    if shared_positions and len(devices) == 1:
        return static_cache.static_cache(model.config, length, devices.pop())
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=length)


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def _recording_key(shape: tuple) -> tuple[int, int, int]:
    """(model, rows, length) of a step's (model, rows, 1, length) shape: the key of its cache and recording."""
    return shape[0], shape[1], shape[-1]


def _counters_restorer(cache) -> Callable[[], None]:
    """A function that puts the cache's write counters (`_cache_counters`) back to their values now."""
    counters = _cache_counters(cache)
    before = [c.clone() for c in counters]

    def restore() -> None:
        for counter, value in zip(counters, before, strict=True):
            counter.copy_(value)

    return restore


def _cache_counters(cache) -> list[torch.Tensor]:
    """The tokens-written counters of a static cache's layers (transformers 5's `StaticLayer.cumulative_length`, a
    device tensor each step advances in place and writes its entries at), where it keeps them."""
    layers = getattr(cache, "layers", None) or []
    counters = [c for layer in layers if isinstance(c := getattr(layer, "cumulative_length", None), torch.Tensor)]
    return list({id(c): c for c in counters}.values())  # layers writing at shared positions share one
