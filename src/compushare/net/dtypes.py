"""The dtypes a tensor may have on the wire, by name, with the numpy dtype of its raw
bytes. Torch-free, so that code checking wire bytes (proofs, karma) does not pull
torch into seed-only processes; net/tensors.py pairs these with torch's dtypes."""

from __future__ import annotations

import numpy as np

WIRE_NUMPY_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<i2"),  # numpy has no bfloat16: its bytes travel as int16
}
