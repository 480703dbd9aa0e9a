import os

# Keep torch from spawning more threads than the 2 cores CI has.
os.environ.setdefault("OMP_NUM_THREADS", "2")
