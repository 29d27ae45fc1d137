"""mleng in a Hugging Face `Trainer`: the preflight at train start and the crash hook (pip install 'mleng[hf]')."""

from __future__ import annotations

from typing import Any

from mleng.integrations._common import MlengCallbackOptions, require

_transformers = require("transformers", "hf", "mleng.integrations.hf")
require("accelerate", "hf", "mleng.integrations.hf (the Trainer runs on accelerate)")

__all__ = ["MlengCallback"]


class MlengCallback(MlengCallbackOptions, _transformers.TrainerCallback):
    """A `transformers.TrainerCallback`: the crash hook from the Trainer's creation on, `mleng.preflight()` at
    train start on every rank, in the process group the Trainer (accelerate) made; its own fail-fast one when
    there is none, and its single-process checks in a plain run. A failed check raises mleng.PreflightError
    on every rank out of `trainer.train()`, before the first step.

    preflight / install_crash_hook: turn either off. timeout, max_seconds and the other keywords
    (probe_bytes, straggler_ratio, backend, quiet, no_store) are `mleng.preflight()`'s. After the preflight,
    `callback.record` is rank 0's record (None on the other ranks).

    Example (train.py, run as `python train.py` or `torchrun --nproc_per_node 8 train.py`):
        >>> from mleng.integrations.hf import MlengCallback
        >>> trainer = Trainer(model=model, args=args, train_dataset=data,
        ...                   callbacks=[MlengCallback(max_seconds=10)])
        >>> trainer.train()   # rank 0 prints the preflight summary, then training starts
    """

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._install_hook()  # a crash while the trainer is being set up is explained too

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._start()
