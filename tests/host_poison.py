"""A preload that leaves its process as one that initialised CUDA would (torch then says a fork of it is in a bad
fork): what `test_stage_host` gives a host that must refuse to serve."""

import torch

torch.cuda._is_in_bad_fork = lambda: True
