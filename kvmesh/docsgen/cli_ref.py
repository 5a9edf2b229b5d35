"""The CLI reference: every ``kvmesh`` command, walked from the parser ``kvmesh.cli`` builds.

A command registered anywhere shows up here by itself. The tables are built from the
parser's actions rather than from ``format_help`` so the page does not depend on the
terminal's width or on the Python version's help layout. argparse has no public way to list
a parser's actions or subcommands, so this reads ``_actions`` and ``_SubParsersAction``,
which every argparse since 3.2 has.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from kvmesh.docsgen.markdown import GENERATED_NOTE, code, table


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ("kvmesh",), help_text: str = ""
) -> Iterator[tuple[tuple[str, ...], str, argparse.ArgumentParser]]:
    """``(command path, one-line help, parser)`` for the parser and every subcommand, depth first."""
    yield path, help_text, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name), helps.get(name, ""))


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    return [
        name
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name in action.choices
    ]


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return "off" if isinstance(action, argparse._StoreTrueAction) else "on"
    if action.default is None or action.default is argparse.SUPPRESS or action.required:
        return ""
    return code(action.default)


def _option_name(action: argparse.Action) -> str:
    if not action.option_strings:
        return code(str(action.metavar or action.dest).upper())
    name = ", ".join(action.option_strings)
    flag = (
        isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction | argparse._CountAction)
        or action.nargs == 0
    )
    if not flag:
        name += " " + str(action.metavar or action.dest.upper())
    return code(name)


def _meaning(action: argparse.Action) -> str:
    text = (action.help or "").replace("%(default)s", str(action.default)).replace("%%", "%")
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        text += (" " if text else "") + "(one of " + ", ".join(code(c) for c in action.choices) + ")"
    if action.required and action.option_strings:
        text = "**required**" + (": " + text if text else "")
    if isinstance(action, argparse._AppendAction) and "repeat" not in text:
        text += " (repeatable)"
    return text


def _synopsis(path: tuple[str, ...], parser: argparse.ArgumentParser) -> str:
    parts = list(path)
    subs = _subcommands(parser)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        if action.option_strings:
            if action.required:
                parts.append(f"{action.option_strings[0]} {action.metavar or action.dest.upper()}")
        else:
            name = str(action.metavar or action.dest).upper()
            parts.append(f"{name}..." if action.nargs in ("*", "+") else name)
    if any(
        a.option_strings and not a.required
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction)
    ):
        parts.append("[options]")
    if subs:
        parts.append("{" + ",".join(subs) + "} ...")
    return " ".join(parts)


def _anchor(path: tuple[str, ...]) -> str:
    return "-".join(path)


def cli_page() -> str:
    from kvmesh.cli import build_parser

    found = list(commands(build_parser()))
    out = [
        "# CLI\n",
        GENERATED_NOTE + "\n",
        "Every `kvmesh` command and its options, from the parser `kvmesh.cli` builds "
        "(`kvmesh COMMAND --help` prints the same). Benchmarks write JSON and a PNG "
        "([Benchmarks](../bench/index.md)).\n",
        table(
            ["command", "what it does"],
            [[f"[{code(' '.join(p))}](#{_anchor(p)})", h] for p, h, _ in found[1:]],
        ),
    ]
    for path, help_text, parser in found[1:]:
        level = "#" * min(len(path), 4)
        out.append(f"{level} {' '.join(path)} {{ #{_anchor(path)} }}\n")
        desc = " ".join((parser.description or help_text or "").split())
        if desc:
            out.append(desc + "\n")
        out.append("```\n" + _synopsis(path, parser) + "\n```\n")
        rows = [
            [_option_name(a), _default(a), _meaning(a)]
            for a in parser._actions
            if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
        ]
        if rows:
            out.append(table(["option", "default", "meaning"], rows))
        subs = _subcommands(parser)
        if subs:
            out.append("Subcommands: " + ", ".join(f"[{s}](#{_anchor((*path, s))})" for s in subs) + ".\n")
    return "\n".join(out)
