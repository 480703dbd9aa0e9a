"""The offline lm-eval task: one item per held-out document, its own next words among others'."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from warpspec.assets import held_out_texts
from warpspec.benchmarks.lm_eval_task import CONTEXT_WORDS, CONTINUATION_WORDS, NUM_CHOICES, write_task


def test_task_items_hold_each_document_s_own_continuation(tmp_path):
    folder = write_task(tmp_path / "task")
    task = yaml.safe_load((folder / "warpspec_held_out.yaml").read_text())
    assert task["task"] == "warpspec_held_out" and task["output_type"] == "multiple_choice"
    data = Path(task["dataset_kwargs"]["data_files"]["test"])
    items = [json.loads(line) for line in data.read_text().splitlines()]
    texts = held_out_texts()
    assert len(items) == len(texts)
    for item, text in zip(items, texts, strict=True):
        words = text.split()
        assert item["context"] == " ".join(words[:CONTEXT_WORDS])
        assert len(item["choices"]) == len(set(item["choices"])) == NUM_CHOICES
        assert item["choices"][item["label"]] == " ".join(words[CONTEXT_WORDS : CONTEXT_WORDS + CONTINUATION_WORDS])
    assert {item["label"] for item in items} == set(range(NUM_CHOICES))  # the answer's place varies
