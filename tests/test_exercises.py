"""The course's one table of exercises (decodelab.course.exercises) agrees with everything that names
exercises: the notebooks' exercise cells (in order), the hint ladders' keys, the checks modules'
REFERENCES, the engine's stages, and the references themselves exist."""

from __future__ import annotations

import importlib
import json

import pytest
from notebooks import COURSE, ROOT, SOLUTIONS, grade_id, read

from decodelab.course import exercises, parts, progress
from decodelab.paths import PACKAGE_DATA


def exercise_cells(root, notebook) -> list[str]:
    """The exercise names of a notebook's `ex_` cells, in notebook order."""
    path = root / notebook / f"{notebook}.ipynb"
    return [g[3:] for g in map(grade_id, read(path).cells) if g and g.startswith("ex_")]


def test_the_table_names_every_notebook_with_exercises():
    on_disk = sorted(p.name for p in SOLUTIONS.iterdir() if (p / f"{p.name}.ipynb").is_file())
    with_exercises = [name for name in on_disk if exercise_cells(SOLUTIONS, name)]
    assert exercises.notebooks() == with_exercises


@pytest.mark.parametrize("root", [SOLUTIONS, COURSE], ids=["solutions", "course"])
def test_each_notebooks_exercise_cells_are_the_tables_in_order(root):
    for notebook in exercises.notebooks():
        assert exercise_cells(root, notebook) == [e.name for e in exercises.exercises_of(notebook)], notebook


def test_the_hint_ladders_are_keyed_by_the_tables_exercises_in_order():
    ladders = json.loads((PACKAGE_DATA / "hints.json").read_text())
    assert list(ladders) == exercises.notebooks()
    for notebook, by_cell in ladders.items():
        assert list(by_cell) == [f"ex_{e.name}" for e in exercises.exercises_of(notebook)], notebook


def test_each_checks_module_reads_its_notebooks_references():
    for notebook in exercises.notebooks():
        module = importlib.import_module(f"autograder.checks.{exercises.topic(notebook)}")
        assert module.REFERENCES == exercises.references(notebook), notebook
    names = [e.name for e in exercises.EXERCISES]
    assert len(set(names)) == len(names), "the integrity report keys references by exercise name alone"


@pytest.mark.parametrize("exercise", exercises.EXERCISES, ids=lambda e: f"{e.notebook}:{e.name}")
def test_every_reference_exists(exercise):
    module, _, attr = exercise.reference.partition(":")
    assert (ROOT / "lib" / module.replace(".", "/")).with_suffix(".py").is_file(), exercise.reference
    source = (ROOT / "lib" / module.replace(".", "/")).with_suffix(".py").read_text()
    assert f"def {attr}(" in source or f"class {attr}(" in source or f"class {attr}:" in source, exercise.reference


def test_parts_and_stages_are_read_from_the_table():
    assert progress.PARTS is exercises.PARTS
    parts_named = list(exercises.PARTS.values())
    assert all(p.strip() for p in parts_named) and len(set(parts_named)) == len(parts_named), "one part each"
    from decodelab.engine.llm import EngineHooks

    hooks = set(vars(EngineHooks()))
    fed = {e.stage for e in exercises.EXERCISES if e.stage}
    assert fed <= hooks and fed == {stage.hook for stage in parts.STAGES}
    for stage in parts.STAGES:
        assert [(stage.notebook, name) for name in stage.exercises] == [
            (e.notebook, e.name) for e in exercises.EXERCISES if e.stage == stage.hook
        ]


def test_a_name_the_table_lacks_is_a_clear_error():
    with pytest.raises(ValueError, match="no exercises for notebook '99_nothing'"):
        exercises.references("99_nothing")
    with pytest.raises(ValueError, match="02_sampling has no exercise 'top_q'"):
        exercises.find("02_sampling", "top_q")
    with pytest.raises(ValueError, match="one notebook, found none"):
        exercises.stage_exercises("no_such_hook")
