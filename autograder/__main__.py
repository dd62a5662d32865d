"""python -m autograder grade --assignment NAME --submissions DIR --out grades.csv [--feedback DIR] [--workers N]
python -m autograder export --format canvas --grades grades.csv --roster canvas_export.csv --out canvas.csv
python -m autograder export --format long --grades grades.csv --out cells.csv"""
import sys

COMMANDS = ("grade", "export", "scheduler", "worker")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "export":
        from autograder.export import main as export

        return export(argv[1:])
    if argv[0] in ("scheduler", "worker"):
        from autograder.dask_cli import main as dask_cli

        return dask_cli(argv)
    from autograder.grade import main as grade

    return grade(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
