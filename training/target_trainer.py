"""`warpspec train-target`: train the bundled Llama 4 style MoE target on the Debian documentation
corpus, from scratch, on CPU or GPU.

Pipeline: read and split the corpus (training/corpus.py), train or reuse a byte-level BPE tokenizer,
tokenize once into a cache (uint16 token streams, documents joined by EOS), then next-token
cross-entropy over random windows with AdamW and a warm-up + cosine schedule, under bf16 autocast.
The state is saved every `save_every` steps to the work folder, and a run started again with the same
work folder continues from there. The result is a Hugging Face `Llama4ForCausalLM` folder in bf16.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tqdm import tqdm

from warpspec.training.bpe import EOS, save_tokenizer, train_bpe
from warpspec.training.causal_lm import causal_lm_logits
from warpspec.training.corpus import DEBIAN_DOC_DIRS, read_documents, split_documents
from warpspec.workers.checkpoint_writer import save_checkpoint
from warpspec.workers.models.llama4 import Llama4ForCausalLM
from warpspec.workers.models.registry import model_config_from_dict

# 6 layers, MoE on the odd ones (8 routed experts, top-1, plus the shared expert), layer 3 NoPE
# (the default interval of 4), GQA 4:1, tied embeddings: about 10M parameters, 20 MB in bf16.
TINY_MAVERICK = dict(vocab_size=8192, hidden_size=256, intermediate_size=256, intermediate_size_mlp=768,
                     num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                     num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2,
                     attention_chunk_size=8192, max_position_embeddings=4096, tie_word_embeddings=True,
                     rope_theta=500000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                     architectures=["Llama4ForCausalLM"])


@dataclass
class TargetTrainConfig:
    out: str  # the finished checkpoint folder
    work_dir: str = "runs/train-target"  # token cache and resumable state
    corpus: list[str] = field(default_factory=lambda: list(DEBIAN_DOC_DIRS))
    model: dict = field(default_factory=lambda: dict(TINY_MAVERICK))
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 3000
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    eval_every: int = 250
    save_every: int = 250
    val_windows: int = 64
    val_percent: int = 2
    bf16_autocast: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "steps", "eval_every", "save_every", "val_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 < self.val_percent < 50:
            raise ValueError(f"val_percent must be in 1..49, got {self.val_percent}")


class TargetTrainer:
    def __init__(self, config: TargetTrainConfig):
        self.config = config
        self.work = Path(config.work_dir)
        self.work.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(config.seed)
        self.tokenizer = self._tokenizer()
        self.train_tokens, self.val_tokens = self._token_streams()
        self.model_config = model_config_from_dict(config.model)
        self.model = self._init_model()
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}], lr=config.lr,
                                           betas=(0.9, 0.95))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_factor)
        self.step = 0
        self.elapsed_s = 0.0
        self.history: list[dict] = []
        self._resume()

    def lr_factor(self, step: int) -> float:
        c = self.config
        if step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        progress = min(1.0, (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps))
        return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def _tokenizer(self) -> Tokenizer:
        path = self.work / "tokenizer" / "tokenizer.json"
        if not path.exists():
            train, _ = split_documents(read_documents(self.config.corpus), self.config.val_percent)
            tokenizer = train_bpe((d.text for d in train), self.config.model["vocab_size"], show_progress=True)
            save_tokenizer(tokenizer, path.parent, self.config.model["max_position_embeddings"])
        return Tokenizer.from_file(str(path))

    def _token_streams(self) -> tuple[np.ndarray, np.ndarray]:
        """Train and validation token streams (documents joined by EOS), cached as .npy."""
        paths = self.work / "train_tokens.npy", self.work / "val_tokens.npy"
        if not all(p.exists() for p in paths):
            train, val = split_documents(read_documents(self.config.corpus), self.config.val_percent)
            eos = self.tokenizer.token_to_id(EOS)
            for docs, path in zip((train, val), paths, strict=True):
                stream: list[int] = []
                encodings = self.tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False)
                for encoding in tqdm(encodings, desc=f"tokenize {path.stem}", unit="doc", disable=None):
                    stream.extend(encoding.ids)
                    stream.append(eos)
                np.save(path, np.asarray(stream, dtype=np.uint16))
        return np.load(paths[0]), np.load(paths[1])

    def _init_model(self) -> Llama4ForCausalLM:
        model = Llama4ForCausalLM(self.model_config, torch.float32)
        # GPT-2 style: N(0, 0.02), the projections that write into the residual stream scaled down by
        # sqrt(2 * layers) so the stream's variance does not grow with depth.
        residual_std = 0.02 / math.sqrt(2 * self.model_config.num_hidden_layers)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                    param.normal_(0.0, residual_std)
                else:
                    param.normal_(0.0, 0.02)
                param.requires_grad_(True)
        return model

    def _resume(self) -> None:
        path = self.work / "state.pt"
        if path.exists():
            state = torch.load(path, weights_only=False)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.step, self.elapsed_s, self.history = state["step"], state["elapsed_s"], state["history"]
            torch.set_rng_state(state["rng"])

    def _save_state(self) -> None:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "step": self.step, "elapsed_s": self.elapsed_s,
                 "history": self.history, "rng": torch.get_rng_state()}
        torch.save(state, self.work / "state.tmp")
        (self.work / "state.tmp").replace(self.work / "state.pt")  # a kill mid-save keeps the old state

    def batch(self, tokens: np.ndarray, starts: np.ndarray) -> torch.Tensor:
        """[len(starts), seq_len + 1] windows of the stream."""
        window = np.stack([tokens[s : s + self.config.seq_len + 1] for s in starts]).astype(np.int64)
        return torch.from_numpy(window)

    def loss(self, windows: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.config.bf16_autocast):
            logits = causal_lm_logits(self.model, windows[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())

    @torch.no_grad()
    def validation_perplexity(self) -> float:
        """exp(mean cross-entropy) over `val_windows` evenly spaced held-out windows (the same every time)."""
        c = self.config
        starts = np.linspace(0, len(self.val_tokens) - c.seq_len - 2, c.val_windows).astype(np.int64)
        losses = [self.loss(self.batch(self.val_tokens, starts[i : i + c.batch_size])).item()
                  for i in range(0, len(starts), c.batch_size)]
        return math.exp(sum(losses) / len(losses))

    def train(self) -> dict:
        c = self.config
        rng = np.random.default_rng(c.seed + self.step)  # a resumed run does not replay the same batches
        # Shown in a log file too (an hour-long run is usually redirected), at most every 10 s there.
        progress = tqdm(total=c.steps, initial=self.step, desc="train-target", unit="step", mininterval=10)
        while self.step < c.steps:
            started = time.perf_counter()
            starts = rng.integers(0, len(self.train_tokens) - c.seq_len - 1, c.batch_size)
            loss = self.loss(self.batch(self.train_tokens, starts))
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            seconds = time.perf_counter() - started
            self.elapsed_s += seconds
            progress.update(1)
            progress.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{c.batch_size * c.seq_len / seconds:.0f}",
                                 refresh=False)
            if self.step % c.eval_every == 0 or self.step == c.steps:
                self.history.append({"step": self.step, "train_loss": loss.item(),
                                     "val_perplexity": self.validation_perplexity(), "elapsed_s": self.elapsed_s})
                progress.write(json.dumps(self.history[-1]))
            if self.step % c.save_every == 0 or self.step == c.steps:
                self._save_state()
        progress.close()
        return self.save()

    def save(self) -> dict:
        """The bf16 Hugging Face checkpoint, its tokenizer, and training_report.json."""
        out = Path(self.config.out)
        export = Llama4ForCausalLM(self.model_config, torch.bfloat16)
        with torch.no_grad():
            for param, trained in zip(export.parameters(), self.model.parameters(), strict=True):
                param.copy_(trained)
        save_checkpoint(export, out)
        save_tokenizer(self.tokenizer, out, self.model_config.max_position_embeddings)
        report = {"config": asdict(self.config), "steps": self.step, "train_seconds": round(self.elapsed_s, 1),
                  "train_tokens_seen": self.step * self.config.batch_size * self.config.seq_len,
                  "corpus_train_tokens": len(self.train_tokens), "corpus_val_tokens": len(self.val_tokens),
                  "val_perplexity": self.history[-1]["val_perplexity"] if self.history else None,
                  "history": self.history}
        (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
        return report
