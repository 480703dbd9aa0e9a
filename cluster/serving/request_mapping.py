"""Network messages <-> engine types: gRPC requests to (prompt, SamplingParams), engine outputs to
gRPC responses. Every check a client can fail names the field as the client spelled it."""

from __future__ import annotations

from google.protobuf import unknown_fields

from warpspec.core.engine_core import Prompt
from warpspec.errors import InvalidRequestError
from warpspec.outputs import PositionLogprobs, RequestOutput, new_positions
from warpspec.protos.warpspec.v1 import generation_pb2 as pb
from warpspec.sampling_params import SamplingParams, StructuredOutputs
from warpspec.serving.grpc_servicers import MalformedMessage
from warpspec.serving.limits import RequestLimits

# proto field -> SamplingParams field, for the `optional` scalars copied only when set.
_OPTIONAL_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs",
                    "repetition_penalty", "presence_penalty", "frequency_penalty", "skip_special_tokens",
                    "speculation", "priority")
# float fields travel as 32-bit floats: 0.9 arrives as 0.8999999761581421. Round back to what the
# client most likely wrote, so that limits like top_p <= 1 and penalties in [-2, 2] behave exactly.
_FLOAT_PARAMS = {"temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"}


MAX_REQUEST_ID_CHARS = 256  # echoed in every response and written to logs


def check_max_tokens(max_tokens: object, max_model_len: int, field: str = "max_tokens") -> None:
    """A max_tokens the model can never reach is a client error, not a silent truncation."""
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > max_model_len:
        raise InvalidRequestError(f"{field} must be at most max_model_len {max_model_len}, got {max_tokens}")


def reject_unknown_fields(message, name: str) -> None:
    """Proto3 keeps fields it does not know silently; a client speaking a newer API version would get
    defaults it did not ask for, so say so instead. Bytes that did not parse at all are refused too."""
    if isinstance(message, MalformedMessage):
        raise InvalidRequestError(message.describe())
    numbers = sorted({field.field_number for field in unknown_fields.UnknownFieldSet(message)})
    if numbers:
        raise InvalidRequestError(f"{name} has fields this server does not know (numbers {numbers}); "
                                  "is the client built from a newer warpspec.v1 proto?")


def sampling_params_from_proto(params: pb.SamplingParams, max_model_len: int) -> SamplingParams:
    reject_unknown_fields(params, "params")
    kwargs: dict = {}
    for name in _OPTIONAL_PARAMS:
        if params.HasField(name):
            value = getattr(params, name)
            kwargs[name] = round(value, 6) if name in _FLOAT_PARAMS else value
    kwargs["stop"] = list(params.stop)
    kwargs["stop_token_ids"] = list(params.stop_token_ids)
    kwargs["ignore_eos"] = params.ignore_eos
    if params.HasField("structured_output"):
        kwargs["structured_output"] = structured_output_from_proto(params.structured_output)
    check_max_tokens(kwargs.get("max_tokens"), max_model_len, "params.max_tokens")
    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"params.{e}") from None


def structured_output_from_proto(message: pb.StructuredOutput) -> StructuredOutputs:
    kind = message.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("params.structured_output is empty: set json_schema, json_object, regex, choice "
                                  "or grammar")
    name = f"params.structured_output.{kind}"
    if kind == "choice":
        return StructuredOutputs(choice=list(message.choice.choices), field_name=name)
    if kind == "json_schema":
        return StructuredOutputs(json=message.json_schema, field_name=name)
    return StructuredOutputs(**{kind: getattr(message, kind)}, field_name=name)


def request_from_proto(request: pb.GenerateRequest, max_model_len: int,
                       limits: RequestLimits | None = None) -> tuple[Prompt, SamplingParams]:
    """GenerateRequest -> what AsyncLLM.generate takes. An empty request (no prompt) or one over the
    size limits is refused here; prompt length in tokens against max_model_len and the vocabulary is
    the engine's own check."""
    limits = limits or RequestLimits()
    reject_unknown_fields(request, "GenerateRequest")
    limits.check_request_bytes(request.ByteSize(), "GenerateRequest")
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, "
                                  f"got {len(request.request_id)}")
    which = request.WhichOneof("prompt_input")
    if which is None:
        raise InvalidRequestError("GenerateRequest needs a prompt: set prompt or prompt_token_ids")
    if which == "prompt":
        if not request.prompt:
            raise InvalidRequestError("prompt is empty")
        limits.check_prompt_text(request.prompt)
        prompt: Prompt = request.prompt
    else:
        prompt = list(request.prompt_token_ids.ids)
        if not prompt:
            raise InvalidRequestError("prompt_token_ids is empty")
    return prompt, sampling_params_from_proto(request.params, max_model_len)


def _logprobs_to_proto(positions: list[PositionLogprobs], chosen: list[int]) -> list[pb.PositionLogprobs]:
    """The chosen token first, then the others by rank."""
    result = []
    for position, token in zip(positions, chosen, strict=False):
        ordered = sorted(position.items(), key=lambda item: (item[0] != token, item[1].rank))
        result.append(pb.PositionLogprobs(entries=[
            pb.TokenLogprob(token_id=token_id, logprob=lp.logprob, rank=lp.rank, text=lp.decoded_token or "")
            for token_id, lp in ordered]))
    return result


def response_from_output(out: RequestOutput, streaming: bool) -> pb.GenerateResponse:
    """Unary: the whole completion. Streaming: what this output adds (new_text / new_token_ids), with
    usage and speculation figures on the final message."""
    token_ids = out.new_token_ids if streaming else out.token_ids
    response = pb.GenerateResponse(request_id=out.request_id, text=out.new_text if streaming else out.text,
                                   token_ids=token_ids, finish_reason=out.finish_reason or "",
                                   stop_reason="" if out.stop_reason is None else str(out.stop_reason))
    if out.logprobs is not None and token_ids:
        positions = new_positions(out) if streaming else out.logprobs[: len(out.token_ids)]
        response.logprobs.extend(_logprobs_to_proto(positions, token_ids))
    if out.finished:
        m = out.metrics
        response.usage.CopyFrom(pb.Usage(prompt_tokens=int(m.get("prompt_tokens", len(out.prompt_token_ids))),
                                         completion_tokens=int(m.get("completion_tokens", len(out.token_ids))),
                                         cached_tokens=int(m.get("cached_prompt_tokens", 0))))
        response.spec.CopyFrom(pb.SpecMetrics(acceptance_length=m.get("acceptance_length", 0.0),
                                              num_draft_tokens=int(m.get("draft_tokens", 0)),
                                              num_accepted_tokens=int(m.get("accepted_draft_tokens", 0))))
        response.time_to_first_token_s = m.get("time_to_first_token_s", 0.0)
        response.time_per_output_token_s = m.get("time_per_output_token_s", 0.0)
    return response
