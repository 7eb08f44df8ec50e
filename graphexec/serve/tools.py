"""Tool calls for chat completions.

tool_choice "required" or a named function is constrained by a grammar: the output is the
call's JSON (any model can do it), parsed into `tool_calls`. With a named function the output
is its arguments object, so a stream sends the call's id and name first and then the arguments
as they come. With "required" the output is {"name": ..., "arguments": {...}} for one of the
tools, and a stream sends the call whole once it is complete.

tool_choice "auto" (the default with tools) lets the model write what it likes, in its own
tool-call format, which the server's --tool-call-parser reads (tool_parsers.py); a
response_format or structured_outputs still applies to that free output. Without a parser, or
with a chat template that never shows the model its tools, it is refused by name.
tool_choice "none" renders the tools (as vLLM does) and reads no calls.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ..structured import StructuredOutputsParams
from ..text.chat import template_variables
from .errors import invalid
from .tool_parsers import PARSERS, ToolCallParser, parse


@dataclass(frozen=True)
class ToolMode:
    """What a request's tools and tool_choice ask of its output."""

    named: str | None  # the one function the output calls; None: "required", any of them
    schemas: dict[str, dict]  # function name -> its parameters' JSON schema

    def structured(self) -> StructuredOutputsParams:
        if self.named is not None:
            return StructuredOutputsParams(json=self.schemas[self.named])
        calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": s},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for n, s in self.schemas.items()]
        return StructuredOutputsParams(json={"anyOf": calls})

    def calls(self, text: str) -> list[dict] | None:
        """The tool_calls of a complete output; None if it does not parse (cut by length)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.named is not None:
            return [new_call(self.named, json.dumps(value))]
        return [new_call(value["name"], json.dumps(value["arguments"]))]


def new_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class AutoTools:
    """tool_choice "auto": the output is free, and calls are read out of it."""

    parser: str  # a name in tool_parsers.PARSERS

    def reader(self) -> ToolCallParser:
        return PARSERS[self.parser]()

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """A whole output's message and finish_reason: its calls as tool_calls (a call cut
        by max_tokens included, as OpenAI sends it), the text around them as content."""
        parsed = parse(self.parser, text)
        if not parsed.calls:
            return {"role": "assistant", "content": text}, finish
        calls = [new_call(c.name, c.arguments) for c in parsed.calls]
        return ({"role": "assistant", "content": parsed.content or None, "tool_calls": calls},
                "tool_calls" if finish == "stop" else finish)


def auto_tools(tools: list[dict] | None, tool_choice, parser: str | None,
               chat_template: str | None) -> AutoTools | None:
    """AutoTools when the request has tools and tool_choice "auto" (or none given), else None.
    Refused (400, tool_choice) when the server has no parser, or when the model's chat
    template does not render `tools`: the model would never see them, and a client is better
    told than given answers that silently ignore its tools."""
    if not tools or tool_choice not in (None, "auto"):
        return None
    if parser is None:
        raise invalid("tool_choice \"auto\" (the default with tools) needs a tool-call "
                      "parser: start the server with --tool-call-parser, or send "
                      "\"required\" or name a function", "tool_choice",
                      code="unsupported_parameter")
    if chat_template is not None and "tools" not in template_variables(chat_template):
        raise invalid("tool_choice \"auto\": this model's chat template does not render "
                      "tools, so the model would never see them; send \"required\" or name a "
                      "function (the output then follows the tools' schemas)", "tool_choice",
                      code="unsupported_parameter")
    return AutoTools(parser)


def tool_mode(tools: list[dict] | None, tool_choice) -> ToolMode | None:
    """The request's grammar-constrained ToolMode; None when its output is free: no tools,
    "none", or "auto" (checked and read by auto_tools). Bad shapes are a 400 naming tools or
    tool_choice."""
    if not tools or tool_choice == "none":
        return None
    schemas: dict[str, dict] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (not isinstance(t, dict) or t.get("type", "function") != "function"
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str)):
            raise invalid(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                          f"{{\"name\": ..., \"parameters\": {{...}}}}}}, got "
                          f"{json.dumps(t)[:80]}", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise invalid(f"tools[{i}].function.parameters must be a JSON schema (an object), "
                          f"got {json.dumps(params)[:80]}", "tools")
        schemas[fn["name"]] = params
    if tool_choice in (None, "auto"):
        return None
    if tool_choice == "required":
        return ToolMode(None, schemas)
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) \
        else None
    if name not in schemas:
        raise invalid(f"tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": "
                      f"\"function\", \"function\": {{\"name\": ...}}}} naming one of the tools, "
                      f"got {json.dumps(tool_choice)[:80]}", "tool_choice")
    return ToolMode(name, schemas)
