"""``python -m scape_train --help``: the groups and their options, then every key with the value
this command line composes to and the one-line description written next to its dataclass field.

The descriptions are the comments in the schemas' source (``config.py`` and each component's
``config.py``): a field's trailing comment (with its indented continuation lines), else the
comment block right above it. Hydra renders the help from ``hydra.help.template``, which
``configs/config.yaml`` sets to ``${scape_help:}``; the resolver below builds the text from the
composed config, so ``--help`` after overrides (``+experiment=NAME --help``) shows their values.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import re
import textwrap
import tokenize
import typing
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

RESOLVER = "scape_help"

_HEADER = """\
scape_train: LLM pretraining (GPT-2 / Llama; AdamW, AdamS, SCAPE, top-k, PowerSGD; DiLoCo, GASLoC).

  python -m scape_train [GROUP=OPTION ...] [KEY=VALUE ...]
  python -m scape_train +experiment=NAME [KEY=VALUE ...]     a paper run or a tiny CPU version
  python -m scape_train [...] --cfg job                        print the composed config, run nothing
  python -m scape_train [...] --help                           this help, with those values

A key that no schema has fails at once, naming the closest valid key (also with +KEY=VALUE).
"""


def register_help_resolver(schema: type) -> None:
    """The help text's resolver, listing every field of the root ``schema``."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, functools.partial(_help_text, schema=schema))


def _help_text(*, _root_: DictConfig, schema: type) -> str:
    try:
        return _build_help(_root_, schema)
    except Exception as exc:  # noqa: BLE001 - help must never be the thing that fails
        return (f"{_HEADER}\n(the option list could not be built: {exc})\n\n$APP_CONFIG_GROUPS\n"
                .replace("$", "$$").replace("$$APP_CONFIG_GROUPS", "$APP_CONFIG_GROUPS"))


def _build_help(_root_: DictConfig, schema: type) -> str:
    choices = {}
    try:
        choices = dict(_root_.hydra.runtime.choices)
    except Exception:  # noqa: BLE001 - outside a Hydra run there are no choices to show
        pass
    chosen = ", ".join(f"{k}={v}" for k, v in sorted(choices.items())
                       if not k.startswith("hydra") and v is not None)
    lines = [_HEADER, "== Groups: GROUP=OPTION ==", f"now: {chosen}" if chosen else "", "",
             "$APP_CONFIG_GROUPS",
             "== Options: KEY=VALUE (the value this command line composes to) and what it does ==",
             ""]
    lines += option_lines(schema, _root_)
    lines += ["", "Hydra's own flags: --hydra-help. Docs: README.md."]
    # Hydra substitutes $APP_CONFIG_GROUPS with string.Template: escape every other "$".
    text = "\n".join(lines)
    return text.replace("$", "$$").replace("$$APP_CONFIG_GROUPS", "$APP_CONFIG_GROUPS")


def option_lines(schema: type, node: Any, prefix: str = "", width: int = 44) -> list[str]:
    """``key=value  description`` for every field of ``schema`` (recursively), values from ``node``."""
    out: list[str] = []
    comments = field_comments(schema)
    hints = _hints(schema)
    leaves, nested = [], []
    for f in dataclasses.fields(schema):
        sub = dataclass_of(hints.get(f.name))
        (nested if sub is not None else leaves).append((f, sub))
    for f, _ in leaves:
        key = f"{prefix}{f.name}"
        entry = f"  {key}={_show(_value(node, f.name))}"
        desc = comments.get(f.name, "")
        out.append(f"{entry:<{width}} {desc}".rstrip() if len(entry) < width
                   else f"{entry}\n{'':<{width}} {desc}".rstrip())
    for f, sub in nested:
        key = f"{prefix}{f.name}"
        desc = comments.get(f.name) or _first_doc_line(sub)
        where = f"{sub.__name__} in {sub.__module__.replace('.', '/')}.py"
        out += ["", f"[{key}]  {where}" + (f": {desc}" if desc else "")]
        child = _child(node, f.name)
        out += option_lines(sub, child, f"{key}.", width)
    return out


@functools.lru_cache(maxsize=None)
def field_comments(schema: type) -> dict[str, str]:
    """Field name -> its one-line description, from the comments in the class's source."""
    try:
        source = textwrap.dedent(inspect.getsource(schema))
    except (OSError, TypeError):
        return {}
    comments: dict[int, tuple[int, str]] = {}       # line -> (column, text)
    code_lines: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = (tok.start[1], tok.string.lstrip("#").strip())
            elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                  tokenize.ENDMARKER):
                code_lines.update(range(tok.start[0], tok.end[0] + 1))
    except (tokenize.TokenError, SyntaxError):
        return {}
    lines = source.splitlines()
    field_re = re.compile(r"^(\s+)([A-Za-z_]\w*)\s*:")
    body_indent = None
    out: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        match = field_re.match(line)
        if not match or (body_indent is not None and len(match.group(1)) != body_indent):
            continue
        body_indent = len(match.group(1))
        name = match.group(2)
        parts = []
        if number in comments and number in code_lines:          # trailing comment
            parts.append(comments[number][1])
            nxt = number + 1
            while nxt in comments and nxt not in code_lines and comments[nxt][0] > body_indent:
                parts.append(comments[nxt][1])                    # its indented continuation
                nxt += 1
        else:                                                     # the block right above
            above = number - 1
            while above in comments and above not in code_lines and comments[above][0] == body_indent:
                parts.insert(0, comments[above][1])
                above -= 1
        if parts:
            out[name] = " ".join(" ".join(parts).split())
    return out


def _hints(schema: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(schema)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: no nesting from it
        return {}


def dataclass_of(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union and len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _first_doc_line(schema: type) -> str:
    doc = inspect.getdoc(schema) or ""
    if doc.startswith(f"{schema.__name__}("):     # dataclasses' generated signature, not a doc
        return ""
    return doc.splitlines()[0] if doc else ""


def _child(node: Any, name: str) -> Any:
    if isinstance(node, DictConfig) and name in node:
        return node._get_node(name)
    return None


def _value(node: Any, name: str) -> Any:
    child = _child(node, name)
    if child is None:
        return "(unset)"
    if isinstance(child, (DictConfig, ListConfig)):
        return OmegaConf.to_container(child, resolve=False)
    return child._value()


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else "''"
    if isinstance(value, list):
        return "[" + ",".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_show(v)}" for k, v in value.items()) + "}"
    return str(value)
