"""mleng in a Lightning `Trainer`: the preflight at fit start and the crash hook (pip install 'mleng[lightning]').

Built on `lightning.pytorch` when it is installed, else on the older `pytorch_lightning` name (either
Trainer calls the hooks of a callback in its list, whichever of the two it subclasses).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from mleng.integrations._common import MlengCallbackOptions, require

_framework = require("lightning.pytorch" if importlib.util.find_spec("lightning") or
                     not importlib.util.find_spec("pytorch_lightning") else "pytorch_lightning",
                     "lightning", "mleng.integrations.lightning")

__all__ = ["MlengCallback"]


class MlengCallback(MlengCallbackOptions, _framework.Callback):
    """A Lightning `Callback`: in `setup` the crash hook, and for `fit` `mleng.preflight()` on every rank, in
    the process group the strategy has just made (DDP under torchrun or srun), before the model is wrapped
    and the data loaded; its own fail-fast group when there is none, its single-process checks in a plain
    run. A failed check raises mleng.PreflightError on every rank out of `trainer.fit()`.

    preflight / install_crash_hook: turn either off. timeout, max_seconds and the other keywords
    (probe_bytes, straggler_ratio, backend, quiet, no_store) are `mleng.preflight()`'s. After the preflight,
    `callback.record` is rank 0's record (None on the other ranks).

    Example (train.py, run as `python train.py` or `torchrun --nproc_per_node 8 train.py`):
        >>> import lightning.pytorch as pl
        >>> from mleng.integrations.lightning import MlengCallback
        >>> trainer = pl.Trainer(max_steps=1000, callbacks=[MlengCallback(max_seconds=10)])
        >>> trainer.fit(module, data)   # rank 0 prints the preflight summary, then training starts
    """

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._start()
        else:
            self._install_hook()
