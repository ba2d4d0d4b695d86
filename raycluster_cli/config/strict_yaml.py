"""Strict YAML reading for the inventory: bounded size and depth, UTF-8 only, no duplicate keys.

PyYAML on its own lets the last of two equal keys win silently (even `hosts:`), recurses once per nesting
level (a deep file ends in RecursionError) and raises plain ValueError for values such as `2001-02-30`.
Here every problem is a `YamlProblem` with the line it is on, so the inventory can name it in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError

MAX_BYTES = 256 << 10  # 256 KiB: 500 hosts with per-host settings and comments take about 60 KiB
MAX_DEPTH = 32  # the inventory nests 4 levels deep; PyYAML recurses ~3 frames per level
MAX_NODES = 50_000  # 1000 hosts with a dozen settings each take ~15 000; bounds the time (~2 s) under the cap


@dataclass(frozen=True)
class YamlProblem(Exception):
    """What is wrong, the 1-based line (None when unknown) and the dotted path of the mapping it is in."""

    message: str
    line: int | None = None
    path: str = ""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that bounds nesting and turns a value Python cannot build into a marked YAML error."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self._depth += 1
        self._nodes += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", mark)
            if self._nodes > MAX_NODES:
                mark = self.peek_event().start_mark
                raise ComposerError(None, None, f"more than {MAX_NODES} values in one inventory", mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except (ValueError, TypeError, OverflowError) as exc:  # e.g. a date 2001-02-30, a 5000-digit number
            reason = " ".join(str(exc).split(":")[0].split())[:80]
            problem = f"cannot read the value {str(node.value)[:40]!r} ({reason})"
            raise ConstructorError(None, None, problem, node.start_mark) from None


def decode(data: bytes) -> str:
    """UTF-8 text (a BOM is dropped); anything else is a YamlProblem naming the line and column."""
    if len(data) > MAX_BYTES:
        raise YamlProblem(f"the file is larger than {MAX_BYTES // 1024} KiB ({len(data)} bytes or more)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        before = data[: exc.start]
        line = before.count(b"\n") + 1
        column = exc.start - (before.rfind(b"\n") + 1) + 1
        raise YamlProblem(f"not UTF-8 text (byte 0x{data[exc.start]:02x} at column {column})", line) from None


def load(text: str) -> tuple[yaml.Node | None, Any]:
    """Compose and construct one YAML document: (root node for line numbers, Python data)."""
    if len(text) > MAX_BYTES:
        raise YamlProblem(f"the file is larger than {MAX_BYTES // 1024} KiB ({len(text)} characters)")
    try:
        loader = _StrictLoader(text)  # the reader checks every character here
    except yaml.reader.ReaderError as exc:
        line = text[: exc.position].count("\n") + 1
        code = ord(exc.character) if isinstance(exc.character, str) else exc.character
        raise YamlProblem(f"invalid YAML (character #x{code:04x} is not allowed)", line) from None
    try:
        root = loader.get_single_node()
        if root is None:
            return None, None
        _refuse_duplicate_keys(root)
        return root, loader.construct_document(root)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = " ".join(str(exc.problem or exc.context or "syntax error").split())
        raise YamlProblem(f"invalid YAML ({problem})", mark.line + 1 if mark else None) from None
    except yaml.YAMLError as exc:
        raise YamlProblem(f"invalid YAML ({' '.join(str(exc).split())})") from None
    except (ValueError, OverflowError) as exc:  # the scanner's own escapes, e.g. "\U99999999" in quotes
        line = loader.get_mark().line + 1
        reason = " ".join(str(exc).split())[:80]
        raise YamlProblem(f"invalid YAML (an escape sequence it cannot decode: {reason})", line) from None
    finally:
        loader.dispose()


def _refuse_duplicate_keys(root: yaml.Node) -> None:
    """A key written twice in one mapping, at any level, is an error naming both lines (merge keys excepted)."""
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    seen_nodes: set[int] = set()
    while stack:
        node, path = stack.pop()
        if id(node) in seen_nodes:  # an alias points back at a node already checked
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    name = (key.tag, key.value)
                    line = key.start_mark.line + 1
                    if name in first:
                        where = f"{path}.{key.value}" if path else str(key.value)
                        raise YamlProblem(f"{where}: duplicate key (first at line {first[name]})", line, path)
                    first[name] = line
                label = key.value if isinstance(key, yaml.ScalarNode) else "?"
                stack.append((value, f"{path}.{label}" if path else str(label)))
