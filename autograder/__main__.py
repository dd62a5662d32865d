"""python -m autograder grade --assignment NAME --submissions DIR --out grades.csv [--feedback DIR] [--workers N]"""
import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] != "grade":
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    from autograder.grade import main as grade

    return grade(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
