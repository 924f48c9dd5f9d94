"""Code prompts built from the running Python's own standard library source.

No package ships MBPP-style prompts, but every machine has thousands of real, documented
Python functions in its stdlib. Each public, documented function becomes a prompt ("Write
the Python function `name(sig)`: <docstring>") with the real source as the reference answer.

The stdlib directory is discovered at run time (`sysconfig`), never written down, and ids
name modules, not paths. The set of functions depends on the Python version; the split of a
given id does not.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from draftsmith.data.sources.conversation import (
    Conversation,
    Split,
    heldout_fraction_for,
    in_split,
    make_conversation,
)

# Directories that hold tests, fixtures, vendored or non-importable code, not library API.
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                        "lib2to3", "__pycache__"})
_FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


def stdlib_root() -> Path:
    """The directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _module_files(root: Path) -> Iterator[tuple[str, Path]]:
    """(dotted module name, file) for public stdlib modules, sorted by module name."""
    found = []
    for folder, dirs, files in os.walk(root):
        # Prune in place so the walk never enters tests, site-packages or private packages.
        dirs[:] = [d for d in dirs if _public_part(d)]
        package = Path(folder).relative_to(root).parts
        for file in files:
            stem, suffix = os.path.splitext(file)
            if suffix != ".py" or not (stem == "__init__" or _public_part(stem)):
                continue
            parts = package if stem == "__init__" else (*package, stem)
            if parts:
                found.append((".".join(parts), Path(folder, file)))
    return iter(sorted(found))


def _public_part(name: str) -> bool:
    return name.isidentifier() and not name.startswith("_") and name not in _SKIP_DIRS


def _signature(node: _FunctionNode) -> str:
    """`name(args) -> ret` as written in the source, without decorators or the body."""
    args = ast.unparse(node.args)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"{node.name}({args}){returns}"


def _dedent(lines: list[str], indent: int) -> str:
    """Remove a method's indentation; lines indented less (string continuations) stay as is.

    `textwrap.dedent` would remove nothing when one line of a string literal starts at
    column 0, leaving methods that do not parse on their own.
    """
    return "\n".join(line[indent:] if not line[:indent].strip() else line for line in lines)


def _is_trivial(node: _FunctionNode) -> bool:
    """Bodies that teach nothing: only a docstring plus pass / ... / raise NotImplementedError."""
    body = node.body[1:]
    if not body:
        return True
    if len(body) == 1:
        stmt = body[0]
        if isinstance(stmt, ast.Pass):
            return True
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            return True
        if isinstance(stmt, ast.Raise) and "NotImplementedError" in ast.unparse(stmt):
            return True
    return False


def _public_functions(tree: ast.Module) -> Iterator[tuple[str, _FunctionNode]]:
    """(qualname, node) for public documented functions and methods of public classes."""
    for node in tree.body:
        if isinstance(node, _FunctionNode):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, _FunctionNode):
                    yield f"{node.name}.{item.name}", item


@dataclass(frozen=True)
class StdlibCodeSource:
    """Documented public functions of the standard library as code-writing prompts.

    Kept: top-level functions and methods of public top-level classes whose name has no
    leading underscore, whose docstring has at least `min_doc_chars` characters, and whose
    source (docstring included) is at most `max_lines` lines and not a stub. Ids are
    "stdlib/<module>.<qualname>", yielded in module then source order.
    """

    name: str = "stdlib-code"
    heldout_fraction: float = heldout_fraction_for("stdlib/")
    min_doc_chars: int = 40
    max_lines: int = 80

    def conversations(self, split: Split | None = None) -> Iterator[Conversation]:
        return in_split(self._all(), split)

    def _all(self) -> Iterator[Conversation]:
        seen: set[str] = set()
        for module, path in _module_files(stdlib_root()):
            source = importlib.util.decode_source(path.read_bytes())
            try:
                tree = ast.parse(source)
            except SyntaxError:
                continue  # a few stdlib files are deliberately invalid (grammar fixtures)
            lines = source.split("\n")  # not splitlines(): ast counts only newlines, not \f
            for qualname, node in _public_functions(tree):
                local_id = f"{module}.{qualname}"
                conversation = self._prompt(local_id, qualname, node, lines)
                if conversation is not None and local_id not in seen:
                    seen.add(local_id)  # redefinitions under `if` branches: keep the first
                    yield conversation

    def _prompt(self, local_id: str, qualname: str, node: _FunctionNode,
                lines: list[str]) -> Conversation | None:
        if node.name.startswith("_"):
            return None
        doc = ast.get_docstring(node)
        if doc is None or len(doc) < self.min_doc_chars or _is_trivial(node):
            return None
        start = min([d.lineno for d in node.decorator_list] + [node.lineno])
        if node.end_lineno is None or node.end_lineno - start + 1 > self.max_lines:
            return None
        reference = _dedent(lines[start - 1:node.end_lineno], node.col_offset)
        module = local_id[: -len(qualname) - 1]
        owner = qualname.rpartition(".")[0]
        what = (f"the method `{_signature(node)}` of class `{owner}`" if owner
                else f"the Python function `{_signature(node)}`")
        prompt = (f"Write {what} from the `{module}` module of the Python standard library.\n\n"
                  f"{doc}")
        messages = ({"role": "user", "content": prompt},
                    {"role": "assistant", "content": f"```python\n{reference}\n```"})
        return make_conversation("stdlib", local_id, self.name, messages, self.heldout_fraction)
