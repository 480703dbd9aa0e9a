from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from warpspec.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "naïve café — 東京 🚀 ok"


def _byte_level_tokenizer() -> Tokenizer:
    """A tokenizer trained on ASCII only, so every non-ASCII character spans several byte tokens."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(["plain ascii text for training"] * 10, trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return Tokenizer(hf)


def test_deltas_never_split_a_multibyte_character():
    tokenizer = _byte_level_tokenizer()
    ids = tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT)  # multi-byte characters did split into several tokens
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=tokenizer.encode("prompt:"), skip_special_tokens=True)
    deltas = [detok.add([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == TEXT
    assert sum(1 for d in deltas if d == "") > 0  # some tokens had to wait for the rest of a character


def test_flush_emits_an_incomplete_tail():
    tokenizer = _byte_level_tokenizer()
    ids = tokenizer.encode("ok 🚀")
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    text = "".join(detok.add([t]) for t in ids[:-1])
    assert text == "ok "  # the rocket's first bytes are held back
    assert "\ufffd" in detok.flush()
