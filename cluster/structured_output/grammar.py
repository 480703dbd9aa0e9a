"""Grammars for structured outputs, through llguidance, and the token masks they give each step.

llguidance rather than xgrammar (both measured on the bundled tokenizer, benchmarks/structured_output.py):
xgrammar compiled `{"not": {"type": "string"}}` and `uniqueItems`, then accepted documents that
break them ("abc", [1, 1]): a server that answers but does not enforce the schema. llguidance refuses
each keyword it cannot enforce by name ("Unimplemented keys: [\"uniqueItems\"]"), which is the 400 a
client needs. Its masks cost more (a median 10-40 us a token along a 30-field document, against
xgrammar's 1-2), still far under a step's milliseconds.

    GrammarCompiler.check(spec)    at the boundary: the grammar compiles, or InvalidRequestError
    GrammarCompiler.submit(spec)   in the engine core: a matcher built off the step loop's thread
    fill_masks(...)                each step: the allowed tokens at every row a request samples or
                                   verifies, the drafts before a row consumed first, then rolled back
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy
import numpy as np
import torch

from warpspec.errors import InvalidRequestError
from warpspec.sampling_params import StructuredOutputs

# Bounds on the work one grammar may cost (llguidance's ParserLimits): building its lexer, and each
# step's mask. A schema past them is refused with llguidance's message, which names the limit.
PARSER_LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, max_grammar_size=200_000)
CACHED_GRAMMARS = 1_024  # checked grammars kept, by source
# JSON as json.dumps writes it: one space after "," and ":", none elsewhere. Free whitespace lets a
# model pad its output with newlines until max_tokens, a failure small models fall into; a schema's
# own "x-guidance" options override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def to_grammar(spec: StructuredOutputs) -> str:
    """The llguidance grammar of spec (not yet checked)."""
    if spec.kind == "json":
        schema = spec.json
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        except ValueError as e:  # not JSON, or not an object
            raise InvalidRequestError(f"{spec.field} is not a JSON schema: {e}") from None
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", list(spec.choice))
    try:
        return llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as e:
        raise InvalidRequestError(f"{spec.field} does not parse: {e}") from None


class GrammarCompiler:
    """One model's grammars: checked once per source and cached, and turned into matchers.

    tokenizer_json: the checkpoint's tokenizer.json text; vocab_size: the model's (its logits' width,
    which may exceed the tokenizer's); eos_token_ids: what ends a request once its grammar is complete;
    limits: llguidance's ParserLimits (PARSER_LIMITS by default)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int],
                 limits: dict[str, int] | None = None):
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self.limits = llguidance.LLParserLimits(**(limits or PARSER_LIMITS), verbose_errors=False)
        self._checked: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()
        self._builder: ThreadPoolExecutor | None = None
        self.executor = llguidance.LLExecutor(num_threads=1)  # one thread: the step's own need the cores

    def check(self, spec: StructuredOutputs) -> str:
        """spec's grammar, compiled once to prove it can run; InvalidRequestError naming the field and
        what llguidance refused (an unsupported keyword, a regex that does not compile, a limit)."""
        key = (spec.kind, spec.source)
        with self._lock:
            if key in self._checked:
                self._checked.move_to_end(key)
                return self._checked[key]
        grammar = to_grammar(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer,
                                                                                 limits=self.limits)
        if is_error:
            raise InvalidRequestError(f"{spec.field} cannot be enforced: {messages[0][:400]}")
        with self._lock:
            self._checked[key] = grammar
            while len(self._checked) > CACHED_GRAMMARS:
                self._checked.popitem(last=False)
        return grammar

    def matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A new matcher at the start of spec's grammar."""
        matcher = llguidance.LLMatcher(self.tokenizer, self.check(spec), limits=self.limits, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{spec.field} cannot be enforced: {matcher.get_error()[:400]}")
        return matcher

    def submit(self, spec: StructuredOutputs) -> Future[llguidance.LLMatcher]:
        """matcher(spec), built on a thread of its own (llguidance releases the GIL while it builds), so
        that a large grammar never holds up the steps of the requests already running."""
        if self._builder is None:
            self._builder = ThreadPoolExecutor(1, thread_name_prefix="warpspec-grammar")
        return self._builder.submit(self.matcher, spec)

    def fill_masks(self, matchers: list[tuple[llguidance.LLMatcher, int, list[int]]], num_rows: int) -> torch.Tensor:
        """The allowed tokens of num_rows logits rows, [num_rows, vocab_size] bool: for each
        (matcher, row, drafts), row + j for j = 0 .. len(drafts) holds what the grammar allows after
        the drafts before it. Rows after a draft the grammar refuses, and rows of no matcher, allow
        everything (verification never reads past a refused draft: its probability is 0). The
        matchers end where they began."""
        bitmask = llguidance.numpy.allocate_token_bitmask(num_rows, self.vocab_size)
        with_drafts = [(m, row, drafts) for m, row, drafts in matchers if drafts]
        if with_drafts:
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(self.executor, with_drafts, bitmask)
        without = [(m, row) for m, row, drafts in matchers if not drafts]  # llguidance takes no empty drafts
        if without:
            llguidance.numpy.fill_next_token_bitmask_par(self.executor, without, bitmask)
        return allowed_tokens(bitmask, self.vocab_size)

    def close(self) -> None:
        if self._builder is not None:
            self._builder.shutdown(wait=False, cancel_futures=True)


def allowed_next(matchers: list[llguidance.LLMatcher], vocab_size: int) -> torch.Tensor:
    """[len(matchers), vocab_size] bool: what each matcher allows next. One matcher at a time: no
    executor to hold (an LLExecutor made in the EAGLE-3 proposer's __init__ kept the draft model
    alive after shutdown), and for a draft step's few rows no slower than the executor's call."""
    bitmask = llguidance.numpy.allocate_token_bitmask(len(matchers), vocab_size)
    for row, matcher in enumerate(matchers):
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, row)
    return allowed_tokens(bitmask, vocab_size)


def allowed_tokens(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask [rows, ceil(vocab / 32)] int32 (bit j of word w: token 32 w + j) ->
    [rows, vocab_size] bool. numpy's unpackbits: 12 us for 8 rows of 8,192 tokens here, against 380
    for shifting and masking in torch. (llguidance.numpy, not llguidance.torch: importing that one
    costs 2.6 s, as it compiles its own mask kernel with torch.compile.)"""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)


def masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits with what allowed [rows, vocab] refuses at -inf (torch.where: a third of masked_fill's
    time here)."""
    return torch.where(allowed.to(logits.device), logits, float("-inf"))
