"""One thin Prefect task per stage kind. Each launches the stage process and returns its manifest."""

from tasks.dpo import dpo_task
from tasks.format import format_task
from tasks.grpo import grpo_task
from tasks.judge import judge_task
from tasks.ppo import ppo_task
from tasks.push import push_task
from tasks.reward import reward_task
from tasks.sft import sft_task

TASKS = {"format": format_task, "sft": sft_task, "reward": reward_task, "dpo": dpo_task, "grpo": grpo_task,
         "ppo": ppo_task, "judge": judge_task, "push": push_task}

__all__ = ["TASKS", "dpo_task", "format_task", "grpo_task", "judge_task", "ppo_task", "push_task", "reward_task", "sft_task"]
