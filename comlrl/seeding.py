"""Seeding and capturing/restoring every random number generator the training uses."""

from __future__ import annotations

import random
from typing import Any

import numpy as np

# torch is imported where it is used: MAX_SEED is read by spec validation, which should not pay for torch.

# numpy's legacy seeding (np.random.seed) takes 0 <= seed < 2**32; torch and random take more, so this is the
# range of a seed every generator accepts. Configs refuse seeds outside it; derived seeds are folded into it.
MAX_SEED = 2**32 - 1


def set_seed(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators (0 <= seed <= MAX_SEED)."""
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and CUDA generator states, as tensors and plain numbers only
    (so the file loads with ``torch.load(..., weights_only=True)``)."""
    import torch

    version, internal, gauss = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    import torch

    python = state["python"]
    random.setstate((python["version"], tuple(int(x) for x in python["internal"].tolist()), python["gauss"]))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["position"],
            numpy_state["has_gauss"],
            numpy_state["cached"],
        )
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
