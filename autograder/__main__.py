"""python -m autograder COMMAND [options]: the instructor's commands; `python -m autograder COMMAND
--help` lists a command's options.

    python -m autograder grade --assignment NAME --submissions DIR --out grades.csv [--feedback DIR] [--workers N]
    python -m autograder export --format canvas --grades grades.csv --roster canvas_export.csv --out canvas.csv
    python -m autograder export --format long --grades grades.csv --out cells.csv
    python -m autograder report --assignment NAME --grades grades.csv [--submissions DIR] [--out report.html] [--json]
    python -m autograder scheduler --scheduler-file sched.json ...   # then: python -m autograder worker --scheduler-file sched.json
"""

import sys

COMMANDS = {
    "grade": "grade a class's submissions (nbgrader, sandboxed kernels) into grades.csv and the gradebook",
    "export": "write grades.csv for an LMS: a filled Canvas gradebook import, or one row per test cell",
    "report": "one HTML page (or JSON) on how the class did: scores, failures per test cell, hints, predictions",
    "scheduler": "start a Dask scheduler that can read the grader's tasks (run it from the repository root)",
    "worker": "start Dask grading workers, one submission at a time each (run it from the repository root)",
}
USAGE = "usage: python -m autograder {" + ",".join(COMMANDS) + "} ..."


def usage() -> str:
    """The usage line, one line per command, and where each command's options are."""
    width = max(map(len, COMMANDS))
    lines = [
        USAGE,
        "",
        "commands:",
        *(f"  {name:<{width}}  {what}" for name, what in COMMANDS.items()),
        "",
        "python -m autograder COMMAND --help lists the command's options.",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        problem = f"unknown command {argv[0]!r}" if argv else "no command given"
        print(f"{usage()}\nautograder: error: {problem} (the commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    if argv[0] == "export":
        from autograder.export import main as export

        return export(argv[1:])
    if argv[0] == "report":
        from autograder.report import main as report

        return report(argv[1:])
    if argv[0] in ("scheduler", "worker"):
        from autograder.dask_cli import main as dask_cli

        return dask_cli(argv)
    from autograder.grade import main as grade

    return grade(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
