"""Per-request generation settings, validated where the user hands them in."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from warpspec.errors import InvalidRequestError

# Caps on what one request may ask for. Every step scans each running request's stop strings against
# its new text, so their number and length bound the per-token cost a client can impose.
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes at most 64 bits
# A temperature this small divides logits into float32 overflow (inf - inf = NaN in the softmax);
# the distribution is one-hot long before it, so such a request is sampled greedily instead.
MIN_SAMPLING_TEMPERATURE = 1e-5
# Caps on a grammar's source: the replica compiles every one it is sent.
MAX_GRAMMAR_CHARS = 100_000
MAX_CHOICES = 1_024


KINDS = ("json", "json_object", "regex", "choice", "grammar")  # StructuredOutputs' alternatives


@dataclass(frozen=True)
class StructuredOutputs:
    """Constrain a request's output to a grammar (the names of vLLM's StructuredOutputsParams), exactly
    one of: json, a JSON schema (a dict, or its JSON text); json_object, any JSON object; regex; choice,
    one of these strings; grammar, a Lark or GBNF grammar. Here only the shape is checked; the grammar
    itself is compiled, and refused by name, where the tokenizer is (structured_output/grammar.py)."""
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    # What errors call the grammar: the request field it came from (the OpenAI API's
    # "response_format.json_schema.schema"); structured_output.<kind> when None.
    field_name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError("structured_output takes exactly one of json, json_object, regex, choice, "
                                      f"grammar; got {', '.join(given) or 'none'}")
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError(f"{self._named('json_object')} must be a boolean, got {self.json_object!r:.80}")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise InvalidRequestError(f"{self._named('json')} must be a JSON schema (an object or its JSON text), "
                                      f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{self._named(name)} must be a non-empty string, got {value!r:.80}")
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not self.choice:
                raise InvalidRequestError(f"{self._named('choice')} must be a non-empty list of strings, "
                                          f"got {self.choice!r:.80}")
            if len(self.choice) > MAX_CHOICES:
                raise InvalidRequestError(f"{self._named('choice')} has {len(self.choice)} strings; at most "
                                          f"{MAX_CHOICES} are allowed")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidRequestError(f"{self._named('choice')} must hold non-empty strings only")
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(f"{self.field} is {len(self.source)} characters; at most "
                                      f"{MAX_GRAMMAR_CHARS} are allowed")

    @property
    def kind(self) -> str:
        """The one field given: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @property
    def field(self) -> str:
        """The request field errors name."""
        return self._named(self.kind)

    def _named(self, kind: str) -> str:
        return self.field_name or f"structured_output.{kind}"

    @property
    def source(self) -> str:
        """The grammar's text as one string (a schema in canonical JSON): what compiled grammars are
        cached by."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            try:
                value = json.loads(value) if isinstance(value, str) else value
            except ValueError:
                return value  # refused when compiled, by the JSON parser's message
            return json.dumps(value, sort_keys=True, separators=(",", ":"))
        if self.kind == "choice":
            return json.dumps(list(value))
        return "" if value is True else value


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the most likely one
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output
    presence_penalty: float = 0.0  # in [-2, 2], subtracted once from tokens already generated
    frequency_penalty: float = 0.0  # in [-2, 2], subtracted per occurrence in the output
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Top-k log-probabilities (natural log, of the model's distribution before temperature/top-k/top-p
    # and before a structured output's mask)
    # per generated / prompt position, plus the chosen token's own.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Output constrained to a JSON schema, a regex, a choice or a grammar (a dict of its fields is taken too).
    structured_output: StructuredOutputs | None = None
    # Speculative decoding for this request: None lets the engine choose each step's draft length
    # (speculative_policy), False never drafts for it, True asks for it (refused where no draft is loaded).
    speculation: bool | None = None
    # Scheduling order: a lower number is served first and, when the batch or the KV cache is full,
    # preempts a running request of a higher number. Requests wait in order of priority, aged by
    # SchedulerConfig.priority_aging_steps, then of arrival. It never changes a request's tokens.
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.structured_output, dict):
            unknown = sorted(set(self.structured_output) - set(KINDS))
            if unknown:
                raise InvalidRequestError(f"structured_output has unknown field(s) {', '.join(unknown)}")
            self.structured_output = StructuredOutputs(**self.structured_output)
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutputs):
            raise InvalidRequestError("structured_output must be StructuredOutputs or a dict of its fields, got "
                                      f"{type(self.structured_output).__name__}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list | tuple):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        if not isinstance(self.stop_token_ids, list | tuple):
            raise InvalidRequestError(f"stop_token_ids must be a list of integers, got "
                                      f"{type(self.stop_token_ids).__name__}")
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _require_int("max_tokens", self.max_tokens, minimum=1, maximum=2**31 - 1)
        _require_float("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if 0 < self.temperature < MIN_SAMPLING_TEMPERATURE:
            self.temperature = 0.0
        _require_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        _require_int("top_k", self.top_k, minimum=-1, maximum=2**31 - 1)
        _require_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        _require_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require_float(name, value)
            if not -2 <= value <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}")
        if self.speculation is not None and not isinstance(self.speculation, bool):
            raise InvalidRequestError(f"speculation must be true, false or null, got {self.speculation!r:.80}")
        _require_int("priority", self.priority, minimum=-(2**31), maximum=2**31 - 1)
        if self.seed is not None:
            _require_int("seed", self.seed, minimum=0, maximum=MAX_SEED)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r:.80}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, "
                                          f"got one of {len(s)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"stop_token_ids has {len(self.stop_token_ids)} ids; at most "
                                      f"{MAX_STOP_TOKEN_IDS} are allowed")
        for t in self.stop_token_ids:
            _require_int("stop_token_ids", t, minimum=0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require_int(name, value, minimum=0)
                if value > MAX_LOGPROBS:
                    raise InvalidRequestError(f"{name} must be at most {MAX_LOGPROBS}, got {value}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def effective_top_k(self) -> int:
        return 0 if self.top_k in (-1, 0) else self.top_k


def _require_int(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r:.80}")
    if value < minimum:
        raise InvalidRequestError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidRequestError(f"{name} must be <= {maximum}, got {value}")


def _require_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"{name} must be a number, got {value!r:.80}")
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be finite, got {value}")
