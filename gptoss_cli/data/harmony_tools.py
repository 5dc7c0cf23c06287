"""Tool definitions in harmony: namespaces checked, rendered into the `# Tools` section as openai-harmony renders them.

A tool namespace is {"name", "description"?, "tools": [{"name", "description", "parameters"?}]}, the
JSON that `openai_harmony.ToolNamespaceConfig` writes; `parameters` is a JSON Schema. Function
tools live in the developer message under the `functions` namespace, the built-in `browser` and
`python` tools in the system message. The text is harmony's (its Rust `template_tools_section` and
`json_schema_to_typescript`, ported line for line, quirks included: a nested object's properties are
indented four spaces and its closing brace too, a string default is quoted except in enums, numbers
print as serde_json prints them). Namespaces render sorted by their key, as harmony's BTreeMap
does. Torch-free.
"""

from __future__ import annotations

import json
import math
from decimal import Decimal
from typing import Any

FUNCTIONS = "functions"  # the namespace of function tools (developer message)
BUILTIN_TOOLS = ("browser", "python")

# openai-harmony's ToolNamespaceConfig::browser() and ::python() (src/chat.rs), field for field
_BROWSER_DESCRIPTION = (
    "Tool for browsing.\nThe `cursor` appears in brackets before each browsing display: `[{cursor}]`.\n"
    "Cite information from the tool using the following format:\n"
    "`【{cursor}†L{line_start}(-L{line_end})?】`, for example: `【6†L9-L11】` or `【8†L3】`.\n"
    "Do not quote more than 10 words directly from the tool output.\nsources=web (default: web)")
_OPEN_DESCRIPTION = (
    "Opens the link `id` from the page indicated by `cursor` starting at line number `loc`, showing `num_lines` "
    "lines.\nValid link ids are displayed with the formatting: `【{id}†.*】`.\nIf `cursor` is not provided, the most "
    "recent page is implied.\nIf `id` is a string, it is treated as a fully qualified URL associated with `source`.\n"
    "If `loc` is not provided, the viewport will be positioned at the beginning of the document or centered on the "
    "most relevant passage, if available.\nUse this function without `id` to scroll to a new location of an opened page.")
_PYTHON_DESCRIPTION = (
    "Use this tool to execute Python code in your chain of thought. The code will not be shown to the user. This "
    "tool should be used for internal reasoning, but not for code that is intended to be visible to the user (e.g. "
    "when creating plots, tables, or files).\n\nWhen you send a message containing Python code to python, it will be "
    "executed in a stateful Jupyter notebook environment. python will respond with the output of the execution or "
    "time out after 120.0 seconds. The drive at '/mnt/data' can be used to save and persist user files. Internet "
    "access for this session is UNKNOWN. Depends on the cluster.")


def builtin_namespace(name: str) -> dict[str, Any]:
    """The namespace of a built-in tool (`browser` or `python`), as openai-harmony defines it."""
    if name == "python":
        return {"name": "python", "description": _PYTHON_DESCRIPTION, "tools": []}
    if name != "browser":
        raise KeyError(name)
    number, minus_one = {"type": "number"}, {"type": "number", "default": -1}
    return {"name": "browser", "description": _BROWSER_DESCRIPTION, "tools": [
        {"name": "search", "description": "Searches for information related to `query` and displays `topn` results.",
         "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "topn": {**number, "default": 10},
                                                         "source": {"type": "string"}}, "required": ["query"]}},
        {"name": "open", "description": _OPEN_DESCRIPTION,
         "parameters": {"type": "object", "properties": {
             "id": {"type": ["number", "string"], "default": -1}, "cursor": minus_one, "loc": minus_one,
             "num_lines": minus_one, "view_source": {"type": "boolean", "default": False},
             "source": {"type": "string"}}}},
        {"name": "find", "description": "Finds exact matches of `pattern` in the current page, or the page given by "
                                        "`cursor`.",
         "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "cursor": minus_one},
                        "required": ["pattern"]}},
    ]}


class ToolError(ValueError):
    """A tool definition that cannot be rendered (callers wrap it in their own error type)."""


def _check_json(value: Any, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError(f"{where}: {value!r} is not a JSON number")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ToolError(f"{where}: key {k!r} is not a string")
            _check_json(v, where)
    elif isinstance(value, list):
        for v in value:
            _check_json(v, where)
    elif not (value is None or isinstance(value, (str, int, float, bool))):
        raise ToolError(f"{where}: {type(value).__name__} is not JSON")


def check_tool(raw: Any, where: str) -> dict[str, Any]:
    """One tool {"name", "description", "parameters"?}: checked, unknown fields refused."""
    if not isinstance(raw, dict):
        raise ToolError(f"{where} must be an object with name, description and parameters")
    unknown = sorted(set(raw) - {"name", "description", "parameters"})
    if unknown:
        raise ToolError(f"{where}: unknown tool field(s) {unknown}")
    name, description, parameters = raw.get("name"), raw.get("description", ""), raw.get("parameters")
    if not isinstance(name, str) or not name:
        raise ToolError(f"{where}: a tool needs a name (a non-empty string)")
    if not isinstance(description, str):
        raise ToolError(f"{where} ({name}): description must be a string")
    if parameters is not None and not isinstance(parameters, dict):
        raise ToolError(f"{where} ({name}): parameters must be a JSON Schema object")
    _check_json(parameters, f"{where} ({name}) parameters")
    return {"name": name, "description": description, "parameters": parameters}


def check_namespaces(raw: Any, where: str) -> list[dict[str, Any]]:
    """The `tools` field of system or developer content ({key: namespace}), as a list sorted by key."""
    if not isinstance(raw, dict):
        raise ToolError(f"{where}: tools must be an object of namespaces ({{\"functions\": {{...}}}})")
    out = []
    for key in sorted(raw):
        ns, at = raw[key], f"{where} tools[{key!r}]"
        if not isinstance(ns, dict) or not isinstance(ns.get("name"), str) or not isinstance(ns.get("tools"), list):
            raise ToolError(f"{at} must be {{\"name\": ..., \"description\"?: ..., \"tools\": [...]}}")
        unknown = sorted(set(ns) - {"name", "description", "tools"})
        if unknown:
            raise ToolError(f"{at}: unknown namespace field(s) {unknown}")
        description = ns.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolError(f"{at}: description must be a string")
        out.append({"key": key, "name": ns["name"], "description": description,
                    "tools": [check_tool(t, f"{at} tool {i}") for i, t in enumerate(ns["tools"])]})
    return out


# ------------------------------------------------------------------------------------- rendering


def _lines(text: str) -> list[str]:
    """Rust's str::lines(): split at \\n (a \\r before it dropped), no last empty line."""
    parts = text.split("\n")
    lines = [p[:-1] if p.endswith("\r") else p for p in parts[:-1]]
    return lines + [parts[-1]] if parts[-1] else lines


def _float(x: float) -> str:
    """serde_json's (ryu's) text of a finite f64: shortest digits, `1.0`, `1e20`, `1.5e-7`, `0.001`."""
    if x == 0:
        return "-0.0" if math.copysign(1, x) < 0 else "0.0"
    sign, digits, exp = Decimal(repr(abs(x))).normalize().as_tuple()
    d = "".join(map(str, digits))
    n, k = len(d), int(exp)
    kk = n + k
    s = "-" if x < 0 else ""
    if 0 <= k and kk <= 16:
        return f"{s}{d}{'0' * k}.0"
    if 0 < kk <= 16:
        return f"{s}{d[:kk]}.{d[kk:]}"
    if -5 < kk <= 0:
        return f"{s}0.{'0' * -kk}{d}"
    return f"{s}{d[0]}{'.' + d[1:] if n > 1 else ''}e{kk - 1}"


_U64 = (1 << 64) - 1
_POW10 = [float(f"1e{i}") for i in range(309)]


def _overflows(significand: int, digit: int) -> bool:
    return significand >= _U64 // 10 and (significand > _U64 // 10 or digit > _U64 % 10)


def serde_f64(number: str) -> float:
    """The f64 serde_json (without float_roundtrip, as openai-harmony builds it) reads from a JSON number's text:
    the digits as a u64 (extra digits dropped), then one multiplication or division by a power of ten, so
    some values land one unit in the last place from the correctly rounded one."""
    negative = number.startswith("-")
    mantissa, _, exp_text = number.lstrip("-").lower().partition("e")
    whole, _, fraction = mantissa.partition(".")
    significand, exponent, over = 0, int(exp_text) if exp_text else 0, False
    for ch in whole:
        over = over or _overflows(significand, int(ch))
        if over:
            exponent += 1
        else:
            significand = significand * 10 + int(ch)
    over = False
    for ch in fraction:
        over = over or _overflows(significand, int(ch))
        if not over:
            significand, exponent = significand * 10 + int(ch), exponent - 1
    f = float(significand)
    while True:
        if abs(exponent) < len(_POW10):
            f = f * _POW10[exponent] if exponent >= 0 else f / _POW10[-exponent]
            break
        if f == 0.0:
            break
        if exponent >= 0:
            f = math.inf
            break
        f, exponent = f / 1e308, exponent + 308
    if math.isinf(f):
        raise ToolError(f"the number {number} is out of range for openai-harmony (serde_json)")
    return -f if negative else f


def json_text(value: Any) -> str:
    """serde_json's compact text of a value as openai-harmony holds it (its Display): keys in order, non-ASCII as
    is, integers outside 64 bits and every float through serde_json's reading (`serde_f64`)."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        return str(value) if -(1 << 63) <= value <= _U64 else _float(serde_f64(str(value)))
    if isinstance(value, float):
        return _float(serde_f64(repr(value)))  # the text Python's json module writes for harmony to read
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ",".join(json_text(v) for v in value) + "]"
    return "{" + ",".join(f"{json_text(k)}:{json_text(v)}" for k, v in value.items()) + "}"


def _is_enum(schema: dict) -> bool:
    enum = schema.get("enum")
    return isinstance(enum, list) and bool(enum)


def _default(schema: dict, quote_enum: bool) -> str:
    """harmony's `default: ...` comment text: a string quoted raw unless the schema is an enum."""
    value = schema["default"]
    if isinstance(value, str) and not _is_enum(schema):
        return f'default: "{value}"'
    if isinstance(value, str) and not quote_enum:
        return f"default: {value}"
    return f"default: {json_text(value)}"


def _nullable(schema: Any, text: str) -> str:
    return f"{text} | null" if isinstance(schema, dict) and schema.get("nullable") is True and "null" not in text \
        else text


def _desc(schema: Any, key: str = "description") -> str | None:
    value = schema.get(key) if isinstance(schema, dict) else None
    return value if isinstance(value, str) else None


def _one_of_top(variants: list, indent: str) -> str:
    out = ""
    for variant in variants:
        out += f"\n{indent} | " + _nullable(variant, schema_to_typescript(variant, indent + "   "))
        comments = [d for d in [_desc(variant)] if d is not None]
        if isinstance(variant, dict) and "default" in variant:
            comments.append(_default(variant, quote_enum=True))
        if comments:
            out += " // " + " ".join(comments)
    return out


def _one_of_property(key: str, val: dict, variants: list, required: set, indent: str) -> str:
    prop_desc = _desc(val)
    skip = prop_desc is not None and bool(variants) and _desc(variants[0]) == prop_desc
    out, above = "", False
    if not skip and prop_desc is not None:
        out += f"{indent}// {prop_desc}\n"
        above = True
    if "default" in val:
        out += f"{indent}// {_default(val, quote_enum=False)}\n"
    out += f"{indent}{key}{'' if key in required else '?'}:\n"
    for i, variant in enumerate(variants):
        out += f"{indent} | " + _nullable(variant, schema_to_typescript(variant, indent + "   "))
        comments = []
        d = _desc(variant)
        if not (i == 0 and above) and d is not None and d != prop_desc:
            comments.append(d)
        if isinstance(variant, dict) and "default" in variant:
            comments.append(_default(variant, quote_enum=False))
        if comments:
            out += " // " + " ".join(comments)
        out += "\n"
    return out + f"{indent},\n"


def _object(schema: dict, indent: str) -> str:
    out = f"{indent}// {_desc(schema)}\n" if _desc(schema) is not None else ""
    out += "{\n"
    props = schema.get("properties")
    if isinstance(props, dict):
        req = schema.get("required")
        required = {r for r in req if isinstance(r, str)} if isinstance(req, list) else set()
        for key, val in props.items():
            v = val if isinstance(val, dict) else {}
            if _desc(v, "title") is not None:
                out += f"{indent}// {v['title']}\n{indent}//\n"
            if "oneOf" not in v and _desc(v) is not None:
                out += f"{indent}// {v['description']}\n"
            examples = v.get("examples")
            if isinstance(examples, list) and examples:
                out += f"{indent}// Examples:\n" + "".join(f'{indent}// - "{e}"\n' for e in examples if isinstance(e, str))
            if isinstance(v.get("oneOf"), list):
                out += _one_of_property(key, v, v["oneOf"], required, indent)
                continue
            out += f"{indent}{key}{'' if key in required else '?'}: "
            out += _nullable(v, schema_to_typescript(val, indent + "    ")) + ","
            if "oneOf" not in v and "default" in v:
                out += " // " + _default(v, quote_enum=False)
            out += "\n"
    return out + f"{indent}}}"


def schema_to_typescript(schema: Any, indent: str = "") -> str:
    """A JSON Schema as harmony's TypeScript-like type (its json_schema_to_typescript)."""
    if not isinstance(schema, dict):
        return "any"
    if isinstance(schema.get("oneOf"), list):
        return _one_of_top(schema["oneOf"], indent)
    kind = schema.get("type")
    if isinstance(kind, list):
        names = ["number" if t == "integer" else t for t in kind if isinstance(t, str)]
        if names:
            return " | ".join(names)
    if not isinstance(kind, str):
        return "any"
    if kind == "object":
        return _object(schema, indent)
    if kind == "string":
        enum = schema.get("enum")
        values = [f'"{v}"' for v in enum if isinstance(v, str)] if isinstance(enum, list) else []
        return " | ".join(values) if values else "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        return f"{schema_to_typescript(schema['items'], indent)}[]" if "items" in schema else "Array<any>"
    return "any"


def tools_section(namespaces: list[dict[str, Any]]) -> str:
    """The `# Tools` section of a system or developer message (harmony's template_tools_section)."""
    sections = ["# Tools"]
    for ns in namespaces:
        lines = [f"## {ns['name']}\n"]
        if ns["description"] is not None:
            lines += [f"// {line}" if ns["tools"] else line for line in _lines(ns["description"])]
        if ns["tools"]:
            lines.append(f"namespace {ns['name']} {{\n")
            for tool in ns["tools"]:
                lines += [f"// {line}" for line in _lines(tool["description"])]
                if tool["parameters"] is not None:
                    lines.append(f"type {tool['name']} = (_: {schema_to_typescript(tool['parameters'])}) => any;\n")
                else:
                    lines.append(f"type {tool['name']} = () => any;\n")
            lines.append(f"}} // namespace {ns['name']}")
        sections.append("\n".join(lines))
    return "\n\n".join(sections)


def has_function_tools(namespaces: list[dict[str, Any]] | None) -> bool:
    """Whether developer content declares function tools (the system message then says where calls go)."""
    return any(ns["key"] == FUNCTIONS and ns["tools"] for ns in namespaces or [])


def tool_call_json(m: Any) -> dict[str, Any] | None:
    """A generated tool call (an assistant Message with a recipient) as JSON: recipient, its namespace and name,
    channel, content type, constraint (`json` of `<|constrain|>json`), the arguments parsed when they are JSON
    (else null, with `arguments_error`) and their text. None for a message that is no call."""
    if m.role != "assistant" or m.recipient is None:
        return None
    namespace, _, name = m.recipient.rpartition(".")
    constraint = m.content_type
    if constraint is not None and constraint.startswith("<|constrain|>"):
        constraint = constraint[len("<|constrain|>"):]
    text = "".join(p for p in m.content if isinstance(p, str))
    out = {"recipient": m.recipient, "namespace": namespace or None, "name": name, "channel": m.channel,
           "content_type": m.content_type, "constraint": constraint, "arguments": None, "arguments_text": text}
    try:
        out["arguments"] = json.loads(text)
    except ValueError as exc:
        out["arguments_error"] = f"not JSON ({exc})"
    return out


__all__ = ["FUNCTIONS", "tool_call_json", "BUILTIN_TOOLS", "ToolError", "builtin_namespace", "check_tool", "check_namespaces",
           "schema_to_typescript", "tools_section", "has_function_tools", "json_text"]
