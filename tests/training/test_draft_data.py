"""`warpspec draft-data`: the target's own greedy continuations of corpus prompts, as token ids that
the draft trainer reads unchanged."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from warpspec import LLM, SamplingParams
from warpspec.training.draft_data import write_draft_corpus
from warpspec.training.eagle3_trainer import read_corpus
from warpspec.training.random_checkpoint import create_random_checkpoint


def test_writes_target_continuations_the_trainer_reads(tmp_path):
    corpus = tmp_path / "docs"
    corpus.mkdir()
    stdlib = Path(sys.modules["os"].__file__).parent
    for path in sorted(stdlib.glob("*.py"))[:12]:
        (corpus / f"{path.stem}.txt").write_text(path.read_text(errors="ignore"))
    target = create_random_checkpoint(tmp_path / "target", "tiny")
    out = write_draft_corpus(str(target), str(tmp_path / "data.jsonl"), num_samples=6, prompt_tokens=8,
                             max_tokens=5, dirs=[str(corpus)], batch_size=4)
    rows = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    assert len(rows) == 6 and all(len(r) == 1 + 8 + 5 and r[0] == 1 for r in rows)  # BOS, prompt, output
    with LLM(str(target)) as llm:  # each row continues as the target would, greedily
        again = llm.generate([rows[0][:9]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert again.token_ids == rows[0][9:]
    assert read_corpus(str(out)) == rows
