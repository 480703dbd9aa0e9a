"""`warpspec train-draft`: train an EAGLE-3 head for a Llama 4 target on a text corpus.

Per batch, the target (warpspec's own runner) computes the hidden states entering the three capture
layers and its logits at every position. The draft learns, at each position p, the target's
distribution over the token at p + 2 restricted to the draft vocabulary, from the token at p + 1 and a
feature, in `ttt_steps` unrolled steps (the training-time test): step 0 takes fc(target features at
p); step j takes the draft's own step-(j-1) output at p - 1, as at inference, where every draft token
after the first is predicted from the draft's previous output. Step j's loss weighs 0.8^j.
Each step attends to the keys inference gives it (`chain_attention`): the target-fed keys of the context
before its chain, then the chain's own keys. The draft vocabulary is the most frequent target tokens of
the corpus. Embeddings are the target's, frozen.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from warpspec.tokenizer import Tokenizer
from warpspec.workers.kv_cache import CacheConfig
from warpspec.workers.models.eagle3_draft import TENSOR_NAMES, Eagle3Config, Eagle3Draft
from warpspec.workers.runner import ModelRunner
from warpspec.workers.step import SequenceStep, StepInput

STEP_WEIGHT = 0.8


@dataclass
class TrainConfig:
    target: str
    data: str  # a text file, or JSONL with a "text" field per line
    out: str
    draft_vocab_size: int = 1024
    intermediate_size: int | None = None  # default: the target's intermediate_size
    seq_len: int = 128
    batch_size: int = 8
    steps: int = 500
    lr: float = 3e-3
    ttt_steps: int = 3
    val_fraction: float = 0.05
    max_val_chunks: int = 64  # validation cost stays bounded on big corpora
    eval_every: int = 25
    seed: int = 0
    # The target layers whose entering hidden states the draft reads; default EAGLE-3's (2, L//2, L-3).
    aux_layer_ids: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        for name in ("draft_vocab_size", "seq_len", "batch_size", "steps", "ttt_steps", "max_val_chunks", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3:
            raise ValueError(f"aux_layer_ids must be three layer ids, got {list(self.aux_layer_ids)}")
        if self.seq_len < self.ttt_steps + 3:
            raise ValueError(f"seq_len {self.seq_len} is too short for {self.ttt_steps} unrolled steps")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")


def read_corpus(path: str) -> list[str | list[int]]:
    """Documents: JSONL lines' "text" (or "token_ids", e.g. from write_draft_corpus), or the whole
    file split on blank-line runs."""
    source = Path(path)
    if not source.is_file():
        raise ValueError(f"training data {path} not found")
    text = source.read_text(errors="replace")
    if source.suffix == ".jsonl":
        docs = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    record = json.loads(line)
                    docs.append(record["token_ids"] if "token_ids" in record else record["text"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"{path}:{number}: expected a JSON object with a 'text' or 'token_ids' "
                                     "field") from None
        return docs
    return [d for d in text.split("\n\n") if d.strip()]


def token_chunks(docs: list[str | list[int]], tokenizer: Tokenizer, seq_len: int) -> list[list[int]]:
    stream: list[int] = []
    for doc in docs:
        stream.extend(doc if isinstance(doc, list) else tokenizer.encode(doc))
    return [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]


class DraftTrainer:
    def __init__(self, config: TrainConfig):
        self.config = config
        torch.manual_seed(config.seed)
        self.tokenizer = Tokenizer.from_dir(config.target)
        if self.tokenizer is None:
            raise ValueError(f"{config.target} has no tokenizer.json to read the training text with")
        chunks = token_chunks(read_corpus(config.data), self.tokenizer, config.seq_len)
        if len(chunks) < 4:
            raise ValueError(f"{config.data} gives {len(chunks)} chunks of {config.seq_len} tokens; need at least 4")
        random.Random(config.seed).shuffle(chunks)
        num_val = min(max(1, int(len(chunks) * config.val_fraction)), config.max_val_chunks)
        self.val_chunks, self.train_chunks = chunks[:num_val], chunks[num_val:]
        blocks = config.batch_size * config.seq_len // 16 + config.batch_size
        # Each batch runs its whole sequences in one step: a hybrid cache's windows would save nothing.
        self.target = ModelRunner(config.target, "float32", CacheConfig(block_size=16, num_blocks=blocks, hybrid=False))
        self.draft_ids = self._draft_vocabulary(chunks)
        self.draft = self._init_draft()
        self.optimizer = torch.optim.AdamW(self.draft.parameters(), lr=config.lr, weight_decay=0.0)
        # 20 steps of warm-up, then a cosine decay to zero.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / config.steps)))

    def _draft_vocabulary(self, chunks: list[list[int]]) -> torch.Tensor:
        vocab = self.target.config.vocab_size
        counts = torch.bincount(torch.tensor([t for c in chunks for t in c]), minlength=vocab)
        size = min(self.config.draft_vocab_size, vocab)
        return counts.topk(size).indices.sort().values  # draft id i -> target id draft_ids[i]

    def _aux_layer_ids(self, num_layers: int) -> tuple[int, int, int]:
        ids = self.config.aux_layer_ids or (2, num_layers // 2, num_layers - 3)
        if not all(0 <= i < num_layers for i in ids):
            raise ValueError(f"aux_layer_ids {list(ids)} must name layers of the target, 0 to {num_layers - 1}")
        return tuple(ids)

    def _init_draft(self) -> Eagle3Draft:
        target = self.target.config
        heads = target.num_attention_heads
        layers = target.num_hidden_layers
        config = Eagle3Config(hidden_size=target.hidden_size, target_hidden_size=target.hidden_size,
                              num_attention_heads=heads, num_key_value_heads=target.num_key_value_heads,
                              head_dim=target.head_dim, intermediate_size=self.config.intermediate_size
                              or target.intermediate_size, vocab_size=target.vocab_size,
                              draft_vocab_size=len(self.draft_ids), rms_norm_eps=target.rms_norm_eps,
                              rope_theta=10000.0, aux_layer_ids=self._aux_layer_ids(layers))
        embed = self.target.model.model.embed_tokens.weight.detach()
        draft = Eagle3Draft(config, embed, torch.float32)
        with torch.no_grad():
            for name, param in draft.named_parameters():
                if name.endswith("norm") or "layernorm" in name:
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02)
                param.requires_grad_(True)
            draft.d2t.copy_(self.draft_ids - torch.arange(len(self.draft_ids)))
        return draft

    @torch.no_grad()
    def target_outputs(self, batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, L, 3H] captured hidden states and [B, L, Vd] the target's log-probs over the draft vocab."""
        blocks_per_seq = -(-self.config.seq_len // 16)
        plan = [SequenceStep(tokens, 0, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), 0)
                for i, tokens in enumerate(batch)]
        out = self.target.execute(StepInput.build(plan, 16, list(self.draft.config.aux_layer_ids)))
        shape = (len(batch), self.config.seq_len, -1)
        features = torch.cat(out.aux_hidden, dim=-1).reshape(shape)
        logprobs = torch.log_softmax(out.logits[:, self.draft_ids], dim=-1).reshape(shape)
        return features, logprobs

    def losses(self, batch: list[list[int]]) -> tuple[torch.Tensor, list[float]]:
        """Weighted unrolled loss, and per step the top-1 agreement with the target."""
        features, target_logprobs = self.target_outputs(batch)
        tokens = torch.tensor(batch)
        # Position p reads token p + 1 and is scored against the target's distribution for p + 2,
        # which the target computed at position p + 1.
        inputs, goal = tokens[:, 1:-1], target_logprobs[:, 1:-1]
        total, agreement = torch.zeros(()), []
        for step, logits in enumerate(unrolled_logits(self.draft, inputs, features[:, :-2], self.config.ttt_steps)):
            valid = slice(step, None)  # step j's first j positions have no chain behind them
            logprobs = torch.log_softmax(logits[:, valid].float(), dim=-1)
            target = goal[:, valid]
            loss = -(target.exp() * logprobs).sum(-1).mean()
            total = total + STEP_WEIGHT**step * loss
            agreement.append((logprobs.argmax(-1) == target.argmax(-1)).float().mean().item())
        return total, agreement

    def train(self) -> dict:
        rng = random.Random(self.config.seed)
        # Shown in a log file too, at most every 10 s there.
        progress = tqdm(range(self.config.steps), desc="train-draft", unit="step", mininterval=10)
        last: dict = {}
        history: list[dict] = []
        started = time.perf_counter()
        for step in progress:
            batch = rng.sample(self.train_chunks, min(self.config.batch_size, len(self.train_chunks)))
            loss, agreement = self.losses(batch)
            self.optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.draft.parameters(), 1.0)
            self.optimizer.step()
            self.scheduler.step()
            last = {"step": step + 1, "loss": loss.item(), "train_agreement": agreement}
            if step % self.config.eval_every == 0 or step == self.config.steps - 1:
                last["val_agreement"] = self.validate()
                history.append({**last, "elapsed_s": round(time.perf_counter() - started, 1)})
                progress.set_postfix(loss=f"{loss.item():.3f}",
                                     val_top1=" ".join(f"{a:.2f}" for a in last["val_agreement"]), refresh=False)
        self.save()
        report = {"config": asdict(self.config), "train_seconds": round(time.perf_counter() - started, 1),
                  "train_chunks": len(self.train_chunks), "val_chunks": len(self.val_chunks), "history": history}
        (Path(self.config.out) / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
        return last

    @torch.no_grad()
    def validate(self) -> list[float]:
        """Top-1 agreement with the target per unrolled step on held-out chunks (a proxy for the
        per-position acceptance rate of greedy speculation)."""
        per_step = []
        for start in range(0, len(self.val_chunks), self.config.batch_size):
            per_step.append(self.losses(self.val_chunks[start : start + self.config.batch_size])[1])
        return [sum(s[i] for s in per_step) / len(per_step) for i in range(self.config.ttt_steps)]

    def save(self) -> Path:
        out = Path(self.config.out)
        out.mkdir(parents=True, exist_ok=True)
        d, c = self.draft, self.draft.config
        tensors = {name: getattr(d, attr).detach().contiguous() for name, attr in TENSOR_NAMES.items()}
        tensors["d2t"] = d.d2t.clone()
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[self.draft_ids] = True
        tensors["t2d"] = t2d
        save_file(tensors, str(out / "model.safetensors"))
        config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
                  "target_hidden_size": c.target_hidden_size, "num_attention_heads": c.num_attention_heads,
                  "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                  "intermediate_size": c.intermediate_size, "num_hidden_layers": 1, "vocab_size": c.vocab_size,
                  "draft_vocab_size": c.draft_vocab_size, "rms_norm_eps": c.rms_norm_eps,
                  "rope_theta": c.rope_theta, "tie_word_embeddings": False,
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
                                   "use_aux_hidden_state": True}}
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return out


def unrolled_logits(draft: Eagle3Draft, inputs: torch.Tensor, features: torch.Tensor,
                    num_steps: int) -> list[torch.Tensor]:
    """The draft's logits [B, L, Vd] of each unrolled step over whole sequences: inputs [B, L] (position
    p reads inputs[p]), features [B, L, F] (the target's at p). Step j at position p is the (j+1)-th
    token of a chain that starts at p - j: its feature is step j-1's pre-norm output at p - 1, and it
    attends as at inference (`chain_attention`). The same halves the inference path runs; only the
    attention between them is dense here, with no KV cache."""
    c = draft.config
    batch, length = inputs.shape
    positions = torch.arange(length).repeat(batch)
    groups = c.num_attention_heads // c.num_key_value_heads
    chain: list[tuple[torch.Tensor, torch.Tensor]] = []
    all_logits = []
    for _ in range(num_steps):
        q, k, v, residual = draft.before_attention(inputs.reshape(-1), features.reshape(batch * length, -1), positions)
        q, k, v = (t.view(batch, length, -1, c.head_dim).transpose(1, 2) for t in (q, k, v))
        chain.append((k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)))  # one per query head
        attn = chain_attention(q, chain, c.head_dim**-0.5).transpose(1, 2)
        logits, prenorm = draft.after_attention(attn.reshape(batch * length, -1), residual)
        all_logits.append(logits.view(batch, length, -1))
        prenorm = prenorm.view(batch, length, -1)
        features = torch.cat([prenorm[:, :1], prenorm[:, :-1]], dim=1)  # step j+1's feature at p: step j's at p - 1
    return all_logits


def chain_attention(q: torch.Tensor, chain: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
    """Attention of unrolled step j = len(chain) - 1. q [B, H, L, D]; chain[i] = step i's (k, v)
    [B, H, L, D], KV heads repeated to the query heads. At inference the chain that reaches position
    p at step j started at p - j: the KV cache holds the target-fed (step 0) keys of positions
    0..p-j and the chain's own keys, step i's at p - j + i. So a query attends causally to step 0's
    keys up to p - j, and to one key of each later step. Worked example, j = 2, p = 5: step 0's keys
    0..3, step 1's key 4, step 2's key 5.
    Returns [B, H, L, D]."""
    step = len(chain) - 1
    length = q.shape[2]
    k0, v0 = chain[0]
    query_pos = torch.arange(length)[:, None]
    scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(torch.arange(length) > query_pos - step, float("-inf"))]
    values = []
    for i in range(1, step + 1):
        lag = step - i  # step i's key sits lag positions before the query
        k, v = (F.pad(t[:, :, : length - lag], (0, 0, lag, 0)) for t in chain[i])
        scores.append(((q * k).sum(-1, keepdim=True) * scale).masked_fill(query_pos < lag, float("-inf")))
        values.append(v)
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = probs[..., :length] @ v0
    for i, v in enumerate(values):
        out = out + probs[..., length + i : length + i + 1] * v
    return out
