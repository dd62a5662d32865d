"""One round of `progress --bench` in a fresh process (speed_credit.py starts it, in the course
folder): it loads the learner's notebooks the way `course.parts` does, and for each timed part
checks the learner's output against the library's reference on this round's inputs, then times
the two in order-alternated pairs. One JSON line per part to the results file:
{"part", "learner": [s, ...], "reference": [s, ...], "bytes"} or {"part", "error"}.

    python -m decodelab.course.speed_worker SPEC.json RESULTS.jsonl
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

from decodelab.course.progress_plan import first_line
from decodelab.course.progress_process import die_with_parent


def _learner_namespaces(course: Path, parts, statuses: dict) -> dict[str, dict]:
    """notebook -> the namespace its import cell and exercise cells ran in (course.parts' rule)."""
    from decodelab.course.parts import load_notebook

    namespaces = {}
    for notebook in dict.fromkeys(part.notebook for part in parts):
        needed = {name for part in parts if part.notebook == notebook for name in part.exercises}
        mine = {name: status for (nb, name), status in statuses.items() if nb == notebook}
        namespaces[notebook] = load_notebook(course / notebook / f"{notebook}.ipynb", needed, mine)
    return namespaces


def _time_part(part, namespace: dict, spec: dict) -> dict:
    from decodelab.course.speed_credit import paired_times
    from decodelab.course.speed_parts import reference_namespace, same_output

    size, seed, device = spec["size"], spec["seed"], spec["device"]
    reference = part.workload(part.build(reference_namespace(part)), size, seed, device)
    quiet = io.StringIO()  # the learner's prints stay out of the results
    with contextlib.redirect_stdout(quiet):
        learner = part.workload(part.build(namespace), size, seed, device)
        problem = same_output(part, learner.output(), reference.output())
        if problem:
            return {"error": f"{problem} on this round's inputs: not timed"}
        learner_s, reference_s = paired_times(learner, reference, spec["pairs"], device, spec["learner_first"])
    return {"learner": learner_s, "reference": reference_s, "bytes": learner.bytes_moved}


def worker(spec_path: str, results_path: str) -> int:
    from decodelab.course.speed_parts import part_named

    spec = json.loads(Path(spec_path).read_text())
    die_with_parent(spec.get("parent"))
    course = Path(spec["course"])
    statuses = {(nb, ex): status for nb, ex, status in spec["statuses"]}
    parts = [part_named(name) for name in spec["parts"]]
    with open(results_path, "a", buffering=1) as results:

        def emit(**event):
            results.write(json.dumps(event) + "\n")
            results.flush()

        try:
            namespaces = _learner_namespaces(course, parts, statuses)
        except Exception as exc:  # noqa: BLE001 - a notebook that cannot be loaded: every part says so
            why = f"could not load the notebooks: {first_line(f'{type(exc).__name__}: {exc}')}"
            for part in parts:
                emit(part=part.name, error=why)
            return 0
        for part in parts:
            try:
                emit(part=part.name, **_time_part(part, namespaces[part.notebook], spec))
            except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
                emit(part=part.name, error=f"it raised {first_line(f'{type(exc).__name__}: {exc}')}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(
            "usage: python -m decodelab.course.speed_worker SPEC.json RESULTS.jsonl "
            "(progress --bench starts it; you want: python -m decodelab progress --course DIR --bench)"
        )
    sys.exit(worker(sys.argv[1], sys.argv[2]))
