"""Run by tests under `torch.distributed.run` with two gloo ranks: `python ppo_ddp_check.py ASSETS OUT [lora]
[checkpointing]`. Each rank runs the tiny PPO of `support.run_ppo` (with a LoRA policy and activation checkpointing
where asked) with every control that acts on a batch's statistics switched on: adaptive KL, score scaling and
normalisation, early stopping, and the ratio threshold, which skips every micro-batch of rank 1 and none of rank 0.
Then it writes `OUT/rank<r>.json`: a digest of its policy's and value model's weights before and after, its KL
coefficient and the KLs that moved it, its running score moments, its early-stopping decisions and the prompts it
rolled out. Ranks that stay in step agree on all but the prompts."""

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from support import run_ppo  # tests/ is the script's folder, first on sys.path

from alignpipe.trainers import ppo

assets, out = Path(sys.argv[1]), Path(sys.argv[2])
made: dict[str, Any] = {"models": [], "kl": [], "moments": [], "prompts": []}


def digest(module) -> str:
    h = hashlib.sha256()
    for name, p in module.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Recorded(ppo.PolicyAndValue):
    def __init__(self, policy, value_model):
        super().__init__(policy, value_model)
        made["models"].append(self)
        made["start"] = digest(self)


class RecordedKL(ppo.KLController):
    def __init__(self, *args):
        super().__init__(*args)
        made["kl"].append(self)
        self.seen: list[float] = []

    def update(self, current, n_steps):
        self.seen.append(current)
        super().update(current, n_steps)


class RecordedMoments(ppo.RunningMoments):
    def __init__(self):
        super().__init__()
        made["moments"].append(self)


prompt_ids = ppo.prompt_ids


def recorded_prompts(tokenizer, rows, max_length):
    made["prompts"] += [r["prompt"] for r in rows]
    return prompt_ids(tokenizer, rows, max_length)


should_stop_early = ppo.should_stop_early


def recorded_stop(policy_kl, target_kl):
    made.setdefault("stops", []).append([policy_kl, should_stop_early(policy_kl, target_kl)])
    return made["stops"][-1][1]


rank = int(os.environ["RANK"])
ppo.PolicyAndValue, ppo.KLController, ppo.RunningMoments = Recorded, RecordedKL, RecordedMoments  # type: ignore[misc]
ppo.prompt_ids, ppo.should_stop_early = recorded_prompts, recorded_stop
# rank 1 finds every micro-batch over the threshold and rank 0 none: both must still take each optimizer step
ppo.ratio_exceeds = lambda ratio, mask, threshold: threshold is not None and rank == 1

# The value model's new head is drawn at load: the same draw every run, so a failure here can be run again
torch.manual_seed(0)
_, tracker, _ = run_ppo(
    assets,
    out / "run",
    learning_rate=3e-3,
    max_steps=3,
    num_ppo_epochs=3,
    kl_coef=0.2,
    adap_kl_ctrl=True,
    target=0.01,
    horizon=64,
    use_score_scaling=True,
    use_score_norm=True,
    ratio_threshold=1.02,
    early_stopping=True,
    target_kl=0.002,
    lora="lora" in sys.argv[3:],
    gradient_checkpointing="checkpointing" in sys.argv[3:],
)
result = {
    "start": made["start"],
    "end": digest(made["models"][0]),
    "kl_coef": made["kl"][0].value,
    "kl_seen": made["kl"][0].seen,
    "stops": made["stops"],
    "moments": made["moments"][0].state_dict(),
    "prompts": made["prompts"],
    "series": {k: tracker.series(k) for k in ("objective/kl_coef", "policy/ppo_epochs", "policy/skipped_batches")},
}
(out / f"rank{rank}.json").write_text(json.dumps(result))
sys.stdout.flush()
os._exit(0)  # no teardown: freeing DDP's reducer or the gloo group can wait forever on gloo's threads
