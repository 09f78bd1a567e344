"""What the training process pays to receive a batch collated in a loader worker, batch by batch or in one buffer:

    python -m bench.worker_batches [--case dpo/8x1024] [--batches 150] [--assets assets/tiny]

The batch is the case's first, collated as a GPU stage collates it (DPO and reward: padding-free with shared prompts;
SFT: packed rows, padding-free), then handed over by a `DataLoader` worker process again and again, either as
the collate returns it (each tensor its own shared-memory storage, rebuilt from its own file descriptor) or as one
`device_copies.OneBuffer` (what `common.batch_loader` hands over since session 49), unpacked as the loader's device
placement unpacks it. The worker stays ahead (the loop sleeps 10 ms between batches), so the figure is the receiving
side alone: on a GPU that is the loader's pin-memory thread, which shares the interpreter's lock with the step.
Both layouts run in one invocation, alternating, each in a loader of its own; medians in ms a batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from alignpipe.device_copies import OneBuffer


def collated(case_key: str, assets: str) -> dict:
    """The case's first batch, as the stage's collate lays it out on a GPU."""
    from alignpipe.modeling import load_tokenizer
    from alignpipe.trainers import dpo, reward, sft
    from bench.cases import find_case, rows

    tok = load_tokenizer(f"{assets}/model")
    case = find_case("qwen0.5b", case_key)
    data = rows(assets, case, steps=2, tokenizer=tok)
    n, longest = case.shape.per_step, 2 * case.shape.max_len
    if case.trainer == "dpo":
        return dpo.collate(dpo.tokenize(data[:n], tok, longest), tok.pad_token_id, longest, packed="shared")
    if case.trainer == "reward":
        return reward.collate(reward.tokenize(data[:n], tok, longest), tok.pad_token_id, "shared")
    if case.trainer != "sft":
        raise SystemExit(f"--case {case_key}: a dpo, reward or sft case")
    blocks = sft.pack(sft.tokenize(data, tok, case.shape.max_len, completion_only=True), case.shape.max_len)
    return sft.collate(blocks[:n], tok.pad_token_id, padding_free=True)


def receive_ms(batch: dict, one_buffer: bool, batches: int) -> list[float]:
    """ms the loop waits for each of `batches` handed-over batches (unpacked to tensors on the host)."""

    def hand_over(_):
        return OneBuffer.of(batch) if one_buffer else batch

    numbers = TensorDataset(torch.arange(batches + 1))  # what is handed over is `batch`, whatever the item
    loader = iter(DataLoader(numbers, batch_size=1, collate_fn=hand_over, num_workers=1, prefetch_factor=4))
    next(loader)
    time.sleep(1.0)  # the worker fills its queue
    out = []
    for _ in range(batches):
        time.sleep(0.01)
        start = time.perf_counter()
        got = next(loader)
        if one_buffer:
            got = got.to("cpu")
        out.append((time.perf_counter() - start) * 1e3)
    return out


def tensor_count(nest) -> int:
    if isinstance(nest, torch.Tensor):
        return 1
    if isinstance(nest, dict):
        nest = list(nest.values())
    return sum(tensor_count(x) for x in nest) if isinstance(nest, (list, tuple)) else 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--case",
        default="dpo/8x1024",
        help="a user-shape case key of a dpo, reward or sft case: dpo/8x1024, reward/8x1024, sft/8x2048",
    )
    ap.add_argument("--batches", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of both layouts")
    ap.add_argument("--assets", default="assets/tiny")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON line instead")
    args = ap.parse_args(argv)
    batch = collated(args.case, args.assets)
    figures: dict[str, list[float]] = {"tensors": [], "one_buffer": []}
    for _ in range(args.rounds):
        for layout in figures:
            figures[layout].append(statistics.median(receive_ms(batch, layout == "one_buffer", args.batches)))
    tensors = tensor_count(batch)
    nbytes = OneBuffer.of(batch).buffer.numel()
    if args.json:
        print(json.dumps({"case": args.case, "tensors": tensors, "bytes": nbytes, "median_ms": figures}))
        return
    print(f"{args.case}: a batch of {tensors} tensors, {nbytes / 1e6:.2f} MB in one buffer")
    for layout, ms in figures.items():
        print(f"  {layout:<11} ms a batch received (median, per round): {', '.join(f'{m:.2f}' for m in ms)}")


if __name__ == "__main__":
    main()
