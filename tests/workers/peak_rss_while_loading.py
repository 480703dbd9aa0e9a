"""Run as a script: load a checkpoint and print JSON with the model's bytes and the peak growth of
the process's resident set (anonymous + file-backed pages) while loading, polled every 0.5 ms."""

import json
import re
import sys
import threading
import time

from warpspec.workers.loader import load_model


def resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def main(model_dir: str) -> None:
    baseline = resident_bytes()
    peak = baseline
    done = threading.Event()

    def poll() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, resident_bytes())
            time.sleep(0.0005)

    poller = threading.Thread(target=poll)
    poller.start()
    model = load_model(model_dir, "float32")
    done.set()
    poller.join()
    peak = max(peak, resident_bytes())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"model_bytes": model_bytes, "peak_growth_bytes": peak - baseline}))


if __name__ == "__main__":
    main(sys.argv[1])
