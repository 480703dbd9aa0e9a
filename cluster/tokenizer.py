"""Hugging Face `tokenizer.json` through the `tokenizers` library, and incremental detokenization."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from warpspec.workers.errors import CheckpointError

# Prompt tokens kept as left context when detokenizing outputs, so that tokenizers whose decoding
# depends on the previous token (leading-space markers) render the first output token correctly.
CONTEXT_TOKENS = 5


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer):
        self.hf = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer | None:
        """None when the checkpoint ships no tokenizer.json (prompts must then be token ids)."""
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:  # the tokenizers library raises bare Exceptions on bad files
            raise CheckpointError(f"{path} could not be read as a tokenizer: {e}") from None

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=True).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas without ever splitting a multi-byte
    character: a delta that would end in U+FFFD (half a UTF-8 sequence) waits for the next token."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        # ids[prefix_offset:read_offset] is already-emitted context; ids[read_offset:] is pending.
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of a request: whatever is pending, incomplete characters included."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
