"""The CPU's vector instruction sets, probed once per host instead of once per process and folder.

Before inductor generates C++ for a CPU it asks which of the instruction sets /proc/cpuinfo lists
(AVX2, AVX-512, AMX, ...) the compiler can build and the machine can load: for each it builds a small
program against ATen's vector headers into the inductor folder, then starts a Python process that
loads it. Measured on 2 cores (torch 2.13, Intel Xeon with AMX, 4 sets listed): 15.5 s in a folder
that has not built them yet, 1.8 s in one that has (the loading processes alone). Every process that
compiles or loads a step pays it, each worker and coordinator at every start, and every new
compile-cache folder pays the 15 s (a test's own folder, each simulated node's). Without that probe, 3.7 s and 0.6 s:
the AVX-512 and AMX variants (bf16, VNNI, AMX-FP16) are still probed with programs of their own.

The answer depends on the host only: its CPU, its compiler and torch. So the first probe on a host is
recorded beside inductor's default folder (one per user), and a later process whose torch, compiler
and listed instruction sets match the record compiles and loads its steps with inductor's switch that
takes every listed set as buildable (`cpp.vec_isa_ok`, TORCHINDUCTOR_VEC_ISA_OK for a whole process).
The record is written only when the probe found every listed set usable; where it refused one (an old
compiler), nothing is recorded and every process probes as before. The switch goes into the options
of warpspec's own graphs only, the first process's included: inductor's cache keys hold it, so every
process builds its steps under the same options, and a caller's own torch.compile in the same process
keeps torch's defaults.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from warpspec.workers.compile.torch_internals import (
    VEC_ISA_SWITCH,
    cpp_compiler,
    inductor_default_cache_dir,
    listed_vec_isas,
    usable_vec_isas,
)

logger = logging.getLogger(__name__)


def default_record() -> Path:
    """Where the host's record lives: inductor's default folder, one per user on a host whatever
    compile-cache folder a process uses, and one per torch installation (each virtual environment
    its own, so that two do not replace each other's)."""
    install = hashlib.sha256(str(Path(torch.__file__).parent).encode()).hexdigest()[:12]
    return Path(inductor_default_cache_dir(), f"warpspec-vec-isa-{install}.json")


@functools.cache
def vec_isa_options(record: Path | None = None) -> dict:
    """Inductor options for warpspec's step graphs: the switch that skips the instruction-set probe
    where record says this host passed it, probing now where it does not (what the first compile
    would do anyway) and recording a probe that found every listed set usable; {} where the probe
    refused a set. Once per process."""
    record = default_record() if record is None else record
    host = host_facts()
    if read_record(record) == host:
        return {VEC_ISA_SWITCH: True}
    usable = usable_vec_isas()  # the probe
    if not should_record(host["listed"], usable):
        logger.info("the compiler cannot build every instruction set the CPU lists (%s, usable: %s); "
                    "inductor probes them in every process", host["listed"], usable)
        return {}
    write_record(record, host)
    return {VEC_ISA_SWITCH: True}


def host_facts() -> dict:
    """What the probe's answer depends on: torch, the compiler inductor calls (path, size and
    modification time), and the instruction sets the CPU lists."""
    compiler = shutil.which(cpp_compiler()) or cpp_compiler()
    stat = os.stat(compiler) if os.path.exists(compiler) else None
    return {"torch": torch.__version__, "torch_path": str(Path(torch.__file__).parent),
            "compiler": os.path.realpath(compiler),
            "compiler_stat": [stat.st_size, stat.st_mtime_ns] if stat else None,
            "listed": listed_vec_isas()}


def should_record(listed: list[str], usable: list[str]) -> bool:
    """A probe is worth recording only when every listed set passed it: inductor's switch takes all
    of them or none."""
    return bool(listed) and usable == listed


def read_record(record: Path) -> dict | None:
    try:
        return json.loads(record.read_text())
    except (OSError, ValueError):
        return None


def write_record(record: Path, host: dict) -> None:
    """Written whole (a temporary name, then a rename): a process reading meanwhile sees the old
    record or the new one. A folder that cannot be written only costs later processes the probe."""
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=record.parent, prefix=f".{record.name}.", delete=False) as f:
            json.dump(host, f)
        os.replace(f.name, record)
    except OSError as error:
        logger.info("the instruction-set probe is not recorded at %s (%s); every process probes again",
                    record, error)
