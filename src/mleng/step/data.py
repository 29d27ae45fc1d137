"""Token batches for `mleng step`: a learnable synthetic pattern made on the device, or a local file of token ids.

Sequence i of step s is the same whatever the number of ranks: each rank takes its slice of the step's global
batch, so one process with the whole batch sees exactly what N ranks see together (the DDP/FSDP loss tests
rely on it).
"""

from __future__ import annotations

import math
from pathlib import Path

from mleng.errors import UsageError

TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")


class SyntheticTokens:
    """Each sequence starts at a random token and steps by a fixed stride (coprime with the vocabulary):
    next = (current + stride) mod V. Random starts keep every token id in use (matmul speed does not depend
    on the values; zeros or constants are still avoided), and the pattern is learnable, so a falling loss
    shows the step really trains."""

    kind = "synthetic"

    def __init__(self, vocab_size: int, seq_len: int, device, seed: int = 0):
        import torch

        self.vocab_size, self.seq_len, self.device, self.seed = vocab_size, seq_len, device, seed
        stride = 1 + (seed * 7919 + 12345) % max(vocab_size - 1, 1)
        while math.gcd(stride, vocab_size) != 1:
            stride += 1
        self.stride = stride
        self._positions = torch.arange(seq_len + 1, device=device) * stride

    def describe(self) -> dict:
        return {"kind": self.kind, "pattern": f"next = (token + {self.stride}) mod {self.vocab_size}, random starts"}

    def batch(self, step: int, first: int, count: int, global_batch: int):
        import torch

        # Drawn on the device: a host-to-device copy here would stall the host at every micro-batch.
        generator = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.vocab_size, (global_batch,), generator=generator,
                               device=self.device)[first:first + count]
        tokens = (starts[:, None] + self._positions[None, :]) % self.vocab_size
        return tokens[:, :-1], tokens[:, 1:]


class FileTokens:
    """Windows of seq_len + 1 token ids read from a numpy memmap: a .npy file (its dtype from the header),
    or a raw binary file of --tokens-dtype ids (nanoGPT's .bin files are uint16)."""

    kind = "file"

    def __init__(self, path: str, dtype: str, vocab_size: int, seq_len: int, global_batch: int, device):
        import numpy as np

        file = Path(path).expanduser()
        if not file.is_file():
            raise UsageError(f"--tokens {path}: no such file" if not file.exists() else f"--tokens {path} is not a file")
        try:
            if file.suffix == ".npy":
                array = np.load(file, mmap_mode="r")
            else:
                if dtype not in TOKEN_DTYPES:
                    raise UsageError(f"--tokens-dtype {dtype!r}; known: {', '.join(TOKEN_DTYPES)}")
                itemsize = np.dtype(dtype).itemsize
                if file.stat().st_size % itemsize:
                    raise UsageError(f"--tokens {path}: {file.stat().st_size} bytes is not a whole number of "
                                     f"{dtype} ids", hint="pass the --tokens-dtype the file was written with")
                array = np.memmap(file, dtype=dtype, mode="r")
        except UsageError:
            raise
        except (OSError, ValueError) as exc:
            raise UsageError(f"--tokens {path}: cannot read it as token ids ({exc})") from None
        if array.ndim != 1:
            array = array.reshape(-1)
        if array.dtype.kind not in "iu":
            raise UsageError(f"--tokens {path} holds {array.dtype} values, not integer token ids")
        window = seq_len + 1
        self.windows = len(array) // window
        if self.windows < global_batch:
            raise UsageError(f"--tokens {path} is too short: {len(array)} tokens make {self.windows} "
                             f"sequence{'s' if self.windows != 1 else ''} of "
                             f"{window} (--seq {seq_len} + 1), and one step needs {global_batch}",
                             hint=f"give at least {global_batch * window} tokens, or a smaller --seq or batch")
        self.path, self.array, self.window = str(file), array, window
        self.vocab_size, self.seq_len, self.device = vocab_size, seq_len, device

    def describe(self) -> dict:
        return {"kind": self.kind, "path": self.path, "dtype": str(self.array.dtype), "tokens": int(len(self.array)),
                "sequences": self.windows}

    def check_batch(self, step: int, global_batch: int) -> None:
        """The ids of one step's sequences, checked without torch (the CLI does it before any rank starts)."""
        self._rows(step, 0, global_batch, global_batch)

    def _rows(self, step: int, first: int, count: int, global_batch: int):
        import numpy as np

        index = (step * global_batch + first + np.arange(count)) % self.windows
        rows = np.stack([self.array[i * self.window:(i + 1) * self.window] for i in index]).astype(np.int64)
        top = int(rows.max())
        if top >= self.vocab_size or int(rows.min()) < 0:
            raise UsageError(f"--tokens {self.path}: token id {top if top >= self.vocab_size else int(rows.min())} "
                             f"is outside the model's vocabulary (0..{self.vocab_size - 1})",
                             hint="the file was made by another tokenizer, or --tokens-dtype is wrong")
        return rows

    def batch(self, step: int, first: int, count: int, global_batch: int):
        import torch

        host = torch.from_numpy(self._rows(step, first, count, global_batch))
        if str(self.device).startswith("cuda"):
            host = host.pin_memory()
        tokens = host.to(self.device, non_blocking=True)
        return tokens[:, :-1], tokens[:, 1:]
