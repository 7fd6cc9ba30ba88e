"""Learned placers (reinforcement learning): `placeto` (and `seq2seq` in `devplace.placers.seq2seq`), training
one placeto policy over a family of graphs (`train`), policy checkpoints and learning curves."""

from devplace.placers.rl.checkpoint import load_policy, save_policy
from devplace.placers.rl.trainer import TrainResult, train

__all__ = ["TrainResult", "load_policy", "save_policy", "train"]
