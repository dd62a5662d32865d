"""Answer similarity: which answer cells are the same code as another submission's, or as the
library's reference, once names, literals and formatting are set aside. Reported to the
instructor in the notes of the CSV ("similarity: ..."); never scored.

What is compared, for each answer cell (nbgrader `solution` cell, by grade_id), is what the
learner wrote: the cell minus the release's scaffold (the functions' and classes' signatures,
docstrings and the lines the release gives, the stub if it is left, imports), compared with the
same part of every other submission of the class and with the body of the library's reference
(`inspect.getsource` of the functions autograder/integrity.py knows: each checks module's
REFERENCES). The code is normalised first (`normal_form`): parsed and unparsed by `ast`
(formatting and comments gone), docstrings dropped, identifiers renamed by first appearance
(v0, v1, ...; attribute names, keyword-argument names and builtins kept), numbers and strings
replaced by placeholders (0 and 'S'). Two answers are

* identical: the same normalised token sequence;
* near-identical: difflib's SequenceMatcher ratio of the two token sequences >= NEAR (0.9).

Both must hold at least MIN_TOKENS (50) tokens, about four lines: a short answer has few
correct forms (the course's answers of three or four lines, `apply_temperature`,
`tvd`, `rollback`, `prefill`, `finish`, `attention_memory_bytes`, are 14 to 48 tokens, each
written the same way by the library), so it is never flagged. The threshold, measured on
notebook 02's `top_p_filter` (116-147 tokens): four independent implementations, one of them
the library's own algorithm rewritten, score 0.35-0.74 against each other and the library; a
copy with renamed variables and changed messages 1.0; the solution notebook's copy of the
library with one line changed 0.98. Across the course, the solution cells that copy the
library with one statement changed score 0.91-0.99, and one statement added drops a 90-token
answer to 0.85: 0.9 flags light edits of a copy, never the same idea written twice.
"""

from __future__ import annotations

import ast
import builtins
import copy
import difflib
import importlib
import inspect
import io
import textwrap
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

from autograder import student_files
from autograder.cells import grade_id, is_answer_cell

NEAR = 0.9
MIN_TOKENS = 50
MAX_SOURCE = 200_000  # characters of one cell; longer cells are not compared
MAX_TOKENS = 5_000  # longer answers are checked for identity only (the ratio is quadratic)
SHOWN = 5  # names listed in one note; the rest are counted
BUILTINS = frozenset(dir(builtins))
LIBRARY = "the library's "


# --------------------------------------------------------------------------- normalising


class _Normaliser(ast.NodeTransformer):
    """Renames identifiers by first appearance and replaces literals with placeholders."""

    def __init__(self):
        self.names: dict[str, str] = {}

    def _name(self, name: str | None) -> str | None:
        if name is None or name in BUILTINS:
            return name
        return self.names.setdefault(name, f"v{len(self.names)}")

    def visit_Name(self, node):
        node.id = self._name(node.id)
        return node

    def visit_arg(self, node):
        node.arg, node.annotation = self._name(node.arg), None
        return node

    def _scope(self, node):
        node.name = self._name(node.name)
        node.body = _without_docstring(node.body) or [ast.Pass()]
        if hasattr(node, "returns"):
            node.returns = None
        return self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope

    def visit_ExceptHandler(self, node):
        node.name = self._name(node.name)
        return self.generic_visit(node)

    def visit_Global(self, node):
        node.names = [self._name(n) for n in node.names]
        return node

    visit_Nonlocal = visit_Global

    def visit_Constant(self, node):
        if isinstance(node.value, bool) or node.value is None or node.value is Ellipsis:
            return node
        if isinstance(node.value, (str, bytes)):
            return ast.copy_location(ast.Constant("S"), node)
        return ast.copy_location(ast.Constant(0), node)

    def visit_JoinedStr(self, node):
        return ast.copy_location(ast.Constant("S"), node)

    def visit_Expr(self, node):  # a bare string is a comment
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return None
        return self.generic_visit(node)


def _without_docstring(body: list) -> list:
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return body[1:]
    return list(body)


def normalise(statements: list) -> ast.Module:
    """A normalised copy of these statements (see the module docstring)."""
    module = ast.Module(body=copy.deepcopy(list(statements)), type_ignores=[])
    module = _Normaliser().visit(module)
    return ast.fix_missing_locations(module)


def normal_form(source: str) -> str:
    """The normal form of a piece of code (SyntaxError if it does not parse)."""
    return ast.unparse(normalise(_without_docstring(ast.parse(source).body)))


def tokens(module: ast.Module) -> tuple[str, ...]:
    """The token sequence of normalised code (indentation as tokens, no comments or blank lines)."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(ast.unparse(module)).readline):
        if tok.type in (tokenize.NL, tokenize.COMMENT, tokenize.ENDMARKER, tokenize.ENCODING):
            continue
        out.append(
            {tokenize.INDENT: "<in>", tokenize.DEDENT: "<de>", tokenize.NEWLINE: "<nl>"}.get(tok.type, tok.string)
        )
    return tuple(out)


# --------------------------------------------------------------------------- the learner's part


def learner_part(body: list, scaffold: list) -> list:
    """The statements of `body` the learner wrote: those of a function or class the scaffold
    (the release's statements at the same level) also defines are looked into, statements the
    scaffold holds word for word (formatting aside), docstrings and imports are dropped."""
    given = {ast.dump(s) for s in scaffold}
    scopes = {s.name: s for s in scaffold if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    out = []
    for statement in _without_docstring(body):
        if isinstance(statement, (ast.Import, ast.ImportFrom)) or ast.dump(statement) in given:
            continue
        inner = scopes.get(getattr(statement, "name", None))
        if inner is not None and type(inner) is type(statement):
            out.extend(learner_part(statement.body, _without_docstring(inner.body)))
        else:
            out.append(statement)
    return out


def answer_tokens(source: str, scaffold_source: str) -> tuple[str, ...] | None:
    """The normalised tokens of what the learner wrote in an answer cell; None if it does not parse."""
    if len(source) > MAX_SOURCE:
        return None
    try:
        body = ast.parse(source).body
        scaffold = ast.parse(scaffold_source).body
        return tokens(normalise(learner_part(body, scaffold)))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def reference_tokens(reference: str, scaffold: ast.stmt) -> tuple[str, ...] | None:
    """The normalised tokens of a library reference ("module:function"): its body minus what the
    exercise's scaffold (the release's def or class) gives. None if it cannot be read."""
    module_name, _, name = reference.partition(":")
    try:
        obj = inspect.unwrap(getattr(importlib.import_module(module_name), name))
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj))).body[0]
        return tokens(normalise(learner_part(tree.body, _without_docstring(scaffold.body))))
    except Exception:  # noqa: BLE001 - a reference that cannot be read is not compared
        return None


# --------------------------------------------------------------------------- the class


@dataclass
class Answer:
    """One party's normalised answer to one cell: a student, or the library's reference."""

    who: str  # a student id, or "the library's module.function"
    tokens: tuple[str, ...]
    matches: list = field(default_factory=list)  # (ratio, other's label)

    @property
    def label(self) -> str:
        return self.who if self.who.startswith(LIBRARY) else f"{self.who}'s"


def answer_cells(release) -> dict[str, str]:
    """grade_id -> the released source of each answer (solution) cell."""
    cells = {}
    for cell in release.cells:
        if cell.get("cell_type") == "code" and is_answer_cell(cell) and grade_id(cell):
            cells[grade_id(cell)] = cell.source
    return cells


def cell_references(scaffold_source: str, refs: dict[str, str]) -> list[tuple[str, ast.stmt]]:
    """(reference, the scaffold's def or class) for each exercise function the released cell defines."""
    try:
        body = ast.parse(scaffold_source).body
    except SyntaxError:
        return []
    return [
        (refs[s.name], s)
        for s in body
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and s.name in refs
    ]


def read_answers(path: Path, gids) -> dict[str, str]:
    """grade_id -> source of the answer cells of one submission ({} if it cannot be read)."""
    import nbformat

    try:
        raw = student_files.read_bytes(Path(path), student_files.NOTEBOOK_MAX_BYTES)
        nb = nbformat.reads(raw.decode("utf-8"), as_version=4)
        found = {}
        for cell in nb.cells:
            gid = grade_id(cell)
            if cell.get("cell_type") == "code" and gid in gids and gid not in found and isinstance(cell.source, str):
                found[gid] = cell.source
        return found
    except Exception:  # noqa: BLE001 - unreadable notebooks are skipped
        return {}


def compare(answers: list[Answer], near: float = NEAR) -> None:
    """Record in each answer's `matches` every other answer identical or near-identical to it
    (library references are compared with students, not with each other)."""
    groups: dict[tuple, list[Answer]] = {}
    for answer in answers:
        groups.setdefault(answer.tokens, []).append(answer)
    for group in groups.values():
        for a in group:
            a.matches += [(1.0, b.label) for b in group if b is not a and not _both_library(a, b)]
    keys = [k for k in groups if len(k) <= MAX_TOKENS]
    for i, seq_b in enumerate(keys):
        matcher = difflib.SequenceMatcher(None, autojunk=False)
        matcher.set_seq2(seq_b)
        for seq_a in keys[:i]:
            matcher.set_seq1(seq_a)
            if matcher.real_quick_ratio() < near or matcher.quick_ratio() < near:
                continue
            ratio = matcher.ratio()
            if ratio >= near:
                _link(groups[seq_a], groups[seq_b], ratio)


def _both_library(a: Answer, b: Answer) -> bool:
    return a.who.startswith(LIBRARY) and b.who.startswith(LIBRARY)


def _link(group_a: list[Answer], group_b: list[Answer], ratio: float) -> None:
    for a in group_a:
        for b in group_b:
            if not _both_library(a, b):
                a.matches.append((ratio, b.label))
                b.matches.append((ratio, a.label))


def notes_for(gid: str, answer: Answer) -> list[str]:
    """The "similarity: ..." notes of one student's answer to one cell."""
    notes = []
    same = sorted(label for ratio, label in answer.matches if ratio >= 1.0)
    near = sorted(((ratio, label) for ratio, label in answer.matches if ratio < 1.0), key=lambda m: (-m[0], m[1]))
    if same:
        notes.append(f"similarity: {gid} identical to {_listed(same)}")
    if len(near) == 1:
        notes.append(f"similarity: {gid} near-identical ({_floor(near[0][0])}) to {near[0][1]}")
    elif near:
        notes.append(
            f"similarity: {gid} near-identical to " + _listed([f"{label} ({_floor(ratio)})" for ratio, label in near])
        )
    return notes


def _floor(ratio: float) -> str:
    return f"{int(ratio * 100) / 100:.2f}"  # never rounds up to the threshold or to 1.00


def _listed(labels: list[str]) -> str:
    library = [x for x in labels if x.startswith(LIBRARY)]
    students = [x for x in labels if not x.startswith(LIBRARY)]
    ordered = library + students
    shown = ", ".join(ordered[:SHOWN])
    return shown + (f" and {len(ordered) - SHOWN} more" if len(ordered) > SHOWN else "")


def class_notes(
    release,
    submissions: dict[str, Path],
    refs: dict[str, str] | None = None,
    near: float = NEAR,
    min_tokens: int = MIN_TOKENS,
) -> dict[str, list[str]]:
    """student -> similarity notes, comparing every submission's answer cells with each other's
    and with the library's references (`refs`: integrity.references() when None)."""
    if refs is None:
        from autograder.integrity import references

        refs = references()
    cells = answer_cells(release)
    sources = {student: read_answers(path, cells) for student, path in sorted(submissions.items())}
    notes: dict[str, list[str]] = {}
    for gid, scaffold in cells.items():
        answers = _cell_answers(gid, scaffold, sources, refs, min_tokens)
        compare(answers, near)
        for answer in answers:
            if not answer.who.startswith(LIBRARY):
                notes.setdefault(answer.who, []).extend(notes_for(gid, answer))
    return {student: found for student, found in notes.items() if found}


def _cell_answers(
    gid: str, scaffold: str, sources: dict[str, dict[str, str]], refs: dict[str, str], min_tokens: int
) -> list[Answer]:
    answers = []
    for student, cells in sources.items():
        found = answer_tokens(cells[gid], scaffold) if gid in cells else None
        if found is not None and len(found) >= min_tokens:
            answers.append(Answer(student, found))
    if not answers:
        return []
    for reference, node in cell_references(scaffold, refs):
        found = reference_tokens(reference, node)
        if found is not None and len(found) >= min_tokens:
            answers.append(Answer(LIBRARY + reference.replace(":", "."), found))
    return answers
