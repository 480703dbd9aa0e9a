"""The tools of a chat request: checked at the boundary, and the grammar that enforces tool_choice.

    tools        [{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]
    tool_choice  "auto" (default with tools) | "none" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls  true (default): "required" may call several tools at once

"auto" lets the model choose, and what it writes is parsed (tool_parser.py). "required" and a named
function are enforced with the grammar (structured_output/grammar.py), whatever the model: its
output is then a call in the JSON form, one object, or a list of them when "required" may call
several:

    named / required, one call   {"name": "get_weather", "parameters": {"city": "Paris"}}
    required, parallel           [{"name": "get_weather", "parameters": {...}}, {"name": "add", ...}]

A list that a small model keeps growing ends at max_tokens; MAX_PARALLEL_CALLS bounds it first. An
object of parameters that does not say whether it takes more properties than it lists takes none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import jsonschema

from warpspec.errors import InvalidRequestError
from warpspec.sampling_params import StructuredOutputs

MAX_TOOLS = 128  # OpenAI's limit
MAX_PARALLEL_CALLS = 8
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolRequest:
    functions: list[dict]  # each tool's "function" object, parameters defaulted
    choice: str  # "auto", "none", "required" or "named"
    named: str | None = None  # the function tool_choice names
    parallel: bool = True

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}

    @property
    def parses_calls(self) -> bool:
        """Are calls read out of the reply? Not with tool_choice "none"."""
        return self.choice != "none"

    def structured_output(self) -> StructuredOutputs | None:
        """The grammar "required" and a named choice are enforced with; None for auto and none."""
        if self.choice == "named":
            (function,) = [f for f in self.functions if f["name"] == self.named]
            return StructuredOutputs(json=_call_schema(function), field_name="tool_choice")
        if self.choice != "required":
            return None
        one = {"anyOf": [_call_schema(f) for f in self.functions]}
        schema = ({"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}
                  if self.parallel else one)
        return StructuredOutputs(json=schema, field_name="tools")


def _call_schema(function: dict) -> dict:
    parameters = function["parameters"]
    if parameters.get("type") == "object" and "additionalProperties" not in parameters:
        # Arguments the function does not declare are no use to it, and a model free to add keys may
        # never stop (as OpenAI's strict mode, unless the schema allows them itself).
        parameters = {**parameters, "additionalProperties": False}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "parameters": parameters},
            "required": ["name", "parameters"], "additionalProperties": False}


def tool_request(body: dict) -> ToolRequest | None:
    """The request's tools, tool_choice and parallel_tool_calls, each error naming its field; None
    without tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError(f"parallel_tool_calls must be a boolean, got {parallel!r:.80}")
    if tools is None:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools: the request names no tools to choose from")
        return None
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools holds {len(tools)} tools; at most {MAX_TOOLS} are allowed")
    functions = [_function(i, tool) for i, tool in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise InvalidRequestError(f"tools: function names must be unique; {', '.join(twice)} appear more than once")
    request = ToolRequest(functions, "auto", parallel=True if parallel is None else parallel)
    if choice is None or choice in ("auto", "none", "required"):
        request.choice = choice or "auto"
        return request
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        raise InvalidRequestError('tool_choice must be "auto", "none", "required" or {"type": "function", '
                                  f'"function": {{"name": ...}}}}, got {choice!r:.80}')
    named = choice["function"].get("name")
    if named not in names:
        raise InvalidRequestError(f"tool_choice.function.name {named!r:.80} is not among the tools' names "
                                  f"({', '.join(names)})")
    request.choice, request.named = "named", named
    return request


def _function(index: int, tool: object) -> dict:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise InvalidRequestError(f'{where} must be {{"type": "function", "function": {{"name": ...}}}}')
    function = tool["function"]
    unknown = sorted(set(function) - _FUNCTION_FIELDS)
    if unknown:
        raise InvalidRequestError(f"{where}.function has unknown field(s) {', '.join(unknown)}")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRequestError(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r:.80}")
    if not isinstance(function.get("description", ""), str):
        raise InvalidRequestError(f"{where}.function.description must be a string")
    parameters = function.get("parameters", NO_PARAMETERS)
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema object, "
                                  f"got {type(parameters).__name__}")
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p!r}]" for p in e.path)
        raise InvalidRequestError(f"{where}.function.parameters{path} is not a valid JSON schema: "
                                  f"{e.message[:300]}") from None
    return {**function, "parameters": parameters}
