"""The helpers the notebooks lean on: the hidden-test runner (message only, never the hidden
source), the stub-aware fallback, the visible tests' checking helpers, and the widgets
(driven from Python: a slider change redraws the figure)."""

from __future__ import annotations

import sys
import traceback

import pytest
import torch

from autograder.run import HiddenTestFailed, hidden
from decodelab import course
from decodelab.course import checking
from decodelab.decoding import sampling
from decodelab.lessons import measure

# --------------------------------------------------------------------------- hidden runner


def test_hidden_passes_quietly_on_the_reference(capsys):
    hidden("sampling.check_top_k_filter", sampling.top_k_filter)
    out = capsys.readouterr()
    assert out.out.strip() == "hidden tests passed: top_k_filter" and out.err == ""


def test_hidden_failure_shows_the_message_and_no_hidden_source():
    def top_k_filter(logits, k):
        return logits  # keeps everything

    with pytest.raises(HiddenTestFailed) as info:
        hidden("sampling.check_top_k_filter", top_k_filter)
    failure = info.value
    assert "hidden test failed: top_k_filter(logits, k=" in str(failure) and "expected" in str(failure)
    assert failure.__cause__ is None and failure.__context__ is None and failure.__suppress_context__
    frames = traceback.extract_tb(failure.__traceback__)
    assert not any("checks" in frame.filename for frame in frames), [f.filename for f in frames]
    shown = "".join(traceback.format_exception(failure))
    assert "_compare(" not in shown and "def check_top_k_filter" not in shown


def test_hidden_swallows_what_the_function_prints(capsys):
    def noisy_top_k(logits, k):
        print("debugging...", file=sys.stderr)
        return sampling.top_k_filter(logits, k)

    hidden("sampling.check_top_k_filter", noisy_top_k)
    assert capsys.readouterr().err == ""


def test_hidden_stub_and_unknown_check():
    def stub(logits, k):
        raise NotImplementedError("write this function")

    with pytest.raises(
        HiddenTestFailed, match="^hidden test failed: stub is not written yet: it raises NotImplementedError"
    ):
        hidden("sampling.check_top_k_filter", stub)
    with pytest.raises(HiddenTestFailed, match="no hidden test named"):
        hidden("sampling.check_nothing", stub)


# --------------------------------------------------------------------------- stub fallback


def test_use_or_reference(capsys):
    def stub(logits, k):
        raise NotImplementedError

    def crashes(logits, k):
        raise IndexError("off by one")

    def mine(logits, k):
        return logits

    probe = (torch.zeros(3), 1)
    assert course.use_or_reference(stub, sampling.top_k_filter, probe) is sampling.top_k_filter
    out = capsys.readouterr()
    assert (
        "stub is not written yet" in out.out and "decodelab.decoding.sampling.top_k_filter" in out.out and out.err == ""
    )
    assert course.use_or_reference(crashes, sampling.top_k_filter, probe) is sampling.top_k_filter
    assert "raised IndexError: off by one" in capsys.readouterr().out
    assert course.use_or_reference(mine, sampling.top_k_filter, probe) is mine
    assert capsys.readouterr().out == ""


def test_fast_mode(monkeypatch):
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    monkeypatch.setenv("DECODELAB_FAST", "0")
    assert not course.fast_mode()
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    assert course.fast_mode()
    monkeypatch.delenv("NBGRADER_EXECUTION")
    monkeypatch.setenv("DECODELAB_FAST", "1")
    assert course.fast_mode()


# --------------------------------------------------------------------------- checking helpers


def test_checking_messages_say_what_expected_and_got():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    wrong = logits.masked_fill(torch.tensor([False, False, True, True]), float("-inf"))
    with pytest.raises(
        AssertionError, match=r"top_p_filter\(p=0.9\): kept tokens \[0, 1\] \(of 4\), expected to keep \[0, 1, 2\]"
    ):
        checking.expect_kept(wrong, logits, [0, 1, 2], "top_p_filter(p=0.9)")
    checking.expect_kept(wrong, logits, [0, 1], "top_p_filter(p=0.8)")
    with pytest.raises(AssertionError, match=r"bound: expected 23.93, got 0.0418"):
        checking.expect_close(0.0418, 23.93, "bound")
    with pytest.raises(AssertionError, match=r"expected -4 at index 1, got -1"):
        checking.expect_close(torch.tensor([1.0, -1.0]), torch.tensor([1.0, -4.0]), "penalty")
    with pytest.raises(AssertionError, match=r"expected shape \[3\], got shape \[2\]"):
        checking.expect_close(torch.zeros(2), torch.zeros(3), "shape")
    checking.expect_close(torch.tensor([float("-inf"), 1.0]), torch.tensor([float("-inf"), 1.0]), "inf entries")
    with pytest.raises(AssertionError, match=r"expected the integer 7056, got float 7056.0 \(use //"):
        checking.expect_int(7056.0, 7056, "count")
    with pytest.raises(AssertionError, match=r"bound\(0\) should raise ValueError; it returned inf"):
        checking.expect_raises(ValueError, lambda: float("inf"), what="bound(0)")
    with pytest.raises(AssertionError, match="changed its input in place"):
        checking.expect_unchanged(torch.zeros(2), torch.ones(2), "f")
    with pytest.raises(AssertionError, match=r"expected \[1, 0\], got \[0, 0\]"):
        checking.expect_equal([0, 0], [1, 0], "ids")


def test_expect_equal_on_long_tensors_names_the_first_difference():
    """Two tensors too long to print read the same (their shape and dtype), so the message says where
    they first differ (issue 34: 02's reproducibility test printed two identical-looking descriptions)."""
    first = torch.arange(500) % 3
    again = first.clone()
    again[[17, 300]] += 1
    with pytest.raises(
        AssertionError,
        match=r"seeded 42: expected <tensor of shape \[500\], dtype torch.int64>, got "
        r"<tensor of shape \[500\], dtype torch.int64>; they first differ at index 17: "
        r"expected 2, got 3 \(2 of 500 entries differ\)",
    ):
        checking.expect_equal(again, first, "seeded 42")
    grid = torch.zeros(4, 5)
    with pytest.raises(AssertionError, match=r"first differ at index \(1, 3\): expected 1, got 0 \(1 of 20"):
        checking.expect_equal(grid, grid.index_put((torch.tensor(1), torch.tensor(3)), torch.tensor(1.0)), "grid")
    checking.expect_equal(first.clone(), first, "same")


# --------------------------------------------------------------------------- widgets


def test_decode_bound_explorer_redraws_on_slider_change():
    from decodelab.course.widgets.meet_the_model import decode_bound_explorer

    box = decode_bound_explorer(measure.decode_tokens_per_second_bound)
    title = box.figure.layout.title.text
    assert "70B parameters x 2 bytes = 140 GB" in title and "23.9 tokens/s" in title
    box.controls["bandwidth"].value = 2000
    assert "14.3 tokens/s" in box.figure.layout.title.text
    box.controls["precision"].value = 1.0
    assert "28.6 tokens/s" in box.figure.layout.title.text


def test_widget_views_start_from_the_first_drawing():
    """A view created after the first redraw (Run All on a busy kernel) must not draw the empty
    figure the widget was constructed with: the synced start state holds the first drawing."""
    from decodelab.course.widgets.meet_the_model import decode_bound_explorer

    box = decode_bound_explorer(measure.decode_tokens_per_second_bound)
    synced = box.figure._widget_layout
    assert "23.9 tokens/s" in synced["title"]["text"]
    assert len(box.figure._widget_data) == len(box.figure.data) > 0
    assert all(len(trace.get("x", ())) > 0 for trace in box.figure._widget_data)


def test_no_widget_displays_into_an_output_widget():
    """Under nbclient (the notebook tests, nbgrader's autograde, the class grader) a cell that
    displays into an ipywidgets.Output can stall for the whole cell timeout: nbclient echoes each
    such output to the kernel on the shell socket through a blocking shadow of the asyncio socket
    it polls for the execute_reply, and that send can swallow the poll's wake-up. The tiled
    attention explorer did, and its release run stalled 300 s. Explorers draw into FigureWidgets."""
    import ast
    from pathlib import Path

    import decodelab.course.widgets as package

    offenders = []
    for path in sorted(Path(package.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = getattr(node, "attr", None) or getattr(node, "id", None)
            if isinstance(node, (ast.Attribute, ast.Name)) and name in ("Output", "clear_output"):
                offenders.append(f"{path.name}:{node.lineno} {name}")
            if isinstance(node, ast.ImportFrom) and any(a.name in ("Output", "clear_output") for a in node.names):
                offenders.append(f"{path.name}:{node.lineno} import")
    assert not offenders, f"ipywidgets.Output / clear_output in a widget module: {offenders}"


def test_sampling_explorer_uses_the_given_functions():
    from decodelab.course.widgets.sampling import sampling_explorer

    class Tokens:
        def token_strings(self, ids):
            return [f"t{i}" for i in ids]

    calls = []

    def counting_sample(logits, params, generator=None):
        calls.append(tuple(logits.shape))
        return sampling.sample(logits, params, generator)

    fns = {
        "temperature": sampling.apply_temperature,
        "top_k": sampling.top_k_filter,
        "top_p": sampling.top_p_filter,
        "repetition_penalty": sampling.apply_repetition_penalty,
        "sample": counting_sample,
    }
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0, -2.0])
    box = sampling_explorer(logits, torch.tensor([0]), Tokens(), fns, num_draws=50, shown=4)
    assert calls == [(50, 6)] and "6 tokens can be drawn" in box.figure.layout.title.text
    box.controls["top_k"].value = 2
    assert "2 tokens can be drawn" in box.figure.layout.title.text
    assert list(box.figure.data[0].x) == ["t0", "t1", "t2", "t3"]
    assert sum(box.figure.data[1].y[:2]) == pytest.approx(1.0)  # draws only from the two kept tokens
    box.controls["temperature"].value = 0.0
    assert list(box.figure.data[0].y) == [1.0, 0.0, 0.0, 0.0]


def test_speculative_figures_draw_measured_beside_benchmark_and_seed():
    from decodelab.course.widgets.speculative_decoding import (
        BENCH_TINY_VERIFY_COST,
        SEED_ALPHA_RANGE,
        SEED_POINTS,
        temperature_figure,
        verify_cost_figure,
    )

    fig = temperature_figure({0.0: (0.58, 0.9), 0.7: (0.48, 0.8), 1.0: (0.55, 0.85)}, k=2)
    names = [trace.name for trace in fig.data]
    assert names.count("measured here") == 2 and "seed article, T = 0.7, k = 2" in names
    assert list(fig.data[0].y) == [0.58, 0.48, 0.55] and list(fig.data[2].y) == [0.9, 0.8, 0.85]
    assert any(shape.y0 == SEED_ALPHA_RANGE[0] for shape in fig.layout.shapes)
    seed = next(trace for trace in fig.data if trace.name.startswith("seed article"))
    assert list(seed.y) == [SEED_POINTS[2][1]]
    fig = verify_cost_figure({1: 1.0, 2: 1.2, 5: 1.4, 9: 1.7}, "verify")
    assert list(fig.data[0].x) == [1, 2, 5, 9] and list(fig.data[0].y) == [1.0, 1.2, 1.4, 1.7]
    assert list(fig.data[1].y) == [BENCH_TINY_VERIFY_COST[n] for n in sorted(BENCH_TINY_VERIFY_COST)]
    assert list(fig.data[-1].y) == [1, 1]  # Theorem 3.8's assumption


# --------------------------------------------------------------------------- predictions (q_ cells)


def test_expect_prediction_wants_a_finite_number(capsys):
    from decodelab.course.predictions import expect_prediction

    expect_prediction(None, "q_mha_kv_mib")  # unanswered: said, not raised, so that Run All goes on (graded 0)
    assert "q_mha_kv_mib is unanswered (still None)" in capsys.readouterr().out
    for bad in ("512", True, float("nan"), [1]):
        with pytest.raises(AssertionError, match=r"q_mha_kv_mib must be a finite number \(in MiB\)"):
            expect_prediction(bad, "q_mha_kv_mib")
    expect_prediction(512, "q_mha_kv_mib")
    assert "q_mha_kv_mib = 512 MiB" in capsys.readouterr().out


def test_show_beside_states_the_ratio(capsys):
    from decodelab.course.predictions import show_beside

    for args in (("rows", 100, 200), ("rows", 100, 105), ("rows", None, 3.0), ("rows", "lots", 3.0)):
        assert show_beside(*args) is None  # printed once: a returned line would show again as the cell's value
    lines = capsys.readouterr().out.splitlines()
    assert "measured / predicted = 2: more than you said" in lines[0] and "close" in lines[1]
    assert "no prediction" in lines[2] and "is not a number" in lines[3]


def test_expect_answer_states_the_tolerance():
    from autograder.checks.answers import expect_answer

    expect_answer("q_mha_kv_mib", 2100.0, 2048.0, "why")  # within 5%
    with pytest.raises(
        AssertionError,
        match=r"you predicted 2,200; the answer is 2,048 MiB \(graded within 5% of "
        r"the answer\): why",
    ):
        expect_answer("q_mha_kv_mib", 2200, 2048.0, "why")
    with pytest.raises(AssertionError, match="no prediction"):
        expect_answer("q_mha_kv_mib", None, 2048.0, "why")
    with pytest.raises(AssertionError, match="got bool"):
        expect_answer("q_mha_kv_mib", True, 1.0, "why")
    with pytest.raises(AssertionError, match="within 0.5 of the answer"):
        expect_answer("q_chunked_steps", 5, 4, "why")
    expect_answer("q_chunked_steps", 4, 4, "why")


def test_release_opens_prediction_cells(tmp_path):
    """The release turns a q_ cell's stub into `q_name = None` and keeps nbgrader's checksum true."""
    import json

    import nbformat
    from nbgrader.utils import compute_checksum

    from autograder.release import load_config, open_predictions

    stub = load_config().ClearSolutions.code_stub["python"]
    nb = nbformat.v4.new_notebook()
    q = nbformat.v4.new_code_cell(f"# predict\n{stub}")
    q.metadata["nbgrader"] = {
        "grade": False,
        "grade_id": "q_rows",
        "locked": False,
        "schema_version": 3,
        "solution": True,
        "task": False,
        "checksum": "stale",
    }
    ex = nbformat.v4.new_code_cell(f"def f():\n    {stub}")
    ex.metadata["nbgrader"] = {"grade": False, "grade_id": "ex_f", "solution": True, "schema_version": 3}
    nb.cells = [q, ex]
    path = tmp_path / "n.ipynb"
    nbformat.write(nb, str(path))
    open_predictions(path)
    cells = nbformat.read(str(path), as_version=4).cells
    assert cells[0].source == "# predict\nq_rows = None  # your prediction: replace None with a number"
    assert cells[0].metadata.nbgrader["checksum"] == compute_checksum(cells[0])
    assert stub in cells[1].source  # an exercise keeps its stub
    assert json.loads(path.read_text())["cells"][0]["source"][0] == "# predict\n"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Object of type .* not in session")  # nbgrader's own gradebook code
def test_an_unanswered_prediction_runs_on_and_still_grades_zero(tmp_path, monkeypatch):
    """Issue 34 item 7, with nbgrader's own semantics (a graded cell scores 0 exactly when it raises): 03's
    first prediction and its graded cell, released and submitted. The released cell, run on `None`, prints
    that it is unanswered and raises nothing (Run All goes on); autograded, its hidden block comes back and
    scores the unanswered prediction 0 and the right one full marks."""
    import contextlib
    import io

    import nbformat
    from nbgrader.api import Gradebook
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory
    from notebooks import ROOT, grade_id, read, solution_path

    from autograder.release import ensure_tools_on_path, load_config, open_predictions

    source = read(solution_path("03_kv_cache"))
    cells = [c for c in source.cells if grade_id(c) in ("q_rows_without_cache", "test_q_rows_without_cache")]
    assert len(cells) == 2
    nb = nbformat.v4.new_notebook(metadata=source.metadata)
    nb.cells = cells
    name = "mini"
    (tmp_path / "solutions" / name).mkdir(parents=True)
    nbformat.write(nb, str(tmp_path / "solutions" / name / f"{name}.ipynb"))
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}:{ROOT / 'lib'}")  # the kernels import this checkout
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    ensure_tools_on_path()
    config = load_config()
    config.CourseDirectory.root = str(tmp_path)
    api = NbGraderAPI(CourseDirectory(config=config), config=config)
    assert api.generate_assignment(name)["success"]
    released = tmp_path / "course" / name / f"{name}.ipynb"
    open_predictions(released)
    release = read(released)
    assert "q_rows_without_cache = None" in release.cells[0].source

    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for cell in release.cells:  # what Run All does in JupyterLab, minus the kernel
            exec(compile(cell.source, grade_id(cell), "exec"), namespace)  # noqa: S102 - our own notebook
    assert "q_rows_without_cache is unanswered (still None)" in out.getvalue()

    answered = read(released)
    answered.cells[0].source = "q_rows_without_cache = 1035"
    for student, submission in (("unanswered", release), ("answered", answered)):
        folder = tmp_path / "submitted" / student / name
        folder.mkdir(parents=True)
        nbformat.write(submission, str(folder / f"{name}.ipynb"))
        result = api.autograde(name, student)
        assert result["success"], result.get("log")
    with Gradebook(f"sqlite:///{tmp_path / 'gradebook.db'}") as gradebook:
        scores = {
            student: {
                g.name: (g.score, g.max_score) for g in gradebook.find_submission_notebook(name, name, student).grades
            }
            for student in ("unanswered", "answered")
        }
    points = scores["answered"]["test_q_rows_without_cache"][1]
    assert points > 0
    assert scores["unanswered"]["test_q_rows_without_cache"] == (0, points), scores
    assert scores["answered"]["test_q_rows_without_cache"] == (points, points), scores
