"""`warpspec bench trees`: what a token tree would buy at batch 1, measured before one is built.

EAGLE-2 drafts a tree instead of a chain: from the root, the top_k draft tokens; at each next depth,
the top_k children of the top_k nodes of highest cumulative draft probability; the num_nodes most
probable nodes of all are then verified in one target step (query length num_nodes + 1) under a tree
mask. A tree pays where verifying num_nodes + 1 tokens costs little more than verifying a chain's
k + 1, and its larger acceptance outweighs the rest.

Both sides are measured here, on the held-out prompts (bundled pair) or given ones:
- acceptance: for a greedy request, a verified tree accepts the longest path that follows the
  target's greedy continuation. So the acceptance of any tree shape follows exactly from the draft's
  own outputs along that continuation, without a tree-masked target step: the draft runs here eagerly,
  its attention dense over the target-fed keys and the path's own (as in the KV cache at inference).
  The walk advances as the engine does (accepted drafts + 1 per step; never drafting past max_tokens).
  The chain k=3 computed this way is checked against the engine's own chain on the same prompts.
- cost: the step cost model of an engine started for each verification length (compiled steps at
  batch 1, as a replica times them at start-up): target step at query length q, the draft's steps,
  the host's share. A tree's draft is counted as depth one-row steps, which is less than its top_k
  rows each: its modeled speed is an upper bound.
Modeled tokens/s = acceptance length / (target(q) + draft(depth) + host).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from warpspec.assets import BUNDLED_DRAFT, BUNDLED_TARGET, held_out_prompts
from warpspec.benchmarks.compare import read_prompts
from warpspec.benchmarks.report import write_report
from warpspec.config.engine import MAX_SPECULATIVE_TOKENS
from warpspec.entrypoints.llm import LLM
from warpspec.sampling_params import SamplingParams
from warpspec.spec_decode.speculation_stats import acceptance_length
from warpspec.workers.kv_cache import CacheConfig
from warpspec.workers.models.eagle3_draft import Eagle3Draft, load_eagle3
from warpspec.workers.models.registry import load_model_config
from warpspec.workers.runner import ModelRunner
from warpspec.workers.step import SequenceStep, StepInput


@dataclasses.dataclass(frozen=True)
class TreeShape:
    top_k: int
    depth: int
    num_nodes: int

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """'4x5x12' -> top_k 4, depth 5, 12 nodes; 'chain3' -> the chain of 3 drafts."""
        if text.startswith("chain"):
            k = int(text[len("chain"):])
            return cls(1, k, k)
        parts = text.split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--trees: {text!r} is not TOPKxDEPTHxNODES (e.g. 4x5x12) or chainK")
        shape = cls(*map(int, parts))
        if min(shape.top_k, shape.depth, shape.num_nodes) < 1:
            raise ValueError(f"--trees: {text!r}: top_k, depth and num_nodes must each be at least 1")
        if shape.num_nodes > shape.max_nodes:
            raise ValueError(f"--trees: {text!r}: {shape.num_nodes} nodes, but a tree of top_k {shape.top_k} "
                             f"and depth {shape.depth} drafts at most {shape.max_nodes}")
        return shape

    @property
    def max_nodes(self) -> int:
        """Nodes drafted: top_k at depth 1, then top_k children of each of the top_k expanded nodes."""
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k

    @property
    def label(self) -> str:
        return f"chain k={self.depth}" if self.top_k == 1 else f"tree {self.top_k}x{self.depth}, {self.num_nodes} nodes"


@dataclasses.dataclass
class Node:
    token_id: int  # target vocabulary
    depth: int  # 1 = the root's children
    score: float  # cumulative draft log-probability
    parent: Node | None
    key: torch.Tensor | None = None  # [kv_heads, head_dim], once expanded
    value: torch.Tensor | None = None
    prenorm: torch.Tensor | None = None  # [hidden]: its children's feature


class DraftTrees:
    """The draft along one sequence: the target-fed step of every position, then trees from any root."""

    def __init__(self, draft: Eagle3Draft, tokens: list[int], features: torch.Tensor):
        c = draft.config
        self.draft, self.scale = draft, c.head_dim**-0.5
        self.groups = c.num_attention_heads // c.num_key_value_heads
        # Position p reads token p + 1 and the target's features at p; its logits draft token p + 2.
        inputs = torch.tensor(tokens[1:])
        positions = torch.arange(len(inputs))
        q, self.keys, self.values, residual = draft.before_attention(inputs, features[: len(inputs)], positions)
        mask = torch.ones(len(inputs), len(inputs), dtype=torch.bool).tril()
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), *self._heads(self.keys, self.values),
                                              attn_mask=mask, scale=self.scale)
        self.logits, self.prenorm = draft.after_attention(attn.transpose(0, 1).reshape(len(inputs), -1), residual)

    def _heads(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, kv_heads, head_dim] -> [heads, n, head_dim]"""
        return (t.repeat_interleave(self.groups, dim=1).transpose(0, 1) for t in (k, v))

    def _children(self, logits: torch.Tensor, parent: Node | None, depth: int, top_k: int) -> list[Node]:
        logprobs, draft_ids = torch.log_softmax(logits.float(), dim=-1).topk(top_k)
        base = parent.score if parent is not None else 0.0
        return [Node(int(t), depth, base + float(lp), parent)
                for lp, t in zip(logprobs, self.draft.to_target_ids(draft_ids), strict=True)]

    def _expand(self, nodes: list[Node], root: int) -> list[torch.Tensor]:
        """Run the draft at each node (position root + depth, reading its token and its parent's
        output, attending to the target-fed keys up to root, its ancestors' keys and its own); returns
        each node's logits."""
        features = torch.stack([n.parent.prenorm if n.parent is not None else self.prenorm[root] for n in nodes])
        positions = torch.tensor([root + n.depth for n in nodes])
        q, k, v, residual = self.draft.before_attention(torch.tensor([n.token_id for n in nodes]), features, positions)
        rows = []
        for i, node in enumerate(nodes):
            node.key, node.value = k[i], v[i]
            path, walk = [], node
            while walk is not None:
                path.append(walk)
                walk = walk.parent
            keys = torch.cat([self.keys[: root + 1], torch.stack([n.key for n in reversed(path)])])
            values = torch.cat([self.values[: root + 1], torch.stack([n.value for n in reversed(path)])])
            rows.append(F.scaled_dot_product_attention(q[i][:, None], *self._heads(keys, values), scale=self.scale))
        attn = torch.stack(rows).reshape(len(nodes), -1)  # [nodes, heads * head_dim]
        logits, prenorm = self.draft.after_attention(attn, residual)
        for node, out in zip(nodes, prenorm, strict=True):
            node.prenorm = out
        return list(logits)

    def tree(self, root: int, shape: TreeShape) -> list[Node]:
        """EAGLE-2's tree from root (the position whose target features the draft reads last)."""
        frontier = self._children(self.logits[root], None, 1, shape.top_k)
        drafted = list(frontier)
        for depth in range(2, shape.depth + 1):
            expanded = sorted(frontier, key=lambda n: -n.score)[: shape.top_k]
            frontier = [child for node, logits in zip(expanded, self._expand(expanded, root), strict=True)
                        for child in self._children(logits, node, depth, shape.top_k)]
            drafted += frontier
        # A child's score is its parent's plus a log-probability (<= 0): the most probable nodes
        # hold every ancestor of each, whatever the ties (a stable sort keeps parents first).
        return sorted(drafted, key=lambda n: -n.score)[: shape.num_nodes]

    @staticmethod
    def accepted(tree: list[Node], continuation: list[int]) -> int:
        """Drafts greedy verification accepts: the longest path of the tree that continuation follows."""
        children: dict[int | None, list[Node]] = {}
        for node in tree:
            children.setdefault(id(node.parent) if node.parent is not None else None, []).append(node)
        parent, count = None, 0
        for token in continuation:
            match = next((n for n in children.get(parent, []) if n.token_id == token), None)
            if match is None:
                break
            parent, count = id(match), count + 1
        return count


def walk(trees: DraftTrees, prompt_len: int, tokens: list[int], new_tokens: int, shape: TreeShape) -> tuple[int, int]:
    """(accepted drafts, verifying steps) of one greedy request of new_tokens, stepped as the engine
    steps it: near max_tokens only the first drafts of a path may be accepted (for a chain exactly
    the engine's shorter chain), and with none left a plain decode step verifies nothing."""
    generated, accepted, steps = 1, 0, 0  # the prefill emits the first token
    while generated < new_tokens:
        most = min(shape.depth, new_tokens - generated - 1)
        if most == 0:
            generated += 1
            continue
        root = prompt_len + generated - 2  # the newest token sits at root + 1
        count = DraftTrees.accepted(trees.tree(root, shape), tokens[root + 2 : root + 2 + most])
        accepted, steps, generated = accepted + count, steps + 1, generated + count + 1
    return accepted, steps


def target_features(runner: ModelRunner, tokens: list[int], aux_layer_ids: list[int]) -> torch.Tensor:
    """[len(tokens), 3 * hidden]: the target's captured hidden states of one whole sequence."""
    block_size = runner.cache_config.block_size
    table = list(range(-(-len(tokens) // block_size)))
    out = runner.execute(StepInput.build([SequenceStep(tokens, 0, table, 0)], block_size, aux_layer_ids))
    return torch.cat(out.aux_hidden, dim=-1)


@torch.no_grad()
def acceptance(target: str, draft_path: str, sequences: list[tuple[int, list[int]]], new_tokens: int,
               shapes: list[TreeShape]) -> dict[TreeShape, tuple[int, int]]:
    """Per shape, (accepted drafts, verifying steps) over sequences of (prompt length, prompt +
    greedy continuation)."""
    longest = max(len(tokens) for _, tokens in sequences)
    runner = ModelRunner(target, "float32", CacheConfig(block_size=16, num_blocks=-(-longest // 16), hybrid=False))
    draft = load_eagle3(draft_path, runner.config, runner.model.model.embed_tokens.weight, torch.float32)
    totals = {shape: (0, 0) for shape in shapes}
    for prompt_len, tokens in tqdm(sequences, desc="draft trees", unit="prompt"):
        trees = DraftTrees(draft, tokens, target_features(runner, tokens, list(draft.config.aux_layer_ids)))
        for shape in shapes:
            accepted, steps = walk(trees, prompt_len, tokens, new_tokens, shape)
            totals[shape] = (totals[shape][0] + accepted, totals[shape][1] + steps)
    return totals


def step_costs(target: str, draft: str, k: int, compile_draft: bool) -> dict[str, float]:
    """The step cost model of an engine drafting up to k (adaptive, one sequence at a time), in ms:
    target steps of query length 1 and k + 1, the draft's k drafts, the host's share of a verifying
    step (host) and of a plain one (plain_host; the verifying one's when no plain step ran)."""
    with LLM(target, dtype="float32", draft=draft, num_speculative_tokens=k, speculative_policy="adaptive",
             max_num_seqs=1, compile_draft=compile_draft) as llm:
        llm.generate([[1, 5, 9, 13]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        rows = {(step, n, length): ms for step, n, length, ms in llm.engine.stats().step_costs}
    return {"decode": rows[("target", 1, 1)], "verify": rows[("target", 1, k + 1)],
            "draft": rows[("draft", 1, k)], "host": rows.get(("host", 1, k + 1), 0.0),
            "plain_host": rows.get(("host", 1, 1), rows.get(("host", 1, k + 1), 0.0))}


def engine_chain(target: str, draft: str, prompts: list[list[int]], new_tokens: int,
                 k: int) -> tuple[list[list[int]], int, int]:
    """The engine's own greedy chain of k, one request at a time: tokens, accepted drafts, verifying steps."""
    with LLM(target, dtype="float32", draft=draft, num_speculative_tokens=k, speculative_policy="fixed",
             max_num_seqs=1) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
        stats = llm.engine.spec_stats
    return [o.token_ids for o in outs], stats.num_accepted_tokens, stats.num_verify_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpspec bench trees", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(BUNDLED_TARGET))
    parser.add_argument("--draft", default=str(BUNDLED_DRAFT))
    parser.add_argument("--prompts", help="token-id prompts in the held-out prompts' JSON format, as bench compare "
                        "reads them (default: those)")
    parser.add_argument("--num-prompts", type=int, help="the first N prompts (default: all)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--trees", default="chain5,chain7,2x4x6,2x6x10,4x4x8,4x6x16,8x8x16",
                        help="tree shapes TOPKxDEPTHxNODES or chainK, beside the chain of --num-speculative-tokens")
    parser.add_argument("--num-speculative-tokens", type=int, default=3, help="the chain's length k")
    parser.add_argument("--skip-costs", action="store_true", help="acceptance only: start no engine to time steps")
    parser.add_argument("--run-dir", default="runs")
    args = parser.parse_args(argv)
    try:
        shapes = [TreeShape.parse(f"chain{args.num_speculative_tokens}"),
                  *(TreeShape.parse(t) for t in args.trees.split(",") if t)]
    except ValueError as e:
        parser.error(str(e))
    too_wide = [s.label for s in shapes if s.num_nodes > MAX_SPECULATIVE_TOKENS]
    if too_wide and not args.skip_costs:
        parser.error(f"--trees: {', '.join(too_wide)}: an engine verifies at most {MAX_SPECULATIVE_TOKENS} drafts "
                     "a step (num_speculative_tokens), so no step that wide can be timed; --skip-costs for acceptance")
    if (args.num_prompts is not None and args.num_prompts < 1) or args.new_tokens < 2:
        parser.error("--num-prompts must be at least 1 and --new-tokens at least 2")
    vocab_size = load_model_config(args.target).vocab_size
    prompts = read_prompts(args.prompts, vocab_size) if args.prompts else held_out_prompts()
    prompts = prompts[: args.num_prompts]
    k = args.num_speculative_tokens
    outputs, engine_accepted, engine_steps = engine_chain(args.target, args.draft, prompts, args.new_tokens, k)
    sequences = [(len(p), [*p, *out]) for p, out in zip(prompts, outputs, strict=True)]
    totals = acceptance(args.target, args.draft, sequences, args.new_tokens, shapes)
    costs = {} if args.skip_costs else {
        q: step_costs(args.target, args.draft, q - 1, compile_draft=q == k + 1)
        for q in sorted({shape.num_nodes + 1 for shape in shapes})}
    rows = []
    for shape in shapes:
        accepted, steps = totals[shape]
        row = {"shape": shape.label, "top_k": shape.top_k, "depth": shape.depth, "num_nodes": shape.num_nodes,
               "acceptance_length": acceptance_length(accepted, steps), "accepted": accepted, "steps": steps}
        if costs:
            chain = costs[k + 1]
            cost = costs[shape.num_nodes + 1]
            # The draft: the chain's measured k steps, scaled to this depth (one row each: a lower bound).
            step_ms = cost["verify"] + chain["draft"] * shape.depth / k + chain["host"]
            row |= {"verify_ms": cost["verify"], "draft_ms": chain["draft"] * shape.depth / k,
                    "host_ms": chain["host"], "step_ms": step_ms,
                    "tokens_per_s": 1e3 * row["acceptance_length"] / step_ms,
                    "plain_tokens_per_s": 1e3 / (chain["decode"] + chain["plain_host"])}
        rows.append(row)
    engine_length = acceptance_length(engine_accepted, engine_steps)
    table = render(rows, args, len(prompts), engine_length, (engine_accepted, engine_steps) == totals[shapes[0]])
    print(table)
    out = write_report(args.run_dir, "trees", {"rows": rows, "engine_chain": {"accepted": engine_accepted,
                                                                              "steps": engine_steps}}, table)
    plot(rows, out / "trees.png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    """Acceptance length against verified tokens, chains joined by a line; with costs, the modeled
    tokens/s beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("acceptance_length", "acceptance length (tokens a step)")]
    if "tokens_per_s" in rows[0]:
        panels.append(("tokens_per_s", "modeled tokens / s (trees: at most)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    chains = sorted((r for r in rows if r["top_k"] == 1), key=lambda r: r["num_nodes"])
    for ax, (key, label) in zip(axes[0], panels, strict=True):
        ax.plot([r["num_nodes"] + 1 for r in chains], [r[key] for r in chains], "o-", label="chains")
        trees = [r for r in rows if r["top_k"] > 1]
        ax.scatter([r["num_nodes"] + 1 for r in trees], [r[key] for r in trees], marker="s", color="C1",
                   label="trees (top_k x depth)")
        for r in trees:
            ax.annotate(f"{r['top_k']}x{r['depth']}", (r["num_nodes"] + 1, r[key]), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")
        ax.set_xlabel("verified tokens a step (nodes + 1)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Token trees against chains, batch 1, greedy (warpspec bench trees)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def render(rows: list[dict], args: argparse.Namespace, num_prompts: int, engine_length: float,
           chain_matches: bool) -> str:
    lines = [f"target {args.target}, draft {args.draft}, {num_prompts} prompts, {args.new_tokens} new tokens, "
             f"greedy, batch 1, float32",
             f"the engine's chain k={args.num_speculative_tokens}: acceptance {engine_length:.3f} "
             f"({'the same steps as' if chain_matches else 'DIFFERS from'} the chain computed here)\n"]
    if "step_ms" in rows[0]:
        chain = rows[0]
        lines += ["| draft | verified tokens | acceptance length | target verify ms | draft ms (>=) | host ms "
                  "| modeled tok/s (<=) | vs chain | vs plain |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['shape']} | {r['num_nodes'] + 1} | {r['acceptance_length']:.3f} | {r['verify_ms']:.2f} "
                         f"| {r['draft_ms']:.2f} | {r['host_ms']:.2f} | {r['tokens_per_s']:.0f} "
                         f"| {r['tokens_per_s'] / chain['tokens_per_s']:.2f}x "
                         f"| {r['tokens_per_s'] / r['plain_tokens_per_s']:.2f}x |")
    else:
        lines += ["| draft | verified tokens | acceptance length |", "|---|---|---|"]
        lines += [f"| {r['shape']} | {r['num_nodes'] + 1} | {r['acceptance_length']:.3f} |" for r in rows]
    return "\n".join(lines)
