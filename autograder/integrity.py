"""Integrity report: answer cells that lean on what they should not. Reported to the
instructor in the notes of the CSV; never scored.

Two things are flagged, in the cells the learner wrote (solution cells and cells added to the
release):
* a call of the library's reference implementation of a graded function (the course's table of
  exercises, `decodelab.course.exercises`, names them, e.g. ``count_parameters ->
  decodelab.lessons.kv_size:parameter_count``);
* any use of the grader's own package or files (``autograder``): the hidden tests live there.
"""

from __future__ import annotations

import ast
import re

from autograder.cells import meta
from decodelab.course import exercises


def references() -> dict[str, str]:
    """exercise function -> "module:function" of the library's reference, for every exercise of the
    course (the table of exercises, which each checks module's REFERENCES is read from)."""
    return exercises.references()


def _names_used(source: str) -> tuple[set[str], set[str], set[str]]:
    """(attribute and plain names, imported names, string constants) in a cell's code."""
    names, imported, strings = set(), set(), set()
    try:
        tree = ast.parse(source)
    except SyntaxError:
        names.update(re.findall(r"[A-Za-z_]\w*", source))
        strings.update(re.findall(r"[\"']([^\"']*)[\"']", source))
        return names, imported, strings
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
            imported.update(f"{node.module}:{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.add(node.value)
    return names, imported, strings


def scan(nb, release) -> list[str]:
    """Flags for a submitted notebook, compared with the release it came from."""
    refs = references()
    released_sources = {c.source.strip() for c in release.cells if c.cell_type == "code"}
    flags = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        role = meta(cell)
        is_answer = role.get("solution") or (not role.get("grade") and cell.source.strip() not in released_sources)
        if not is_answer:
            continue
        label = role.get("grade_id") or f"cell {index}"
        names, imported, strings = _names_used(cell.source)
        for function, reference in refs.items():
            module, _, ref_name = reference.partition(":")
            if ref_name == function:  # the learner defines this name too: only module.<name> counts
                used = _attribute_use(cell.source, ref_name)
            else:
                used = ref_name in names
            if f"{module}:{ref_name}" in imported or used or ref_name in strings:
                flags.append(f"{label} uses the reference {module}.{ref_name}")
        if (
            any(name == "autograder" or name.startswith("autograder.") for name in imported)
            or "autograder" in names
            or any("autograder" in s for s in strings)
        ):
            flags.append(f"{label} touches the grader's files (autograder/)")
    return sorted(set(flags))


def _attribute_use(source: str, name: str) -> bool:
    try:
        return any(isinstance(n, ast.Attribute) and n.attr == name for n in ast.walk(ast.parse(source)))
    except SyntaxError:
        return f".{name}" in source
