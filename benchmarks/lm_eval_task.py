"""An lm-eval multiple-choice task that runs offline: continue each held-out document of the bundled
pair (text neither model saw in training) with its own next words or with another document's.

    python -m warpspec.benchmarks.lm_eval_task runs/lm_eval
    lm_eval --model local-completions --include_path runs/lm_eval --tasks warpspec_held_out \\
        --model_args model=tiny-maverick,base_url=http://localhost:8000/v1/completions,\\
tokenizer_backend=huggingface,tokenizer=assets/tiny-maverick,add_bos_token=True

Each item is scored as lm-eval scores any multiple-choice task over an API: one /v1/completions
request per choice with `echo`, `logprobs` 1 and `max_tokens` 1, summing the logprobs of the
choice's tokens. Chance is 1 / NUM_CHOICES.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from warpspec.assets import held_out_texts

NUM_CHOICES = 4
CONTEXT_WORDS = 10
CONTINUATION_WORDS = 5

TASK = """task: warpspec_held_out
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def items() -> list[dict]:
    """One item per held-out document: its first words, and its next words among the next words of
    the following documents (in a fixed rotation, so the answer's place varies)."""
    docs = [text.split() for text in held_out_texts()]
    out = []
    for i, words in enumerate(docs):
        options = [" ".join(docs[(i + j) % len(docs)][CONTEXT_WORDS : CONTEXT_WORDS + CONTINUATION_WORDS])
                   for j in range(NUM_CHOICES)]
        label = i % NUM_CHOICES
        options[0], options[label] = options[label], options[0]
        out.append({"context": " ".join(words[:CONTEXT_WORDS]), "choices": options, "label": label})
    return out


def write_task(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "warpspec_held_out.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items()))
    (folder / "warpspec_held_out.yaml").write_text(TASK.format(data=data.resolve()))
    return folder


if __name__ == "__main__":
    print(f"wrote the task to {write_task(Path(sys.argv[1] if len(sys.argv) > 1 else 'runs/lm_eval'))}")
