"""What an engine did before it could take its first request, phase by phase, with each phase's time.

    placement        the replica's gang of CPUs/GPUs (Ray only)
    weights and KV   every rank loads its shard and allocates its KV cache
    draft            the EAGLE-3 draft's weights, when speculating
    compile target   the compiled step graphs (CPU) or captured CUDA graphs, every rank at once
    compile draft    the draft's compiled graphs

Each phase is logged as it ends (logger "warpspec.startup", INFO) and kept, in order, as
`StartupPhase`s: `LLM.startup`, `AsyncLLM.startup`, and a served replica's log, which ends with the
whole table. A phase that does nothing (nothing compiles when enforce_eager) is not recorded. The
`warpspec` commands, served replicas and coordinators print that log (show_startup_log); a program
using LLM configures logging as it likes. Where a terminal shows it, compiling has a progress bar
per graph.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

logger = logging.getLogger("warpspec.startup")


@dataclass
class StartupPhase:
    name: str
    seconds: float
    detail: str = ""  # what it did: "2 ranks, 1.2 GB read", "4 graphs: 2 loaded, 2 compiled"


class StartupTimer:
    def __init__(self, phases: list[StartupPhase] | None = None):
        self.phases: list[StartupPhase] = list(phases or [])

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the block as the phase `name`; the block may set the yielded phase's detail."""
        phase = StartupPhase(name, 0.0)
        start = time.perf_counter()
        yield phase
        phase.seconds = round(time.perf_counter() - start, 3)
        self.phases.append(phase)
        logger.info("start-up: %s in %.1f s%s", name, phase.seconds, f" ({phase.detail})" if phase.detail else "")

    @property
    def total_s(self) -> float:
        return round(sum(p.seconds for p in self.phases), 3)


def show_startup_log() -> None:
    """Print the start-up log to stderr at INFO in this process (once; Ray forwards an actor's
    stderr to the driver), unless the "warpspec" logger already prints it (a replica's logs)."""
    if not logger.handlers and not logging.getLogger("warpspec").handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def log_startup_table(phases: list[StartupPhase]) -> None:
    logger.info("start-up, phase by phase:\n%s", startup_table(phases))


def startup_table(phases: list[StartupPhase]) -> str:
    """The phases as a Markdown table, with their total."""
    rows = [f"| {p.name} | {p.seconds:.1f} | {p.detail} |" for p in phases]
    total = sum(p.seconds for p in phases)
    return "\n".join(["| start-up phase | seconds | what |", "|---|---|---|", *rows, f"| total | {total:.1f} | |"])
