"""Hint ladders: a button under each exercise that reveals its hints one rung at a time.

    from decodelab import course
    course.hint_button("02_sampling", "ex_top_k_filter")   # one line, in the cell after the exercise

The hints live in one file shipped with the package, ``decodelab/data/hints.json``:
``{"NN_topic": {"ex_<name>": ["a nudge", "the key idea", "a pseudo-code sketch"]}}``, from the
gentlest rung to the most explicit, never the solution (tests/test_hints.py keeps every solution
line out of them). ``python -m decodelab hints [--json] [--notebook NN_topic]`` prints them.

Each click shows one more rung; after the last the button says there are no more. How many rungs
an exercise has shown is counted in ``.decodelab_hints.json`` in the kernel's working directory
(the notebook's folder in Jupyter): ``{"NN_topic": {"ex_<name>": rungs_shown}}``, the largest
number ever shown, written atomically. Kernel code cannot write the notebook's own metadata,
hence the file beside it. A folder that cannot be written costs the count, never an error in
the notebook. ``python -m decodelab progress`` shows the counts per exercise, and the class
grader notes them ("hints: ex_top_k_filter 2"), never scoring them.

No ipywidgets at import time: the CLI, `progress` and the grader use the loading and counting.
"""

from __future__ import annotations

import functools
import html
import json
import os
import re
import tempfile
from pathlib import Path

from decodelab.paths import PACKAGE_DATA

HINTS_FILE = PACKAGE_DATA / "hints.json"
COUNTER_FILE = ".decodelab_hints.json"
MAX_COUNTER_BYTES = 256 * 1024  # a counter file larger than this is not ours: ignored
LAST_RUNG_NOTE = "That was the last hint: there are no more."


@functools.lru_cache(maxsize=1)
def _load(path: str) -> dict[str, dict[str, list[str]]]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def load_hints() -> dict[str, dict[str, list[str]]]:
    """Every notebook's hints, {"NN_topic": {"ex_<name>": [rung, ...]}} (a fresh copy)."""
    return {
        nb: {ex: list(rungs) for ex, rungs in exercises.items()} for nb, exercises in _load(str(HINTS_FILE)).items()
    }


def hints_for(notebook: str, exercise: str) -> list[str]:
    """The rungs of one exercise ([] when it has none). `exercise` is "ex_<name>" or "<name>"."""
    exercises = _load(str(HINTS_FILE)).get(notebook, {})
    return list(exercises.get(exercise) or exercises.get(f"ex_{exercise}") or [])


def select(hints: dict, notebook: str | None = None) -> dict:
    """The hints of one notebook ("02_sampling" or "02"), or all; ValueError for an unknown one."""
    if not notebook:
        return hints
    name = notebook.strip().rstrip("/")
    found = {nb: ex for nb, ex in hints.items() if nb == name or nb[:2] == name}
    if not found:
        raise ValueError(f"no hints for notebook {notebook!r}; there are hints for {', '.join(sorted(hints))}")
    return found


def format_text(hints: dict) -> str:
    """Readable text: each notebook, each exercise, its numbered rungs."""
    lines = []
    for notebook, exercises in hints.items():
        lines.append(notebook)
        for exercise, rungs in exercises.items():
            lines.append(f"  {exercise}")
            lines.extend(f"    {i}. {rung}" for i, rung in enumerate(rungs, 1))
        lines.append("")
    return "\n".join(lines).rstrip()


# --------------------------------------------------------------------------- the counter file


def read_counts(folder=None) -> dict[str, dict[str, int]]:
    """{"NN_topic": {"ex_<name>": rungs shown}} from folder/.decodelab_hints.json (default: the
    working directory); {} when it is missing, unreadable or not ours. Never raises: the file
    sits in a learner's folder and anything may be in it."""
    path = Path(folder if folder is not None else os.getcwd()) / COUNTER_FILE
    try:
        if path.stat().st_size > MAX_COUNTER_BYTES:
            return {}
        return counts_from_text(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return {}


def counts_from_text(text: str) -> dict[str, dict[str, int]]:
    """The counter file's text -> {"NN_topic": {"ex_<name>": rungs shown}}; {} when it is not ours."""
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    counts: dict[str, dict[str, int]] = {}
    if isinstance(data, dict):
        for notebook, exercises in data.items():
            if not isinstance(exercises, dict):
                continue
            kept = {
                str(ex): n for ex, n in exercises.items() if isinstance(n, int) and not isinstance(n, bool) and n > 0
            }
            if kept:
                counts[str(notebook)] = kept
    return counts


def record(notebook: str, exercise: str, shown: int, folder=None) -> bool:
    """Remember that `shown` rungs of an exercise were seen (the count only grows); an atomic
    write of the whole file (a temporary file, then os.replace). False, and nothing raised,
    when the folder cannot be written."""
    folder = Path(folder if folder is not None else os.getcwd())
    try:
        counts = read_counts(folder)
        exercises = counts.setdefault(notebook, {})
        if exercises.get(exercise, 0) >= shown:
            return True
        exercises[exercise] = int(shown)
        fd, tmp = tempfile.mkstemp(prefix=".decodelab_hints.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(counts, out, indent=1, sort_keys=True)
                out.write("\n")
            os.replace(tmp, folder / COUNTER_FILE)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except Exception:  # noqa: BLE001 - a read-only or full disk costs the count, never the notebook
        return False
    return True


def note(counts: dict, notebook: str) -> str | None:
    """The grader's note for one notebook's counts, "hints: ex_top_k_filter 2, ex_top_p_filter 1"
    (exercises in name order), or None when no hint was used. No "; " in it: the notes
    column joins notes with that."""
    used = counts.get(notebook) if isinstance(counts, dict) else None
    if not isinstance(used, dict):
        return None
    parts = [
        f"{re.sub(r'[^A-Za-z0-9_]', '?', str(ex))[:60]} {n}"
        for ex, n in sorted(used.items())
        if isinstance(n, int) and not isinstance(n, bool) and n > 0
    ]
    return f"hints: {', '.join(parts[:60])}" if parts else None


# --------------------------------------------------------------------------- the button


def _markup(text: str) -> str:
    """A rung as HTML: escaped, `code` in backticks as <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def render(rungs: list[str], shown: int) -> str:
    """The HTML of the first `shown` rungs, and the last-rung note once all are out."""
    if shown <= 0:
        return ""
    items = "".join(f"<li>{_markup(r)}</li>" for r in rungs[:shown])
    tail = f"<p><i>{html.escape(LAST_RUNG_NOTE)}</i></p>" if shown >= len(rungs) else ""
    return f"<ol style='margin: 0.3em 0'>{items}</ol>{tail}"


class HintButton:
    """The button and the HTML it fills; `click()` shows the next rung (as a click does)."""

    def __init__(self, notebook: str, exercise: str, folder=None):
        import ipywidgets as widgets

        self.notebook, self.exercise = notebook, exercise
        self.folder = Path(folder) if folder is not None else Path(os.getcwd())
        self.rungs = hints_for(notebook, exercise)
        self.shown = 0
        self.button = widgets.Button(
            description=self._label(),
            tooltip=f"hints for {exercise}, one at a time",
            layout=widgets.Layout(width="auto"),
            disabled=not self.rungs,
        )
        self.html = widgets.HTML(value="" if self.rungs else f"<i>No hints for {html.escape(exercise)}.</i>")
        self.button.on_click(lambda _button: self.click())
        self.widget = widgets.VBox([self.button, self.html])

    def _label(self) -> str:
        if not self.rungs:
            return "No hints"
        if self.shown >= len(self.rungs):
            return "No more hints"
        return f"Show hint {self.shown + 1} of {len(self.rungs)}"

    def click(self) -> None:
        if self.shown >= len(self.rungs):
            return
        self.shown += 1
        self.html.value = render(self.rungs, self.shown)
        self.button.description = self._label()
        self.button.disabled = self.shown >= len(self.rungs)
        record(self.notebook, self.exercise, self.shown, self.folder)

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def hint_button(notebook: str, exercise: str, folder=None) -> HintButton:
    """The hint button of one exercise; the cell's last line, so Jupyter draws it."""
    return HintButton(notebook, exercise, folder)
