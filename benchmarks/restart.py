"""`warpspec bench restart`: how soon `warpspec serve` answers, as a health check and a user see it.
It launches the command a user runs (the bundled pair with its draft by default), polls gRPC health
from launch until SERVING, times the first requests' TTFT against the tenth's (nothing may compile on
the request path), then SIGKILLs a worker and then the coordinator, each under a request, and
times each rebuild until SERVING again, with one request after each. --cold gives it a new run
folder (nothing cached); otherwise a run reads the compile cache the last one wrote there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from warpspec.assets import BUNDLED_DRAFT, BUNDLED_TARGET, held_out_prompts
from warpspec.benchmarks.report import write_report
from warpspec.protos.warpspec.v1 import generation_pb2 as pb
from warpspec.protos.warpspec.v1 import generation_pb2_grpc as pb_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
# The Ray actor a victim names, as its process title reads ("ray::ShardWorkerActor...").
VICTIMS = {"worker": "ray::ShardWorkerActor", "coordinator": "ray::CoordinatorActor"}
REPLICA = "ray::ServeReplica"
# Serve replaces a replica after 3 failed health checks in a row, one every health_check_period_s
# (10 s), and only a passed check resets the count: a kill sooner after SERVING would count the last
# rebuild's failed checks too.
SERVE_CHECK_S = 12


def health_status(channel: grpc.Channel) -> int | None:
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError:
        return None  # the proxy is not up yet


def wait_serving(channel: grpc.Channel, process: subprocess.Popen, timeout_s: float, poll_s: float = 0.2) -> float:
    """Seconds until health says SERVING."""
    start = time.monotonic()
    while health_status(channel) != SERVING:
        if process.poll() is not None:
            raise SystemExit(f"warpspec serve exited ({process.returncode}) before it was SERVING")
        if time.monotonic() - start > timeout_s:
            raise SystemExit(f"not SERVING after {timeout_s:.0f} s")
        time.sleep(poll_s)
    return time.monotonic() - start


def ttft_s(channel: grpc.Channel, prompt: list[int], max_tokens: int) -> float:
    """Time to the first streamed token of one greedy request."""
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt),
                                 params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    start = time.monotonic()
    stream = pb_grpc.GenerationStub(channel).GenerateStream(request, timeout=300)
    first = None
    for _ in stream:
        first = time.monotonic() - start if first is None else first
    return first


def actor_pid(serve: subprocess.Popen, title: str) -> int:
    """The pid of the actor whose process title starts with title, among the serve command's processes."""
    for proc in psutil.Process(serve.pid).children(recursive=True):
        try:
            if " ".join(proc.cmdline()).startswith(title):
                return proc.pid
        except psutil.Error:
            continue
    raise SystemExit(f"no {title} process under warpspec serve (pid {serve.pid})")


def kill_and_time_rebuild(channel: grpc.Channel, serve: subprocess.Popen, victim: str, prompt: list[int],
                          timeout_s: float) -> tuple[float, bool]:
    """SIGKILL the victim under a request; seconds until health is SERVING again, having seen it
    leave SERVING (an idle replica learns of a dead actor from its next request), and whether the
    replica rebuilt in place (Serve did not replace it)."""
    time.sleep(SERVE_CHECK_S)
    replica = actor_pid(serve, REPLICA)
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt),
                                 params=pb.SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True))
    stream = pb_grpc.GenerationStub(channel).GenerateStream(request, timeout=300)
    next(stream)  # it runs
    os.kill(actor_pid(serve, VICTIMS[victim]), signal.SIGKILL)
    killed = time.monotonic()
    try:
        for _ in stream:
            pass
        raise SystemExit(f"the request in flight finished although its {victim} was killed")
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNAVAILABLE:
            raise SystemExit(f"the request in flight ended with {e.code().name}, not UNAVAILABLE: "
                             f"{e.details()}") from None
    while health_status(channel) == SERVING:
        if time.monotonic() - killed > 30:
            raise SystemExit(f"the replica still said SERVING 30 s after its {victim} was killed")
        time.sleep(0.05)
    wait_serving(channel, serve, timeout_s)
    return time.monotonic() - killed, actor_pid(serve, REPLICA) == replica


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpspec bench restart", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(BUNDLED_TARGET))
    parser.add_argument("--draft", default=str(BUNDLED_DRAFT), help="'' for none")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--run-dir", default="runs/bench-restart", help="the serve command's run folder")
    parser.add_argument("--cold", action="store_true", help="empty the run folder first: nothing cached")
    parser.add_argument("--grpc-port", type=int, default=9100)
    parser.add_argument("--http-port", type=int, default=8100)
    parser.add_argument("--kills", default="worker,coordinator", help="victims in order ('' for none)")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--serve-arg", action="append", default=[], help="an extra `warpspec serve` flag")
    args = parser.parse_args(argv)
    kills = [k for k in args.kills.split(",") if k]
    if unknown := [k for k in kills if k not in VICTIMS]:
        raise SystemExit(f"--kills: each one of {', '.join(VICTIMS)}, got {unknown[0]!r}")
    if kills and args.workers < 2:
        raise SystemExit("--kills needs --workers 2 or more: one worker runs in the coordinator")
    run_dir = Path(args.run_dir)
    if args.cold:
        shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "warpspec.cli.main", "serve", "--model", args.model, "--workers",
               str(args.workers), "--run-dir", str(run_dir), "--grpc-port", str(args.grpc_port),
               "--http-port", str(args.http_port), *(["--draft", args.draft] if args.draft else []), *args.serve_arg]
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "serve.log"
    shown = "warpspec " + " ".join(command[3:])
    print(f"$ {shown}  (log: {log})")
    prompts = held_out_prompts()
    result: dict = {"command": shown, "cold": args.cold}
    with log.open("w") as out:
        serve = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{args.grpc_port}") as channel:
            result["ready_s"] = wait_serving(channel, serve, args.timeout_s)
            print(f"SERVING {result['ready_s']:.1f} s after launch")
            ttfts = [ttft_s(channel, prompts[i % len(prompts)], 16) for i in range(10)]
            result["ttft_ms"] = {"first": 1e3 * ttfts[0], "tenth": 1e3 * ttfts[9]}
            print(f"TTFT: first request {1e3 * ttfts[0]:.0f} ms, tenth {1e3 * ttfts[9]:.0f} ms")
            result["rebuild_s"], result["ttft_after_rebuild_ms"], result["in_place"] = {}, {}, {}
            for victim in kills:
                result["rebuild_s"][victim], result["in_place"][victim] = kill_and_time_rebuild(
                    channel, serve, victim, prompts[1], args.timeout_s)
                result["ttft_after_rebuild_ms"][victim] = 1e3 * ttft_s(channel, prompts[0], 16)
                print(f"{victim} killed: SERVING again after {result['rebuild_s'][victim]:.1f} s "
                      f"({'rebuilt in place' if result['in_place'][victim] else 'Serve replaced the replica'}), "
                      f"then TTFT {result['ttft_after_rebuild_ms'][victim]:.0f} ms")
    finally:
        serve.send_signal(signal.SIGTERM)  # it stops Serve and its Ray cluster
        try:
            serve.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)  # its session: every process it started
            serve.wait()
    lines = ["| measure | value |", "|---|---|",
             f"| launch to SERVING ({'cold' if args.cold else 'as cached'}) | {result['ready_s']:.1f} s |",
             f"| TTFT, first request after ready | {result['ttft_ms']['first']:.0f} ms |",
             f"| TTFT, tenth request | {result['ttft_ms']['tenth']:.0f} ms |"]
    for victim, seconds in result["rebuild_s"].items():
        how = "in place" if result["in_place"][victim] else "replaced"
        lines.append(f"| {victim} SIGKILLed: SERVING again after | {seconds:.1f} s ({how}, then TTFT "
                     f"{result['ttft_after_rebuild_ms'][victim]:.0f} ms) |")
    table = "\n".join(lines)
    print(table)
    write_report("runs", "restart", result, table)
    return 0
