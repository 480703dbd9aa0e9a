"""`warpspec` command line."""

from __future__ import annotations

import argparse
import json
import sys

from warpspec.config.options import add_engine_flags, engine_options_from_flags
from warpspec.core.startup import show_startup_log
from warpspec.errors import InvalidRequestError, PlacementError
from warpspec.workers.errors import CheckpointError


def _generate(args: argparse.Namespace) -> None:
    from warpspec.entrypoints.llm import LLM
    from warpspec.sampling_params import SamplingParams

    if (args.prompt is None) == (args.prompt_token_ids is None):
        raise InvalidRequestError("pass exactly one of --prompt or --prompt-token-ids")
    prompt = args.prompt
    if args.prompt_token_ids is not None:
        try:
            prompt = [int(t) for t in args.prompt_token_ids.split(",")]
        except ValueError:
            raise InvalidRequestError("--prompt-token-ids must be comma-separated integers") from None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop or [], ignore_eos=args.ignore_eos)
    with LLM(args.model, **engine_options_from_flags(args, skip=("seed",))) as llm:
        out = llm.generate([prompt], params)[0]
    if args.json:
        print(json.dumps({"prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids, "text": out.text,
                          "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "metrics": out.metrics}))
    else:
        print((out.prompt or "") + out.text)


def _create_checkpoint(args: argparse.Namespace) -> None:
    from warpspec.training.random_checkpoint import create_random_checkpoint

    path = create_random_checkpoint(args.out, preset=args.preset, seed=args.seed)
    print(f"wrote a random {args.preset} Llama 4 checkpoint with tokenizer to {path}")


def _train_draft(args: argparse.Namespace) -> None:
    from warpspec.training.eagle3_trainer import DraftTrainer, TrainConfig

    config = TrainConfig(target=args.target, data=args.data, out=args.out, draft_vocab_size=args.draft_vocab_size,
                         intermediate_size=args.intermediate_size, steps=args.steps, seq_len=args.seq_len,
                         batch_size=args.batch_size, lr=args.lr, ttt_steps=args.ttt_steps,
                         eval_every=args.eval_every, seed=args.seed,
                         aux_layer_ids=tuple(args.aux_layers) if args.aux_layers else None)
    result = DraftTrainer(config).train()
    print(json.dumps(result))
    print(f"wrote the draft to {args.out}")


def _train_target(args: argparse.Namespace) -> None:
    from warpspec.training.target_trainer import TargetTrainConfig, TargetTrainer

    options = {name: getattr(args, name) for name in ("work_dir", "seq_len", "batch_size", "steps", "lr", "seed")}
    if args.corpus:
        options["corpus"] = args.corpus
    report = TargetTrainer(TargetTrainConfig(out=args.out, **options)).train()
    print(f"wrote the target to {args.out}: {report['steps']} steps, {report['train_seconds']:.0f} s, "
          f"validation perplexity {report['val_perplexity']:.2f}")


def _draft_data(args: argparse.Namespace) -> None:
    from warpspec.training.draft_data import write_draft_corpus, write_held_out_prompts

    path = write_draft_corpus(args.target, args.out, num_samples=args.num_samples, prompt_tokens=args.prompt_tokens,
                              max_tokens=args.max_tokens, seed=args.seed)
    print(f"wrote {args.num_samples} target continuations to {path}")
    if args.held_out_prompts:
        write_held_out_prompts(args.target, args.held_out_prompts, prompt_tokens=args.prompt_tokens, seed=args.seed)
        print(f"wrote held-out prompts to {args.held_out_prompts}")


BENCHMARKS = {name: f"warpspec.benchmarks.{name}"
              for name in ("compare", "dispatch", "throughput", "spec", "seeds", "serve", "gpu_check", "load",
                           "weights", "restart", "trees")}
BENCHMARKS["fp8"] = "warpspec.benchmarks.fp8_quality"
BENCHMARKS["moe"] = "warpspec.benchmarks.moe_parallel"
BENCHMARKS["deterministic"] = "warpspec.benchmarks.deterministic"
BENCHMARKS["routing"] = "warpspec.benchmarks.routing"
BENCHMARKS["compile"] = "warpspec.benchmarks.compile_time"
BENCHMARKS["collectives"] = "warpspec.benchmarks.collectives"
BENCHMARKS["structured_output"] = "warpspec.benchmarks.structured_output"
BENCHMARKS["kv_cache"] = "warpspec.benchmarks.kv_cache"


def _bench(args: argparse.Namespace) -> None:
    import importlib

    status = importlib.import_module(BENCHMARKS[args.name]).main(args.args)
    if status:
        raise SystemExit(status)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="warpspec", description="Serve Llama 4 MoE models with speculative decoding.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = commands.add_parser("generate", help="generate text from a checkpoint folder")
    gen.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    gen.add_argument("--prompt", help="prompt text")
    gen.add_argument("--prompt-token-ids", help="prompt as comma-separated token ids")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object with token ids and text")
    add_engine_flags(gen, skip=("seed",))  # --seed above seeds this one request, which is all it runs
    gen.set_defaults(func=_generate)

    create = commands.add_parser("create-checkpoint",
                                 help="write a randomly initialised Llama 4 checkpoint with a tokenizer")
    create.add_argument("out", help="output folder")
    create.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    create.add_argument("--seed", type=int, default=0)
    create.set_defaults(func=_create_checkpoint)

    train = commands.add_parser("train-draft", help="train an EAGLE-3 draft for a target on a text corpus")
    train.add_argument("--target", required=True, help="target checkpoint folder (with tokenizer.json)")
    train.add_argument("--data", required=True, help="a text file, or JSONL with a 'text' field per line")
    train.add_argument("--out", required=True, help="where to write the draft (public EAGLE-3 format)")
    train.add_argument("--draft-vocab-size", type=int, default=1024)
    train.add_argument("--intermediate-size", type=int, help="the draft layer's MLP width (default: the target's)")
    train.add_argument("--eval-every", type=int, default=25, help="steps between held-out evaluations")
    train.add_argument("--steps", type=int, default=500)
    train.add_argument("--seq-len", type=int, default=128)
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--ttt-steps", type=int, default=3, help="unrolled draft steps per position")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--aux-layers", type=int, nargs=3, metavar="LAYER",
                       help="the target layers whose entering hidden states the draft reads "
                            "(default EAGLE-3's 2, L//2, L-3)")
    train.set_defaults(func=_train_draft)

    target = commands.add_parser("train-target", help="train the bundled Llama 4 MoE target on Debian's "
                                                      "documentation (resumes from --work-dir)")
    target.add_argument("--out", required=True, help="where to write the Hugging Face checkpoint (bf16)")
    target.add_argument("--work-dir", default="runs/train-target", help="token cache and resumable state")
    target.add_argument("--corpus", action="append", help="a folder of .txt documents (repeatable; default: "
                                                          "the linux-doc-6.1 and python3.11-doc sources)")
    target.add_argument("--steps", type=int, default=3000)
    target.add_argument("--seq-len", type=int, default=256)
    target.add_argument("--batch-size", type=int, default=16)
    target.add_argument("--lr", type=float, default=3e-3)
    target.add_argument("--seed", type=int, default=0)
    target.set_defaults(func=_train_target)

    data = commands.add_parser("draft-data", help="write a draft's training data: the target's greedy "
                                                  "continuations of prompts from the documentation corpus")
    data.add_argument("--target", required=True, help="target checkpoint folder (with tokenizer.json)")
    data.add_argument("--out", required=True, help="JSONL file to write, one {'token_ids': [...]} per line")
    data.add_argument("--num-samples", type=int, default=1024)
    data.add_argument("--prompt-tokens", type=int, default=32)
    data.add_argument("--max-tokens", type=int, default=128)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--held-out-prompts", help="also write 16 prompts from validation documents to this JSON file")
    data.set_defaults(func=_draft_data)

    bench = commands.add_parser("bench", help="run a benchmark (compare, compile, collectives, dispatch, throughput, "
                                              "spec, seeds, serve, load, fp8, moe, gpu_check); "
                                              "`warpspec bench NAME --help`")
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    bench.set_defaults(func=_bench)

    # Serving (issue 7): each command lives in its own module.
    from warpspec.cli.client import add_client_parser
    from warpspec.cli.demo import add_demo_parser
    from warpspec.serving.serve_cli import add_serve_parser

    add_serve_parser(commands)
    add_client_parser(commands)
    add_demo_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    show_startup_log()  # each phase of an engine's start-up, with its time, on stderr
    try:
        args.func(args)
    except (CheckpointError, InvalidRequestError, ValueError) as e:
        print(f"warpspec: error: {e}", file=sys.stderr)
        return 2
    except PlacementError as e:  # the cluster, not the command, is short of something
        print(f"warpspec: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
