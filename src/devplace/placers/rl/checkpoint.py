"""Policy checkpoints: a trained placeto policy as tensors and plain settings, loadable with
`torch.load(weights_only=True)` (no arbitrary unpickling).

Format `devplace.policy/1`, a dict: `format`, `placer` ("placeto"), `encoder` (its name; checkpoints written
before the encoder was named `placeto-gnn` say "placeto", read as the same), `hidden`, `rounds`,
`num_features`, `num_devices`, `state_dict` (the policy's tensors) and, for resuming a training run,
`training` (optional): a dict of tensors, numbers and strings written by `devplace.placers.rl.trainer`.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from devplace.defaults import ENCODERS, MAX_DEVICES, MAX_HIDDEN, MAX_ROUNDS, encoder_name
from devplace.files import CHECKPOINT, output_file, read_limited
from devplace.placers.registry import PlacerError
from devplace.placers.rl.placeto import PlacetoPolicy

FORMAT = "devplace.policy/1"
MAX_FEATURES = 10_000  # node features a policy reads (devplace's have a few dozen): a larger count is damage


class PolicyFileError(PlacerError):
    """A policy checkpoint that cannot be read or does not fit the graph and cluster."""


def save_policy(path: str | Path, policy: PlacetoPolicy, training: dict[str, Any] | None = None) -> Path:
    """Write `policy` (and, to resume a run, the `training` state) to `path`; returns the path."""
    doc: dict[str, Any] = {"format": FORMAT, "placer": "placeto", "encoder": policy.encoder, "hidden": policy.hidden,
                           "rounds": policy.rounds, "num_features": policy.num_features,
                           "num_devices": policy.num_devices,
                           "state_dict": {k: v.detach().clone() for k, v in policy.state_dict().items()}}
    if training is not None:
        doc["training"] = training
    path = Path(path)
    with output_file(path, "--output", CHECKPOINT, binary=True) as fh:
        torch.save(doc, fh)
    return path


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint dict at `path`, checked for its format; PolicyFileError when it is not one."""
    path = Path(path)
    if not path.exists():
        raise PolicyFileError(f"no policy file {path}; train one with `devplace train ... -o {path}`")
    data = io.BytesIO(read_limited(path))
    try:
        doc = torch.load(data, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises many kinds of error on a file that is not a checkpoint
        # torch's message for a refused object starts with advice to retry with weights_only=False, which
        # would run the file's code: keep only the paragraphs that say what was refused
        paragraphs = [" ".join(p.split()) for p in str(exc).split("\n\n") if p.strip()]
        reasons = [p for p in paragraphs if "weights_only" not in p]
        why = f"{type(exc).__name__}: {reasons[0]}" if reasons else type(exc).__name__
        raise PolicyFileError(f"{path} is not a devplace policy checkpoint, refused without running any of its "
                              f"code (it holds more than tensors and plain values, or is damaged: {why})") from None
    if not isinstance(doc, dict) or "format" not in doc:
        raise PolicyFileError(f"{path} is not a devplace policy checkpoint (no 'format' key)")
    if doc["format"] != FORMAT:
        raise PolicyFileError(f"{path}: unknown policy format {doc['format']!r}; this devplace reads {FORMAT!r}")
    missing = [k for k in ("encoder", "hidden", "rounds", "num_features", "num_devices", "state_dict") if k not in doc]
    if missing or not isinstance(doc["encoder"], str) or encoder_name(doc["encoder"]) not in ENCODERS:
        raise PolicyFileError(f"{path}: damaged policy checkpoint (missing or bad: {', '.join(missing) or 'encoder'})")
    for key, high in (("hidden", MAX_HIDDEN), ("rounds", MAX_ROUNDS), ("num_features", MAX_FEATURES),
                      ("num_devices", MAX_DEVICES)):
        _check_int(doc[key], f"{path}: field {key!r}", 1, high)
    _check_tensors(doc["state_dict"], f"{path}: field 'state_dict'")
    training = doc.get("training")
    if training is not None:
        if not isinstance(training, dict):
            raise PolicyFileError(f"{path}: field 'training' must be the training state (an object), got "
                                  f"{type(training).__name__}; the checkpoint is damaged")
        _check_int(training.get("episodes_done", 0), f"{path}: field 'training.episodes_done'", 0, 2**62)
        if not isinstance(training.get("optimizer") or {}, dict):
            raise PolicyFileError(f"{path}: field 'training.optimizer' must be an optimizer state (an object); the "
                                  "checkpoint is damaged")
        for key in ("best", "baselines"):
            _check_tensors(training.get(key, {}), f"{path}: field 'training.{key}'")
    return doc


def _check_int(value: Any, what: str, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise PolicyFileError(f"{what} must be a whole number from {low} to {high:,}, got {value!r:.60}; the "
                              "checkpoint is damaged or was not written by devplace")


def _check_tensors(value: Any, what: str) -> None:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(t, torch.Tensor)
                                              for k, t in value.items()):
        raise PolicyFileError(f"{what} must map names to tensors, got {type(value).__name__}; the checkpoint is "
                              "damaged or was not written by devplace")


def load_policy(path: str | Path, *, num_devices: int | None = None) -> tuple[PlacetoPolicy, dict[str, Any]]:
    """The policy saved at `path` and its checkpoint dict. With `num_devices`, a policy trained for another
    number of devices is refused (its output layer has one logit per device)."""
    doc = read_checkpoint(path)
    if num_devices is not None and int(doc["num_devices"]) != num_devices:
        raise PolicyFileError(f"{path}: the policy was trained for {doc['num_devices']} devices, the cluster has "
                              f"{num_devices}; train one for this cluster (`devplace train --cluster ...`)")
    policy = PlacetoPolicy(int(doc["num_features"]), int(doc["num_devices"]), int(doc["hidden"]), int(doc["rounds"]),
                           str(doc["encoder"]))
    try:
        policy.load_state_dict(doc["state_dict"])
    except RuntimeError as exc:
        raise PolicyFileError(f"{path}: the tensors do not match the policy's settings ({str(exc).splitlines()[0]})") \
            from None
    return policy, doc
