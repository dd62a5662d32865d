"""nbgrader configuration for Decode Lab: one file for `make release`, grading and the Validate
button of `make lab`.

nbgrader reads nbgrader_config.py from its working directory and from Jupyter's config paths.
`make release` and `python -m autograder ...` run from the repository root; `make lab` starts
JupyterLab from the root too (the Validate button reads the server's working directory) and
puts the root on JUPYTER_CONFIG_PATH, so `nbgrader validate` finds this file from any folder.

Course layout: the source notebooks (solutions, visible and hidden tests) are solutions/NAME/,
the student release that nbgrader generates is course/NAME/.
"""

import os

c = get_config()  # noqa: F821 - provided by traitlets when it loads this file

c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "course"

# What a solution region becomes in the release: a stub that fails loudly until filled in.
c.ClearSolutions.code_stub = {
    "python": '# YOUR CODE HERE\nraise NotImplementedError("write this function, then run the test cell below it")',
}

# Every cell may take a while: a fresh kernel imports torch (~4 s) and loads SmolLM2 before the
# first test runs, and a busy machine is slower. nbgrader's default of 30 s is far too short.
c.Execute.timeout = 300
c.Execute.startup_timeout = 120

# Late submissions (python -m autograder grade; see README "Grading a class"). The due date is the
# gradebook's (nbgrader db assignment add NAME --duedate ..., or grade --due); a time without a zone
# is in Exchange.timezone. Uncomment to charge late work:
# c.Exchange.timezone = "Europe/Berlin"
# c.AssignLatePenalties.plugin_class = "autograder.late.PointsPerDay"  # or PercentPerDay, ZeroAfterCutoff
# c.PointsPerDay.points = 1         # per day late; a started day counts (partial_days = "fraction" prorates)
# c.PointsPerDay.cutoff_days = 7    # later than that: score 0

# Hidden-test cells import `autograder.run`, which lives next to this file and is never part of the
# student release. Kernels started by nbgrader (autograde, validate) inherit this environment.
_root = os.path.dirname(os.path.abspath(__file__))
_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
if _root not in _paths:
    os.environ["PYTHONPATH"] = os.pathsep.join([_root, *_paths])
# Passive OpenMP waiting: spinning threads make decode several times slower on a busy machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
