"""Which upstream code a patch may change: verified releases, code recognised by its structure, or none.

A patch is safe on a module when what it relies on holds there. Each patch states that in code,
and :class:`SourceGate` gives one of three verdicts for the module in hand:

* **verified**: the sources of the parts it checks are byte for byte those of a release the
  tests ran on (sha256 -> release in ``known``), and its facts hold;
* **recognised by structure**: not a verified release (an older or newer release, an NGC
  container's pre-release build), but

  - every :class:`Fact` the patch relies on holds *and* the patch only wraps upstream's functions
    (``by_facts=True``: NeMo's ``exp_manager``, torch.hub), or
  - the parts are a verified release's code up to formatting, comments, docstrings and
    annotations (their :func:`shape` is in ``shapes``): what a patch that replaces whole
    functions with its own body needs, since that body must behave like this module's;
* **fixed upstream**: the module already carries the fix of nemo_safe's upstream pull request
  (``fixed``: a fact naming what that pull request adds, checked before anything else). The patch
  stays out; the process logs one info line saying so, no warning (there is no race left to warn of);
* **declined**: anything else, with the fact that fails. The module keeps upstream's code, and
  the process logs one warning saying so.

Facts are checked on the code (``ast``), never by running it, so a gate costs nothing at run time.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import logging
import textwrap
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

from nemo_safe.wait_lines import say

log = logging.getLogger(__name__)

VERIFIED, STRUCTURE, FIXED, DECLINED = "verified", "structure", "fixed", "declined"

#: What reading a part's source can raise for a changed or compiled module (an unreadable part is declined).
#: Any exception: a gate must never fail an import (``inspect.signature`` raises ValueError for a builtin, ``unwrap``
#: for a ``__wrapped__`` loop, ``tokenize`` its own errors).
UNREADABLE = (Exception,)


@dataclass(frozen=True)
class Fact:
    """One thing a patch relies on in the module it changes; ``says`` reads as a sentence in messages."""

    says: str
    holds: Callable[[ModuleType], bool]


class Verdict(NamedTuple):
    """What a gate decided for one module: ``status`` is :data:`VERIFIED`, :data:`STRUCTURE`, :data:`FIXED`
    or :data:`DECLINED`; ``detail`` the release (verified), why it is recognised, what the release carries
    (fixed), or the failing fact."""

    status: str
    detail: str

    @property
    def patches(self) -> bool:
        return self.status in (VERIFIED, STRUCTURE)

    def __str__(self) -> str:
        if self.status == VERIFIED:
            return f"verified on {self.detail}"
        if self.status == STRUCTURE:
            return f"recognised by structure ({self.detail})"
        if self.status == FIXED:
            return f"carries the upstream fix ({self.detail})"
        return f"declined: {self.detail}"


def function_tree(function: object) -> ast.FunctionDef:
    """The syntax tree of upstream's ``function`` (through nemo_safe's wrappers, via ``__wrapped__``)."""
    source = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))  # type: ignore[arg-type]
    node = ast.parse(source).body[0]
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        raise TypeError(f"{function!r} is not a function")
    return node  # type: ignore[return-value]


def calls_in_order(tree: ast.AST) -> list[ast.Call]:
    """Every call in ``tree``, in source order."""
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    return sorted(calls, key=lambda call: (call.lineno, call.col_offset))


def called_name(call: ast.AST) -> str:
    """``f`` for ``f(...)``, ``a.b`` for ``a.b(...)``, ``""`` otherwise (also for what is not a call)."""
    if not isinstance(call, ast.Call):
        return ""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return ""


def init_downloads_then_checks(cls: type, method: str, check: str) -> bool:
    """``cls.__init__`` calls ``self.<method>()`` and after it ``self.<check>()`` (a dataset's
    ``if download: self.download()`` then ``if not self._check_integrity(): raise``), and ``check``
    takes no argument but ``self``: what nemo_safe's download wrappers rely on in a dataset class."""
    names = [called_name(call) for call in calls_in_order(function_tree(cls.__init__))]
    download, checked = f"self.{method}", f"self.{check}"
    if download not in names or checked not in names[names.index(download) + 1 :]:
        return False
    parameters = list(inspect.signature(inspect.unwrap(getattr(cls, check))).parameters)
    return parameters == ["self"]


def defines_function(name: str) -> Callable[[ModuleType], bool]:
    """A fact: the module itself defines the function ``name`` (one that an upstream pull request adds:
    the module then carries that fix; nemo_safe's own replacements never add names to a module)."""

    def holds(module: ModuleType) -> bool:
        function = vars(module).get(name)
        return callable(function) and getattr(function, "__module__", None) == module.__name__

    return holds


class _Normalise(ast.NodeTransformer):
    """Drops what cannot change behaviour: docstrings and annotations (positions are never dumped)."""

    def _body(self, node: ast.AST) -> ast.AST:
        body = getattr(node, "body", None)
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]  # type: ignore[attr-defined]
        return self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        node.returns = None
        return self._body(node)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]
    visit_ClassDef = _body  # type: ignore[assignment]

    def visit_arg(self, node: ast.arg) -> ast.AST:
        node.annotation = None
        node.type_comment = None
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST | None:
        if node.value is None:
            return None
        return ast.Assign(targets=[node.target], value=node.value, lineno=node.lineno)


def shape(parts: Iterable[object]) -> str:
    """sha256 of the parts' code up to formatting, comments, docstrings and annotations."""
    dumps = []
    for part in parts:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(part)))  # type: ignore[arg-type]
        dumps.append(ast.dump(_Normalise().visit(ast.parse(source)), include_attributes=False))
    return hashlib.sha256("\n".join(dumps).encode()).hexdigest()


def digest(parts: Iterable[object]) -> str:
    """sha256 of the parts' sources, byte for byte."""
    text = "".join(inspect.getsource(part) for part in parts)  # type: ignore[arg-type]
    return hashlib.sha256(text.encode()).hexdigest()


class SourceGate:
    """The version gate every patch declares (see the module's docstring for the three verdicts).

    ``parts(module)`` gives the functions and classes whose code is compared with ``known``
    (sha256 -> verified release); ``shape_parts(module)`` (default: the same) those compared with
    ``shapes`` (:func:`shape` -> the verified release it equals): the functions whose bodies the
    patch replaces with its own.
    ``facts`` are what the patch relies on; ``by_facts`` says whether they are enough on their own
    (a patch that only wraps upstream's functions) or whether the code must also have a verified
    release's shape (a patch that runs its own body in place of upstream's). ``fixed`` says the module
    already has what the upstream pull request adds (the patch then stays out). ``library`` names the
    distribution in messages; ``unpatched`` says what upstream does, for ``nemo-safe doctor``;
    ``consequence`` what staying upstream means, for the one warning of a declined module."""

    def __init__(
        self,
        target: str,
        parts: Callable[[ModuleType], Sequence[object]],
        known: dict[str, str],
        library: str,
        unpatched: str,
        consequence: str,
        facts: Sequence[Fact] = (),
        shapes: dict[str, str] | None = None,
        by_facts: bool = False,
        shape_parts: Callable[[ModuleType], Sequence[object]] | None = None,
        fixed: Fact | None = None,
    ) -> None:
        self.target, self.parts, self.known, self.library = target, parts, known, library
        self.unpatched, self.consequence = unpatched, consequence
        self.facts, self.shapes, self.by_facts = tuple(facts), dict(shapes or {}), by_facts
        self.shape_parts = shape_parts or parts
        self.fixed = fixed
        self._warned = False
        self._lock = threading.Lock()

    def digest(self, module: ModuleType) -> str:
        return digest(self.parts(module))

    def verdict(self, module: ModuleType) -> Verdict:
        """What this gate decides for ``module`` (patched by nemo_safe or not: the wrappers name
        upstream's functions through ``__wrapped__``)."""
        try:
            if self.fixed is not None and self.fixed.holds(module):
                return Verdict(FIXED, self.fixed.says)
            for fact in self.facts:
                if not fact.holds(module):
                    return Verdict(DECLINED, f"{fact.says}: does not hold in this {self.library}")
            release = self.known.get(self.digest(module))
            if release is not None:
                return Verdict(VERIFIED, release)
            if self.by_facts:
                return Verdict(STRUCTURE, "not a tested release; every fact the patch relies on holds")
            like = self.shapes.get(shape(self.shape_parts(module)))
            if like is not None:
                return Verdict(STRUCTURE, f"the code of {like} up to formatting, comments and annotations")
        except UNREADABLE as exc:
            return Verdict(DECLINED, f"the sources of {self.target} cannot be read ({type(exc).__name__})")
        return Verdict(DECLINED, "the code it replaces differs from every release it was verified on")

    def recognise(self, module: ModuleType) -> str | None:
        """The verified release ``module`` is, or None (kept for callers of the byte-for-byte gate)."""
        found = self.verdict(module)
        return found.detail if found.status == VERIFIED else None

    def releases(self) -> str:
        return ", ".join(sorted(set(self.known.values())))

    def note(self, module: ModuleType, verdict: Verdict) -> None:
        """One log line per process for a module that is not a verified release: a warning where the
        patch declines (upstream's code runs), an info line where it patches by structure."""
        with self._lock:
            if self._warned or verdict.status == VERIFIED:
                return
            self._warned = True
        if verdict.status == STRUCTURE:
            say(log, "nemo_safe: %s %s: patched", self.target, verdict)
            return
        if verdict.status == FIXED:
            log.debug("nemo_safe: %s %s: left as it is", self.target, verdict)
            return
        log.warning(
            "nemo_safe: %s is left untouched, %s (verified on %s); %s. Run `nemo-safe doctor` and report the %s "
            "version.",
            self.target, verdict, self.releases(), self.consequence, self.library,
        )  # fmt: skip

    def warn_unknown(self, module: ModuleType) -> None:
        """The one warning of a declined module (kept for callers of the byte-for-byte gate)."""
        self.note(module, self.verdict(module))

    def describe(self, module: ModuleType) -> str:
        """What the unpatched module is to the patch, for ``nemo-safe doctor``."""
        found = self.verdict(module)
        if found.status == FIXED:
            return f"{found}: nemo_safe stays out of it"
        where = f" (verified on {self.releases()})" if found.status == DECLINED else ""
        return f"{found}{where}: {self.unpatched}"
