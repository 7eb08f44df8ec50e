"""Tool calls for chat completions, constrained by a grammar: tool_choice "required" or a named
function makes the output the call's JSON (any model can do it), parsed into `tool_calls`.
tool_choice "none" ignores the tools; "auto" needs a parser of the model's own tool-call format,
which this server does not have yet, and is refused by name.

With a named function the output is its arguments object, so a stream sends the call's id and
name first and then the arguments as they come. With "required" the output is
{"name": ..., "arguments": {...}} for one of the tools, and a stream sends the call whole once
it is complete.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ..structured import StructuredOutputsParams
from .errors import invalid


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


def tool_mode(tools: list[dict] | None, tool_choice) -> ToolMode | None:
    """The request's ToolMode, None when its output is plain text. Bad shapes are a 400
    naming tools or tool_choice."""
    if not tools or tool_choice == "none":
        return None
    schemas: dict[str, dict] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (not isinstance(t, dict) or t.get("type", "function") != "function"
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str)):
            raise invalid(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                          "{\"name\": ..., \"parameters\": {...}}}", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise invalid(f"tools[{i}].function.parameters must be a JSON schema", "tools")
        schemas[fn["name"]] = params
    if tool_choice in (None, "auto"):
        raise invalid("tool_choice \"auto\" (the default with tools) needs a tool-call parser, "
                      "which this server does not have yet: use \"required\" or name a "
                      "function", "tool_choice", code="unsupported_parameter")
    if tool_choice == "required":
        return ToolMode(None, schemas)
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) \
        else None
    if name not in schemas:
        raise invalid(f"tool_choice must be \"none\", \"required\" or {{\"type\": \"function\", "
                      f"\"function\": {{\"name\": ...}}}} naming one of the tools, got "
                      f"{json.dumps(tool_choice)[:80]}", "tool_choice")
    return ToolMode(name, schemas)
