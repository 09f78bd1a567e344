"""The load-balancing loss of Mixture-of-Experts models (Switch Transformer's; TRL's `router_aux_loss_coef`).

transformers computes it inside a causal LM's forward from every MoE layer's router logits. The trainers here run
the decoder stack and the LM head themselves (chunked and fused heads, shared prompts, padding-free rows), so no
forward of theirs returns it. `RouterLoss` records it instead: while `recording()` is open, a hook on each router
(the modules transformers itself records, `_can_record_outputs["router_logits"]`) keeps that call's logits and
which of its tokens are real, and `take()` turns them into the loss with the sums of transformers'
`load_balancing_loss_func`, so one forward gives its value exactly (tested); several forwards in one recording (a
shared prompt, then its completions) count each token they run once.

Only forwards with gradients are recorded: a LoRA policy's reference pass (its adapter disabled, under `no_grad`),
old log-probs and evaluation are not, and neither is activation checkpointing's recomputation in backward, which
runs after the recording closes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import cast

import torch

log = logging.getLogger(__name__)


class RouterLoss:
    """The load-balancing loss of one MoE model's training forwards, weighted by `coef`."""

    def __init__(
        self, body: torch.nn.Module, routers: list[tuple[torch.nn.Module, int]], experts: int, top_k: int, coef: float
    ):
        self.body, self.routers, self.experts, self.top_k, self.coef = body, routers, experts, top_k, coef
        self._candidates: tuple[torch.Tensor, ...] = ()
        self._mask: torch.Tensor | None = None
        self._calls: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    @classmethod
    def of(cls, model, coef: float | None, compiled: bool = False) -> RouterLoss | None:
        """The model's load-balancing loss at `coef` (None: its config's `router_aux_loss_coef`), or None where
        there is none to add: a dense model, or a coefficient of 0. A non-zero `coef` on a dense model fails, as
        it does in TRL, and so does an MoE loss under `compile` (its hooks would sit inside compiled layers)."""
        base = _causal_lm(model)
        config = base.config.get_text_config()
        moe = hasattr(config, "output_router_logits")
        if coef and not moe:
            raise ValueError(
                f"router_aux_loss_coef is {coef}, but {type(base).__name__} is not a Mixture-of-Experts model, so "
                "there is no load-balancing loss to weight; remove router_aux_loss_coef from the stage"
            )
        weight = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if coef is None else float(coef)
        if not moe or weight == 0.0:
            return None
        if compiled:
            raise ValueError(
                f"{type(base).__name__} is a Mixture-of-Experts model trained with its load-balancing loss "
                f"(router_aux_loss_coef {weight}), which is recorded from its routers and cannot be under `compile: "
                "true`; set compile: false, or router_aux_loss_coef: 0 to train without the loss"
            )
        body = base.get_decoder() if hasattr(base, "get_decoder") else base.model
        routers = _routers(body)
        experts = getattr(base, "num_experts", None) or getattr(config, "num_local_experts", None)
        top_k = getattr(base, "num_experts_per_tok", None) or getattr(config, "num_experts_per_tok", None)
        if not routers or not experts or not top_k:
            raise ValueError(
                f"{type(base).__name__} declares a load-balancing loss, but its routers or its numbers of experts "
                "could not be found; set router_aux_loss_coef: 0 to train it without the loss"
            )
        loss = cls(body, routers, int(experts), int(top_k), weight)
        log.info(
            "%s: the routers' load-balancing loss is added at %g (%s; router_aux_loss_coef: 0 turns it off)",
            type(base).__name__, weight, "the model's own" if coef is None else "router_aux_loss_coef",
        )  # fmt: skip
        return loss

    @contextlib.contextmanager
    def recording(self, *masks: torch.Tensor) -> Iterator[None]:
        """Record the routers of the forwards run inside. Each forward's tokens are weighed by the first of `masks`
        with its (rows, length) shape (1 a real token, 0 padding), else by its own 2-D `attention_mask` (the last
        `length` columns, when it also covers a KV cache), else all count."""
        self._candidates = masks
        handles = [self.body.register_forward_pre_hook(self._tokens, with_kwargs=True)]
        handles += [module.register_forward_hook(self._route(index)) for module, index in self.routers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._candidates, self._mask = (), None

    def take(self) -> torch.Tensor:
        """The unweighted loss of what was recorded since the last `take` (0 if nothing was), and start again."""
        calls, self._calls = self._calls, []
        if not calls:
            return torch.zeros(())
        counts, probs, rows = (sum(parts) for parts in zip(*(self._sums(logits, mask) for logits, mask in calls)))
        return (counts / rows * probs / rows).sum() * self.experts

    def _tokens(self, _module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        shape = tuple(ids.shape[:2]) if ids is not None else tuple(kwargs["inputs_embeds"].shape[:2])
        mask = next((m for m in self._candidates if tuple(m.shape) == shape), None)
        given = kwargs.get("attention_mask")
        if mask is None and isinstance(given, torch.Tensor) and given.dim() == 2 and given.size(0) == shape[0]:
            mask = given[:, -shape[1] :]
        self._mask = None if mask is None else mask.reshape(-1)

    def _route(self, index: int):
        # Only the logits are kept here: work done in the hook would be missing when activation checkpointing runs
        # the layer again in backward (the hook is gone by then), and torch refuses a recomputation that saves
        # fewer tensors than the forward did.
        def hook(_module, _args, output) -> None:
            if not torch.is_grad_enabled():
                return
            logits = output[index] if isinstance(output, tuple | list) else output
            logits = logits.reshape(-1, logits.size(-1))
            mask = self._mask if self._mask is not None and self._mask.numel() == logits.size(0) else None
            self._calls.append((logits, mask))

        return hook

    def _sums(self, logits: torch.Tensor, mask: torch.Tensor | None):
        """(expert counts, router probability sums, tokens) of one router call, as `load_balancing_loss_func` sums a
        layer (softmax in the logits' dtype, its top-k, float32 sums; `mask` 1 for the tokens that count)."""
        weights = torch.softmax(logits, dim=-1)
        chosen = torch.topk(weights, self.top_k, dim=-1).indices.reshape(-1)
        counts = torch.zeros(self.experts, dtype=torch.float32, device=logits.device)
        if mask is None:
            counts.scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
            return counts, weights.float().sum(0), float(logits.size(0))
        mask = mask.to(device=logits.device, dtype=torch.float32)
        counts.scatter_add_(0, chosen, mask.repeat_interleave(self.top_k))
        return counts, (weights.float() * mask[:, None]).sum(0), mask.sum()


class RouterTotals:
    """One optimizer step's MoE loss, micro-batch by micro-batch: `term(share)` is coef × the loss recorded since
    the last call × `share` (what a micro-batch adds to its loss: 0 without a router loss); `weighted` sums the
    terms, and `metrics()` gives `aux_loss`, the unweighted loss averaged the same way (nothing without one)."""

    def __init__(self, router: RouterLoss | None, device: torch.device):
        self.router = router
        self.weighted = torch.zeros((), device=device)
        self.raw = torch.zeros((), device=device)

    def term(self, share: float) -> torch.Tensor | float:
        if self.router is None:
            return 0.0
        loss = self.router.take().to(self.raw.device)
        self.raw += loss.detach() * share
        term = self.router.coef * share * loss
        self.weighted += term.detach()
        return term

    def metrics(self) -> dict[str, torch.Tensor]:
        return {"aux_loss": self.raw} if self.router is not None else {}

    def into(self, metrics: dict) -> dict:
        """`metrics` with the step's MoE term added to its `loss` (TRL logs the sum) and `aux_loss` beside it."""
        if self.router is not None:
            metrics["loss"] = metrics["loss"] + self.weighted
            metrics["aux_loss"] = self.raw
        return metrics


def recording(router: RouterLoss | None, *masks: torch.Tensor):
    """`router.recording(*masks)`, or nothing to record."""
    return router.recording(*masks) if router is not None else contextlib.nullcontext()


def answer_masks(prompt_mask: torch.Tensor, completion_mask: torch.Tensor, index: torch.Tensor) -> tuple:
    """The real-token masks of a forward over answers to prompts (`logprobs.shared_prompt_logprobs`'s layout: row r
    answers prompt `index[r]`): the answers alone (R, C), as a run after a shared prompt sees them, and every
    prompt + answer row whole (R, P + C). A shared prompt's own run weighs its tokens by its attention mask."""
    completion_mask = completion_mask.to(prompt_mask.dtype)
    return completion_mask, torch.cat([prompt_mask[index], completion_mask], 1)


def _causal_lm(model):
    """The causal LM under a DDP, FSDP or peft wrapper."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def _routers(body: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """The modules whose output (at an index) transformers records as `router_logits`."""
    spec = getattr(body, "_can_record_outputs", None) or {}
    spec = spec.get("router_logits")
    if spec is None:
        return []
    target = getattr(spec, "target_class", spec)
    index = getattr(spec, "index", None) or 0
    name = getattr(spec, "layer_name", None)
    if not isinstance(target, type):
        return []
    found: list[tuple[torch.nn.Module, int]] = []
    for path, module in body.named_modules():
        if isinstance(module, target) and (name is None or name in path):
            found.append((cast(torch.nn.Module, module), int(index)))
    return found
