"""alignpipe: declarative RLHF pipelines (format → SFT → reward → PPO/DPO/GRPO → judge → push) on Prefect."""

__version__ = "0.1.0"
