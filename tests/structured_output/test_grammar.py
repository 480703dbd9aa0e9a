"""GrammarCompiler on the bundled tokenizer: what llguidance refuses is refused at the boundary by
field and by name, grammars are cached by content, and the masks of a step follow the drafts before
each row and leave the matcher where it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from warpspec.assets import BUNDLED_TARGET
from warpspec.errors import InvalidRequestError
from warpspec.sampling_params import StructuredOutputs
from warpspec.structured_output.grammar import GrammarCompiler, allowed_next, allowed_tokens
from warpspec.tokenizer import Tokenizer

EOS = 2


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(BUNDLED_TARGET)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.hf.to_str(), tokenizer.vocab_size, [EOS])


@pytest.mark.parametrize("spec,message", [
    # Keywords a grammar cannot enforce are named, never dropped (xgrammar accepts [1, 1] here).
    (StructuredOutputs(json={"type": "array", "uniqueItems": True}),
     r'structured_output.json cannot be enforced: Unimplemented keys: \["uniqueItems"\]'),
    (StructuredOutputs(json={"not": {"type": "string"}}), r'Unimplemented keys: \["not"\]'),
    (StructuredOutputs(json={"type": "strnig"}), "structured_output.json cannot be enforced: Invalid type: strnig"),
    (StructuredOutputs(json='{"type": '), "structured_output.json is not a JSON schema: EOF while parsing"),
    (StructuredOutputs(json={"type": "string", "pattern": "(("}), "unclosed group"),
    (StructuredOutputs(regex="a(b"), "(?s)structured_output.regex cannot be enforced: .*unclosed group"),
    (StructuredOutputs(grammar="start: x\nx: y"),
     '(?s)structured_output.grammar cannot be enforced: .*unknown name: "y"'),
    # The field the request used is the one named.
    (StructuredOutputs(json={"type": "strnig"}, field_name="response_format.json_schema.schema"),
     "response_format.json_schema.schema cannot be enforced: Invalid type"),
])
def test_what_the_grammar_library_refuses_is_refused_by_name(compiler, spec, message):
    with pytest.raises(InvalidRequestError, match=message):
        compiler.check(spec)


def test_a_grammar_past_a_parser_limit_is_refused_naming_the_limit(tokenizer):
    small = GrammarCompiler(tokenizer.hf.to_str(), tokenizer.vocab_size, [EOS], limits={"initial_lexer_fuel": 1000})
    schema = {"type": "object", "properties": {f"f{i}": {"type": "integer"} for i in range(30)}}
    with pytest.raises(InvalidRequestError, match=r"too big \(limit for this grammar: 1000\)"):
        small.check(StructuredOutputs(json=schema))


def test_grammars_are_checked_once_per_content(compiler):
    first = compiler.check(StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    size = len(compiler._checked)
    # The same schema with its keys in another order, and as JSON text: one entry.
    again = compiler.check(StructuredOutputs(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}'))
    assert again == first and len(compiler._checked) == size


def test_masks_follow_the_drafts_before_each_row_and_leave_the_matcher_unchanged(compiler, tokenizer):
    matcher = compiler.matcher(StructuredOutputs(choice=["yes", "no"]))
    yes = tokenizer.hf.encode("yes", add_special_tokens=False).ids
    assert len(yes) == 1
    before = allowed_next([matcher], compiler.vocab_size)[0]
    # Row 3 of a 6-row step: the row itself, after "yes", and after a refused draft.
    refused = tokenizer.hf.encode("maybe", add_special_tokens=False).ids[0]
    allowed = compiler.fill_masks([(matcher, 3, [yes[0], refused])], 6)
    assert torch.equal(allowed[3], before) and before[yes[0]] and not before[refused]
    assert allowed[4].nonzero().flatten().tolist() == [EOS]  # "yes" is complete: only eos may follow
    assert allowed[5].all() and allowed[:3].all()  # past a refused draft, and rows of no request: unmasked
    assert torch.equal(allowed_next([matcher], compiler.vocab_size)[0], before)  # rolled back
    assert matcher.consume_token(yes[0]) and matcher.is_stopped()


def test_bitmask_words_read_least_significant_bit_first():
    bitmask = np.array([[0b101, -(2**31) | 1]], dtype=np.int32)  # word 1: bits 0 and 31
    allowed = allowed_tokens(bitmask, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, 32]  # bit 31 of word 1 is token 63, past 40
