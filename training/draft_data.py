"""Training text for an EAGLE-3 draft written by its own target: greedy continuations of prompts cut
from the corpus's training documents. A draft learns best what it will be asked at serving time, the
target's own outputs, and the token ids are kept as generated (re-tokenizing decoded text can split
differently).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from warpspec.entrypoints.llm import LLM
from warpspec.sampling_params import SamplingParams
from warpspec.tokenizer import Tokenizer
from warpspec.training.corpus import DEBIAN_DOC_DIRS, read_documents, split_documents


def corpus_prompts(tokenizer: Tokenizer, num_prompts: int, prompt_tokens: int, seed: int = 0,
                   dirs: list[str] | tuple[str, ...] = DEBIAN_DOC_DIRS, validation: bool = False,
                   val_percent: int = 2) -> list[list[int]]:
    """num_prompts prompts of BOS + prompt_tokens tokens from random documents of one split: random
    windows from training documents (the distribution the draft must cover); for validation, the
    openings of English prose paragraphs (what a user would type, not a table or a code listing)."""
    train, val = split_documents(read_documents(dirs), val_percent)
    rng = random.Random(seed)
    if validation:
        paragraphs = [p for d in val for p in d.text.split("\n\n") if is_prose(p)]
        rng.shuffle(paragraphs)
        prompts = [tokenizer.encode(p)[: 1 + prompt_tokens] for p in paragraphs]
        return [p for p in prompts if len(p) == 1 + prompt_tokens][:num_prompts]
    prompts = []
    while len(prompts) < num_prompts:
        bos, *ids = tokenizer.encode(rng.choice(train).text)  # the tokenizer prepends BOS
        if len(ids) > prompt_tokens:
            start = rng.randrange(len(ids) - prompt_tokens)
            prompts.append([bos, *ids[start : start + prompt_tokens]])
    return prompts


def is_prose(paragraph: str) -> bool:
    """ASCII text of some length, mostly letters and spaces, not a directive or a list."""
    text = paragraph.strip()
    if len(text) < 200 or not text.isascii() or text[0] in ".:*-|=`+#0123456789":
        return False
    return sum(c.isalpha() or c == " " for c in text) / len(text) > 0.9


def write_draft_corpus(target: str, out: str, num_samples: int = 1024, prompt_tokens: int = 32,
                       max_tokens: int = 128, seed: int = 0, dirs: list[str] | tuple[str, ...] = DEBIAN_DOC_DIRS,
                       batch_size: int = 128) -> Path:
    """JSONL, one {"token_ids": prompt + greedy continuation} per line."""
    tokenizer = Tokenizer.from_dir(target)
    if tokenizer is None:
        raise ValueError(f"{target} has no tokenizer.json")
    prompts = corpus_prompts(tokenizer, num_samples, prompt_tokens, seed, dirs)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with LLM(target, max_num_seqs=batch_size) as llm, path.open("w") as f:
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            for prompt, output in zip(batch, llm.generate(batch, params, use_tqdm=True), strict=True):
                f.write(json.dumps({"token_ids": prompt + output.token_ids}) + "\n")
    return path


def write_held_out_prompts(target: str, out: str, num_prompts: int = 16, prompt_tokens: int = 32,
                           seed: int = 0, dirs: list[str] | tuple[str, ...] = DEBIAN_DOC_DIRS) -> Path:
    """Prompts from validation documents (neither model trained on them), as ids and text, for the
    demo and the benchmarks."""
    tokenizer = Tokenizer.from_dir(target)
    prompts = corpus_prompts(tokenizer, num_prompts, prompt_tokens, seed, dirs, validation=True)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"prompt_token_ids": prompts, "text": [tokenizer.decode(p) for p in prompts]},
                               indent=1) + "\n")
    return path
