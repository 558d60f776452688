"""Shared by the training scripts: the device a CUDA script picks, and its report.

Each script is an ordinary CUDA training script: it trains on "cuda" when
``torch.cuda.is_available()`` (true under ``djinn run``) and on "cpu" otherwise, prints
nothing special, and saves its losses and final parameters with ``torch.save``.
"""

import sys

import torch

device = "cuda" if torch.cuda.is_available() else "cpu"


def report(losses: list[float], model: torch.nn.Module) -> None:
    torch.save({"losses": losses, "params": model.state_dict()}, sys.argv[1])
