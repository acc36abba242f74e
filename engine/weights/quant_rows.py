"""The quant row counts measured on this machine, kept in the model folder.

A product of at most `quant_rows` input rows reads the weights' quant blocks; how many rows that
pays for depends on the CPU, the dtype, the thread count and what the products multiply
(`model.quant_inputs`), so it is timed once per machine (engine.model.linear.measure_quant_rows)
and kept by those in `quant_rows.json`. Workers that
start together and each time their own products do so against each other's memory traffic:
they measured 0-4 rows where one alone measures 32. `python -m engine`, which `launch.sh` runs
first and alone, measures once for all of them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from pathlib import Path

import torch

from core.config import QuantInputs
from engine.kernels.cpu.build import chosen_isa
from engine.kernels.cpu.sources import kernels_digest
from engine.kernels.isa import cpu_flags
from engine.weights.files import QUANT_ROWS_FILE

log = logging.getLogger(__name__)


class MeasuredQuantRows:
    """The row counts measured here for products of `inputs`, by dtype and thread count, in
    the model folder."""

    def __init__(self, folder: Path, inputs: QuantInputs = "exact") -> None:
        self.path = Path(folder) / QUANT_ROWS_FILE
        self.inputs = inputs

    def key(self, dtype_name: str) -> str:
        inputs = "" if self.inputs == "exact" else f"|inputs={self.inputs}"
        return (f"{dtype_name}|threads={torch.get_num_threads()}{inputs}|"
                f"{machine_fingerprint()}")

    def get(self, dtype_name: str) -> int | None:
        value = self._known().get(self.key(dtype_name))
        return value if isinstance(value, int) and value >= 0 else None

    def put(self, dtype_name: str, rows: int) -> None:
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
        try:
            partial.write_text(json.dumps({**self._known(), self.key(dtype_name): rows}, indent=1))
            partial.rename(self.path)
        except OSError as exc:  # a read-only model folder: every worker measures for itself
            log.warning("cannot keep the measured quant rows in %s: %s", self.path, exc)

    def _known(self) -> dict[str, object]:
        try:
            known = json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet, or damaged: measured again
            return {}
        return known if isinstance(known, dict) else {}


def machine_fingerprint() -> str:
    """What the measurement depends on besides dtype and threads: CPU, torch and kernels (and
    the level they run at)."""
    cpu = platform.processor() + "|" + ",".join(sorted(cpu_flags()))
    text = f"{cpu}|{torch.__version__}|{kernels_digest()}|{chosen_isa().name}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
