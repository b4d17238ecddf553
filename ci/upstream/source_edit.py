"""Text surgery that turns nemo_safe's own code into upstream source files.

The patch series must carry the overlay's code, not a hand-kept copy of it, so
every function or module the series adds is cut out of ``nemo_safe/`` here
(by name, through ``ast``), renamed for the target project and written into
the pristine release's tree. The few glue edits in upstream files (an import,
a call site) are exact-string replacements that must match exactly once, so a
new upstream release that moved the code fails loudly instead of fuzzing.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "nemo_safe"


class EditError(RuntimeError):
    """An edit did not find exactly what it expected in the upstream file."""


def overlay_file(module: str) -> Path:
    """``"single_flight"`` or ``"patches.torchvision_mnist"`` -> its file under nemo_safe/."""
    return PACKAGE.joinpath(*module.split(".")).with_suffix(".py")


def _defined_names(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Assign):  # ``A = ...`` and ``A, B = ...``
        targets = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        return {t.id for t in targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def _segment(lines: list[str], node: ast.stmt) -> str:
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    # Keep "#:" documentation comments directly above an assignment.
    while first > 1 and lines[first - 2].lstrip().startswith("#:"):
        first -= 1
    return "".join(lines[first - 1 : node.end_lineno])


def definitions(module: str, names: Iterable[str]) -> str:
    """Source of the named top-level definitions of an overlay module, in the order asked."""
    path = overlay_file(module)
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    found: dict[str, str] = {}
    for node in ast.parse(text).body:
        for name in _defined_names(node):
            found[name] = _segment(lines, node)
    missing = [n for n in names if n not in found]
    if missing:
        raise EditError(f"{path}: no top-level {missing}")
    return "\n\n".join(found[n].rstrip() + "\n" for n in names)


def constant(module: str, name: str) -> object:
    """The literal value of a top-level constant of an overlay module (``CLASSES = (...)``)."""
    for node in ast.parse(overlay_file(module).read_text()).body:
        if name in _defined_names(node) and isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            return ast.literal_eval(node.value)
    raise EditError(f"{overlay_file(module)}: no top-level constant {name}")


def module_source(module: str, keep: Iterable[str] | None = None) -> str:
    """An overlay module as an upstream module: docstring, imports and (all or the kept)
    top-level definitions; ``from nemo_safe[.x] import`` becomes a relative import."""
    path = overlay_file(module)
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    wanted = None if keep is None else set(keep)
    parts: list[str] = []
    seen: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            parts.append(_relative_import(_segment(lines, node), node))
            continue
        if isinstance(node, ast.Expr) and node is tree.body[0]:
            parts.append(_segment(lines, node))
            continue
        names = _defined_names(node)
        if wanted is None or names & wanted:
            parts.append(_segment(lines, node))
            seen |= names
    if wanted is not None and wanted - seen:
        raise EditError(f"{path}: no top-level {sorted(wanted - seen)}")
    return "\n\n".join(p.rstrip() + "\n" for p in parts)


def _relative_import(source: str, node: ast.stmt) -> str:
    if isinstance(node, ast.ImportFrom) and node.module == "nemo_safe":
        return re.sub(r"^from nemo_safe import", "from . import", source)
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nemo_safe."):
        return re.sub(r"^from nemo_safe\.", "from .", source)
    return source


def rename(text: str, renames: Mapping[str, str]) -> str:
    """Apply literal renames, longest first (``.nemo_safe`` before ``nemo_safe``)."""
    for old in sorted(renames, key=len, reverse=True):
        text = text.replace(old, renames[old])
    return text


def without_module_indirection(text: str, alias: str = "utils") -> str:
    """Overlay code reaches the patched module through ``utils = sys.modules[MODULE]``;
    inside that module itself the names are plain globals."""
    text = re.sub(rf"^[ \t]*{alias} = sys\.modules\[MODULE\]\n", "", text, flags=re.M)
    return re.sub(rf"\b{alias}\.", "", text)


def replace_once(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    count = text.count(old)
    if count != 1:
        raise EditError(f"{path}: expected exactly one {old!r}, found {count}")
    path.write_text(text.replace(old, new))


def _top_level_def(tree: ast.Module, name: str) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise EditError(f"no top-level def {name}")


def replace_function(path: Path, name: str, new_source: str, keep_head: bool = False) -> None:
    """Replace the top-level ``def name`` of an upstream file (decorators included).
    ``keep_head`` keeps upstream's signature and docstring (its Args section) on the new body."""
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    old = _top_level_def(ast.parse(text), name)
    new_source = textwrap.dedent(new_source).rstrip() + "\n"
    first = min([old.lineno, *(d.lineno for d in old.decorator_list)])
    if keep_head:
        new_doc = _top_level_def(ast.parse(new_source), name).body[0]
        if not (_is_docstring(old.body[0]) and _is_docstring(new_doc)):
            raise EditError(f"{path}: {name} and its replacement both need a docstring")
        new_lines = new_source.splitlines(keepends=True)
        new_source = "".join(lines[first - 1 : old.body[0].end_lineno] + new_lines[new_doc.end_lineno :])
    path.write_text("".join(lines[: first - 1]) + new_source + "".join(lines[old.end_lineno :]))


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def insert_before_def(path: Path, name: str, new_source: str) -> None:
    """Insert top-level code (two blank lines after it) right before ``def name``."""
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    node = _top_level_def(ast.parse(text), name)
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    block = textwrap.dedent(new_source).strip("\n") + "\n\n\n"
    path.write_text("".join(lines[: first - 1]) + block + "".join(lines[first - 1 :]))


def decorate_method(path: Path, class_name: str, method: str, decorator: str) -> None:
    """Put ``@decorator`` right above ``class_name.method``'s ``def`` line."""
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    indent = " " * item.col_offset
                    lines.insert(item.lineno - 1, f"{indent}@{decorator}\n")
                    path.write_text("".join(lines))
                    return
    raise EditError(f"{path}: no method {class_name}.{method}")


def tidy_new_module(path: Path, line_length: int) -> None:
    """Sort imports, drop the ones a cut-down module no longer uses, format; then fail on
    anything undefined (a definition the cut left out)."""
    ruff = [sys.executable, "-m", "ruff"]
    common = ["--isolated", "--line-length", str(line_length), "--target-version", "py310"]
    subprocess.run([*ruff, "check", *common, "--select", "I,F401", "--fix", "-q", str(path)], check=True)
    subprocess.run([*ruff, "format", *common, "-q", str(path)], check=True)
    check = subprocess.run([*ruff, "check", *common, "--select", "F", str(path)], capture_output=True, text=True)
    if check.returncode != 0:
        raise EditError(f"{path} does not stand alone:\n{check.stdout}")


def check_names_defined(repo: Path, files: list[str]) -> None:
    """Fail on an undefined name in any file a patch added or changed (an import or a definition the
    surgery left out); the pristine releases have none."""
    if not files:
        return
    cmd = [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F821", *files]
    check = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
    if check.returncode != 0:
        raise EditError(f"a patch leaves undefined names:\n{check.stdout}")
