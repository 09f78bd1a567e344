"""A training step's device work at a users' shape, counted on a CPU: the matrix products each side's step runs.

    python -m bench.device_work [TRAINER] [--side ours|trl|trl+liger | --compare] [--shape KEY] [--layers 2] [--steps 2]

TRAINER is `dpo` (default), `reward` or `sft`: a users' case of the GPU table (`bench.cases`: DPO and reward 8 pairs
of a ~256-token prompt and two ~720-token answers, SFT 8 packed rows of 2048, or with `--shape 4x4096` 4 of 4096),
on the data the GPU run makes,
with Qwen2-0.5B's widths and vocabulary and `--layers` (≥ 2) of its 24 decoder layers (bf16, random init). A step's time on
a GPU is the longer of its host work (`bench.host_work`) and its device work, and a training step's device work is
mostly its matrix products. Both sides compute the same loss, but not with the same products: a side that pads its
rows computes over the padding, a side that scores the prompt runs it once per answer, a chunked LM head that
recomputes its logits in backward runs four products a token where a head that takes its gradients in the forward
runs three. This counts them, with the paths a CUDA device takes opened as `bench.host_work` opens them (Triton
launches no-ops: Liger's and TRL's kernels are elementwise folds, ours' too; the products around them run in torch).

Counted by torch's `FlopCounterMode` over `--steps` optimizer steps after one warm-up step, each product where it ran:
- decoder: inside a decoder layer, scaled to 24 layers: every layer but the last runs the same products, so their
  mean counts 23 times, and the last once (a reward model's runs at the scored tokens alone: `alignpipe.last_layer`);
- rest: the LM head (or the reward model's score), wherever it runs: in the head's module or in a loss that takes
  its weight.
- attention: the products of attention itself (scores Q·Kᵀ and P·V), as the GPU's kernels run them, which the CPU
  stands in for with other kernels: counted at each attention call from its layout, a (query, key) pair costing
  2 · heads · head_dim FLOPs a product, two products forward and five backward (flash and memory-efficient
  attention recompute the scores in backward: Q·Kᵀ, then P, dO·Vᵀ, dS·K, dSᵀ·Q), a forward without gradients two.
  A document of the variable-length kernel (ours' packed rows, TRL's padding-free SFT blocks) runs its causal pairs
  (m queries over n ≥ m keys, aligned at the bottom right: m·(n − m) + m·(m + 1)/2; the tiles on the diagonal add
  a little more, not counted); a padded batch handed to SDPA with a mask (TRL's DPO and reward rows) runs every
  pair of its rows' square, padding and the causal upper half too (the memory-efficient kernel, the one that takes
  a mask, skips no tile); SDPA without a mask, its causal triangle.

Beside each count: the tokens the embedding took a step (policy and reference forwards, padding included), and the
model's products a step as the GPU table's MFU counts them (6·N a trained token, 2·N more for DPO's reference, N the
decoder's and head's parameters: every token through the whole model, once per answer), so a side's count under that
says it skips work the formula counts (scores only answers' tokens, runs a shared prompt once), over it that it does
more. `--compare` runs each side in a fresh process and prints one table, with how many times ours' products each
contender runs: the speed ratio ours would have if both sides ran their products equally fast. `--save
bench/device_counts.json` keeps the counts there by case and side, where `bench.profile` on a GPU finds them and
rates each side's matmul and attention kernels by them (TFLOP/s).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch

from bench.cases import QWEN_05B, Case, _user, row_lengths, rows, tokens_per_sample
from bench.host_work import compare, patched, sides_parser, train_side

TRAINERS = ("dpo", "reward", "sft")
LAYER = re.compile(r"\.layers\.(\d+)$")


def case_of(trainer: str, shape: str | None = None) -> Case:
    """The trainer's users' case of the GPU table with the shape key `shape` (`4x4096`), by default its first.
    SystemExit naming the trainer's shapes where it has no such one."""
    shapes = [Case(trainer, s) for s in _user(gpu=True)[trainer]]
    if shape is None:
        return shapes[0]
    for case in shapes:
        if case.shape.key == shape:
            return case
    raise SystemExit(f"--shape: {trainer} has no users' shape {shape!r} ({', '.join(c.shape.key for c in shapes)})")


def model(trainer: str, tok, layers: int):
    """Qwen2-0.5B's widths and vocabulary with `layers` decoder layers, bf16, random init (seeded); attention
    `varlen`, the GPU's default."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    from alignpipe.modeling import implementation

    cfg = Qwen2Config(
        **{**QWEN_05B, "num_hidden_layers": layers},
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    cfg.num_labels = 1
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        built = (Qwen2ForSequenceClassification if trainer == "reward" else Qwen2ForCausalLM)(cfg)
    finally:
        torch.set_default_dtype(default)
    built.set_attn_implementation(implementation("varlen"))
    return built


def _product_in_place(acc_shape, a_shape, b_shape, *_, **__) -> int:
    """`addmm_` (TRL's head accumulates its gradients so, on CPU): 2·m·k·n, as `addmm`."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


PRODUCT_LIKE = re.compile(r"mm|matmul|linear|dot|einsum|conv|mv")


def _counter(custom_mapping: dict):
    """A `FlopCounterMode` that also counts the product-like operators it has no formula for (a count that misses
    one would be short), attention's kernels apart (left out on purpose: the module's docstring)."""
    from torch.utils.flop_counter import FlopCounterMode

    class Counter_(FlopCounterMode):
        unformulated: Counter[str]

        def _count_flops(self, func_packet, out, args, kwargs):
            name = str(func_packet)
            if func_packet not in self.flop_registry and PRODUCT_LIKE.search(name) and "attention" not in name:
                self.unformulated[str(func_packet)] += 1
            return super()._count_flops(func_packet, out, args, kwargs)

    mode = Counter_(display=False, custom_mapping=custom_mapping)
    mode.unformulated = Counter()
    return mode


def causal_pairs(cu_q: list[int], cu_k: list[int]) -> int:
    """(query, key) pairs a causal variable-length kernel computes over the documents at offsets `cu_q` (queries) and
    `cu_k` (keys): m queries over n ≥ m keys, aligned at the bottom right, see m·(n − m) + m·(m + 1)/2."""
    pairs = 0
    for (a, b), (c, d) in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k), strict=True):
        m, n = b - a, d - c
        pairs += m * (n - m) + m * (m + 1) // 2
    return pairs


def padded_pairs(rows: int, queries: int, keys: int, masked: bool) -> int:
    """(query, key) pairs SDPA computes over `rows` padded rows: with a mask, every pair of the square (the kernel
    that takes a mask skips no tile); without one, causal, the triangle."""
    return rows * queries * keys if masked else rows * queries * (queries + 1) // 2


def attention_flops(pairs: int, heads: int, head_dim: int, trained: bool) -> int:
    """FLOPs of attention's products over `pairs` (query, key) pairs: two products forward (Q·Kᵀ, P·V), five more
    backward where it trains (the scores recomputed, then dV, dP, dQ, dK), 2 · head_dim FLOPs each a pair a head."""
    return (7 if trained else 2) * 2 * heads * head_dim * pairs


class Counting:
    """`tick`ed at the end of each optimizer step: counts the products of steps `first` + 1 … `first` + `steps`
    (`FlopCounterMode`, by module), attention's at each attention call (`_count_attention`), and the tokens each
    embedding took (with each forward's shape and whether it trained)."""

    def __init__(self, first: int, steps: int):
        self.edges = (first, first + steps)
        self.ticks = 0
        self.mode = _counter({torch.ops.aten.addmm_: _product_in_place})
        self.tokens = 0
        self.forwards: list[tuple[int, int, bool]] = []
        self.attention: Counter[str] = Counter()  # FLOPs by the innermost decoder layer running (or "rest")
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._patches = contextlib.ExitStack()

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks == self.edges[0]:
            self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._embedding_input)
            self._count_attention()
            self.mode.__enter__()
        elif self.ticks == self.edges[1]:
            self.mode.__exit__(None, None, None)
            if self._hook is not None:
                self._hook.remove()
            self._patches.close()

    def _embedding_input(self, module, args) -> None:
        if isinstance(module, torch.nn.Embedding):
            self.tokens += args[0].numel()
            self.forwards.append((*args[0].shape, torch.is_grad_enabled()))

    def _count_attention(self) -> None:
        """Wrap, until the counted steps end, the two places a training forward's attention runs on `varlen`
        (whatever stands in for them: `bench.host_work.gpu_paths`): the documents' kernel and SDPA's fallback for
        padded rows."""
        from transformers.integrations import sdpa_attention

        from alignpipe import attention

        documents, sdpa = attention._documents_attention, sdpa_attention.sdpa_attention_forward

        def counted_documents(q, k, v, cu_q, cu_k, *args):
            pairs = causal_pairs(cu_q.tolist(), cu_k.tolist())
            self._add(attention_flops(pairs, q.shape[1], q.shape[2], torch.is_grad_enabled() and q.requires_grad))
            return documents(q, k, v, cu_q, cu_k, *args)

        def counted_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
            rows, heads, length, dim = query.shape
            causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
            masked = attention_mask is not None or not causal or length == 1
            pairs = padded_pairs(rows, length, key.shape[2], masked)
            self._add(attention_flops(pairs, heads, dim, torch.is_grad_enabled() and query.requires_grad))
            return sdpa(module, query, key, value, attention_mask, *args, **kwargs)

        self._patches.enter_context(
            patched(
                {
                    (attention, "_documents_attention"): counted_documents,
                    (sdpa_attention, "sdpa_attention_forward"): counted_sdpa,
                }
            )
        )

    def _add(self, flops: int) -> None:
        layers = [name for name in self.mode.mod_tracker.parents if LAYER.search(name)]
        self.attention[max(layers, key=len) if layers else "rest"] += flops

    def counts(self, layers: int) -> dict:
        """(decoder products scaled to Qwen2-0.5B's depth, the rest), in FLOPs, and the operators by FLOPs: every
        layer but the last runs the same products, so their mean counts 23 times; the last (a reward model's runs at
        the scored tokens alone, `alignpipe.last_layer`) once. SystemExit if a product-like operator ran that the
        count has no formula for."""
        by_module = self.mode.get_flop_counts()
        total = sum(by_module["Global"].values())
        # policy and reference alike (their modules have the same names)
        per_layer = _per_layer(((name, sum(ops.values())) for name, ops in by_module.items()), layers)
        ops = {str(op).rsplit(".", 1)[-1]: n for op, n in by_module["Global"].items()}
        if self.mode.unformulated:
            raise SystemExit(f"products the count has no formula for: {dict(self.mode.unformulated)}")
        return {
            "decoder": _to_depth(per_layer),
            "rest": total - sum(per_layer),
            "attention": _to_depth(_per_layer(self.attention.items(), layers)) + self.attention["rest"],
            "by_operator": ops,
        }


def _per_layer(named: Iterable[tuple[str, float]], layers: int) -> list[float]:
    """The counts of modules named for a decoder layer (`LAYER`), summed by layer index; others left out."""
    per_layer = [0.0] * layers
    for name, flops in named:
        if found := LAYER.search(name):
            per_layer[int(found.group(1))] += flops
    return per_layer


def _to_depth(per_layer: list[float]) -> float:
    """A count per layer run, scaled to Qwen2-0.5B's depth: every layer but the last runs the same work, so their
    mean counts 23 times; the last (a reward model's runs at the scored tokens alone) once."""
    return sum(per_layer[:-1]) / (len(per_layer) - 1) * (QWEN_05B["num_hidden_layers"] - 1) + per_layer[-1]


def model_products(case: Case, config, tokens_a_step: float) -> float:
    """The step's products as the GPU table's MFU counts them (`bench.cases.train_flops_per_token`), attention left
    out: (6, + 2 for DPO's reference) · N a token, N the decoder's matrices over Qwen2-0.5B's 24 layers and the LM
    head's (none for the reward model)."""
    d, inter = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (d // config.num_attention_heads)
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * inter  # q, o; k, v; gate, up, down
    n = QWEN_05B["num_hidden_layers"] * per_layer + (0 if case.trainer == "reward" else config.vocab_size * d)
    return (8 if case.trainer == "dpo" else 6) * n * tokens_a_step


def run(
    trainer: str, side: str, layers: int, steps: int, assets: str, shrink: bool = False, shape: str | None = None
) -> dict:
    """Train the users' case of `trainer` (`shape`: `case_of`) on `side` for one warm-up step and `steps` counted
    ones: the counts a step, in FLOPs. `shrink`: the case shrunk as `bench.liger_cpu` shrinks it, on
    `bench.host_work`'s 64-wide stand-in with the tokenizer's vocabulary (seconds, for tests: the structure of the
    counts, not their size)."""
    from alignpipe.modeling import load_tokenizer
    from bench import host_work, liger_cpu

    tok = load_tokenizer(f"{assets}/model")
    case = liger_cpu.shrunk(case_of(trainer, shape)) if shrink else case_of(trainer, shape)
    total = 1 + steps
    data = rows(assets, case, total, tok)
    counting = Counting(1, steps)
    built = host_work.model(trainer, tok, layers, 64) if shrink else model(trainer, tok, layers)
    train_side(side, case, built, tok, data, total, counting)
    if counting.ticks < total:
        raise SystemExit(f"{case.key} ({side}) ran {counting.ticks} optimizer steps of {total}")
    got = counting.counts(layers)
    tokens_a_step = tokens_per_sample(case, row_lengths(assets, case, tok)) * case.shape.per_step
    return {
        "trainer": trainer,
        "side": side,
        "case": case.key + (" shrunk" if shrink else ""),
        "layers_run": layers,
        "decoder": got["decoder"] / steps,
        "rest": got["rest"] / steps,
        "total": (got["decoder"] + got["rest"]) / steps,
        "model": model_products(case, built.config, tokens_a_step),
        "attention": got["attention"] / steps,
        "tokens": counting.tokens / steps,
        "forwards": counting.forwards,
        "by_operator": {op: n / steps for op, n in sorted(got["by_operator"].items())},
    }


COUNTS = Path(__file__).with_name("device_counts.json")


def save(runs: list[dict], path: Path = COUNTS) -> None:
    """Keep `runs`' counts a step (FLOPs: decoder, rest, attention; tokens embedded) in `path` by case and side, beside
    the cases already there, for `bench.profile` to rate a GPU step's kernels by."""
    kept = json.loads(path.read_text()) if path.exists() else {}
    for r in runs:
        fields = ("decoder", "rest", "total", "attention", "tokens", "layers_run")
        kept.setdefault(r["case"], {})[r["side"]] = {k: r[k] for k in fields}
    path.write_text(json.dumps(dict(sorted(kept.items())), indent=1) + "\n")


def _tflop(flops: float) -> str:
    return f"{flops / 1e12:.3g}"


def table(runs: list[dict]) -> str:
    """The sides' counts as one markdown table: a row a side, and how many times ours' products each runs."""
    ours = next((r for r in runs if r["side"] == "ours"), runs[0])
    lines = [
        f"{ours['case']}, Qwen2-0.5B's 24 layers (products counted on {ours['layers_run']}, scaled): TFLOP of "
        f"products a step; the MFU formula's {_tflop(ours['model'])}, attention left out; attention's products as "
        "the GPU's kernels run them apart",
        "",
        "| side | decoder | LM head and the rest | all | of the formula's | of ours' | attention | all with attention "
        "| of ours' | tokens embedded |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        whole, ours_whole = r["total"] + r["attention"], ours["total"] + ours["attention"]
        lines.append(
            f"| {r['side']} | {_tflop(r['decoder'])} | {_tflop(r['rest'])} | {_tflop(r['total'])} "
            f"| {r['total'] / r['model']:.2f} | {r['total'] / ours['total']:.2f}× | {_tflop(r['attention'])} "
            f"| {_tflop(whole)} | {whole / ours_whole:.2f}× | {r['tokens']:,.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = sides_parser("python -m bench.device_work", __doc__, TRAINERS)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers run (of Qwen2-0.5B's 24; at least 2)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps counted, after one warm-up step")
    parser.add_argument("--assets", default=str(Path(__file__).resolve().parents[1] / "assets" / "tiny"))
    parser.add_argument(
        "--shape", help="the users' shape of the trainer (`4x4096` for SFT's second; default: its first)"
    )
    parser.add_argument("--shrink", action="store_true", help="the case shrunk, on a 64-wide model (for tests)")
    parser.add_argument(
        "--save", metavar="FILE", help=f"keep the counts by case and side in FILE (bench/{COUNTS.name})"
    )
    args = parser.parse_args(argv)
    if args.layers < 2:
        parser.error("--layers: at least 2 (the last layer is counted apart from the others)")
    case_of(args.trainer, args.shape)  # an unknown shape stops here, before any side runs
    if args.compare:
        runs = compare("bench.device_work", argv)  # each side's process keeps its own counts (`--save`), in turn
        print(json.dumps(runs) if args.json else table(runs))
        return
    got = run(args.trainer, args.side, args.layers, args.steps, args.assets, args.shrink, args.shape)
    if args.save:
        save([got], Path(args.save))
    if args.json:
        print(json.dumps(got))
        return
    print(table([got]))
    by_operator = ", ".join(f"{op} {_tflop(n)}" for op, n in got["by_operator"].items())
    print(f"products by operator, TFLOP a step (the decoder's over the {args.layers} layers run): {by_operator}")


if __name__ == "__main__":
    main()
