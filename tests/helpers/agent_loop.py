"""An agent framework's tool loop against an OpenAI-compatible server: LangChain's ChatOpenAI calls
get_weather, then add, each answered by a tool message, then writes a final answer in text. Each
turn's request carries the whole history."""

from __future__ import annotations

import json

import pydantic


class City(pydantic.BaseModel):
    # Bounded: a model that is not trained for tools (a random one, the bundled pair) would otherwise
    # write a string until max_tokens, the grammar holding it inside the quotes.
    city: str = pydantic.Field(max_length=12)


class Terms(pydantic.BaseModel):
    a: int = pydantic.Field(ge=0, le=99)
    b: int = pydantic.Field(ge=0, le=99)


def run_two_tool_loop(base_url: str, model: str) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool(args_schema=City)
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return json.dumps({"city": city, "celsius": 3})

    @tool(args_schema=Terms)
    def add(a: int, b: int) -> int:
        """a + b."""
        return a + b

    llm = ChatOpenAI(model=model, base_url=base_url, api_key="unused", temperature=0.0, max_tokens=60, max_retries=0,
                     timeout=60)
    tools = {"get_weather": get_weather, "add": add}
    messages = [HumanMessage("Weather in Oslo, and 2 + 3?")]
    prompt_tokens = []
    for name in ("get_weather", "add"):
        # tool_choice names the tool: the grammar makes the call, whatever the model.
        reply = llm.bind_tools(list(tools.values()), tool_choice=name).invoke(messages)
        prompt_tokens.append(reply.usage_metadata["input_tokens"])
        (call,) = reply.tool_calls
        assert call["name"] == name and reply.response_metadata["finish_reason"] == "tool_calls"
        messages += [reply, ToolMessage(str(tools[name].invoke(call["args"])), tool_call_id=call["id"])]
    answer = llm.bind_tools(list(tools.values()), tool_choice="none").invoke(messages)
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls
    assert prompt_tokens[0] < prompt_tokens[1] < answer.usage_metadata["input_tokens"]
