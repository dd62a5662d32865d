"""Speed credit on the learner's own machine (decodelab.course.speed_credit, `progress --bench`,
autograder/checks/speed.py): the solutions time like the library, a planted slow part shows, the
roofline fractions are fractions, and the speed check credits only the reference's work."""

from __future__ import annotations

import json
import math
import shutil
import textwrap

import nbformat
import pytest
import torch
from notebooks import SOLUTIONS, grade_id, read

from autograder.checks import speed
from decodelab import cli
from decodelab.course import progress, speed_credit, speed_parts
from decodelab.course.exercises import EXERCISES

BENCHED = sorted({part.notebook for part in speed_parts.PARTS})

# A paged attention a learner might write first: right answers, one Python iteration per sequence
# and head, each gathering its KV head's blocks again.
LOOP_OVER_HEADS = textwrap.dedent("""
    def paged_decode_attention(q, key_cache, value_cache, block_tables, context_lens):
        batch, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        for b in range(batch):
            n = int(context_lens[b])
            blocks = torch.as_tensor(list(block_tables[b]), dtype=torch.long)
            for h in range(num_heads):
                keys = key_cache[blocks, :, h // group].reshape(-1, head_dim)[:n]
                values = value_cache[blocks, :, h // group].reshape(-1, head_dim)[:n]
                weights = torch.softmax(keys.float() @ q[b, h].float() / math.sqrt(head_dim), dim=0)
                out[b, h] = (weights @ values.float()).to(q.dtype)
        return out
""")


def copy_solutions(dest, notebooks, replace: dict[str, str] | None = None):
    """dest/NN/NN.ipynb for each notebook, from solutions/, with the cells in `replace` (grade id ->
    source) rewritten."""
    for name in notebooks:
        shutil.copytree(SOLUTIONS / name, dest / name, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        path = dest / name / f"{name}.ipynb"
        nb = read(path)
        for cell in nb.cells:
            if grade_id(cell) in (replace or {}):
                cell.source = replace[grade_id(cell)]
        nbformat.write(nb, str(path))


def passing_rows(notebooks) -> list[progress.Row]:
    return [progress.Row(e.notebook, e.name, e.part, progress.PASSING) for e in EXERCISES if e.notebook in notebooks]


@pytest.mark.slow
def test_the_solutions_time_like_the_library_and_sit_under_the_roofline(tmp_path):
    copy_solutions(tmp_path, BENCHED)
    lines = []
    report = speed_credit.bench_course(
        tmp_path, passing_rows(BENCHED), size="small", rounds=2, pairs=30, on_progress=lines.append
    )
    assert len(lines) == 2 * len(speed_parts.PARTS) and lines[-1].startswith("round 2/2 · scheduler step: 60 pairs")
    assert 1e8 < report.bandwidth < 1e14, report.bandwidth
    for result in report.results:
        assert result.status == "timed", (result.part, result.status)
        assert len(result.learner_s) == len(result.reference_s) == 60
        assert 0.8 <= result.ratio.median <= 1.25, (result.part, result.ratio)
        fraction = result.roofline_fraction(report.bandwidth)
        if result.part == "scheduler step":
            assert fraction is None and result.bytes_moved is None  # no tensors: no roofline
        else:
            assert 0 < fraction <= 1.5, (result.part, fraction)
    table = speed_credit.format_report(report)
    assert "paged attention" in table and "roofline" in table and f"{report.bandwidth / 1e9:.1f} GB/s" in table


@pytest.mark.slow
def test_a_planted_slow_part_shows_and_the_missing_ones_say_why(tmp_path):
    copy_solutions(tmp_path, ["07_paged_kv"], {"ex_paged_decode_attention": LOOP_OVER_HEADS})
    rows = passing_rows(["07_paged_kv"])
    report = speed_credit.bench_course(tmp_path, rows, size="small", rounds=2, pairs=12)
    by_part = {r.part: r for r in report.results}
    slow = by_part.pop("paged attention")
    assert slow.status == "timed" and slow.ratio.median > 1.5, slow.ratio
    assert {r.status for r in by_part.values()} == {
        "not timed: no 01_forward_pass notebook checked",
        "not timed: no 06_quantization notebook checked",
        "not timed: no 08_continuous_batching notebook checked",
    }
    assert "not timed: no 01_forward_pass notebook checked" in speed_credit.format_report(report)


@pytest.mark.slow
def test_progress_bench_on_the_command_line_times_only_what_passes(tmp_path, capsys):
    wrong = "def paged_decode_attention(q, key_cache, value_cache, block_tables, context_lens):\n    return q * 0\n"
    copy_solutions(tmp_path, ["07_paged_kv"], {"ex_paged_decode_attention": wrong})
    assert cli.main(["progress", "--course", str(tmp_path), "--bench", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    [attention] = [p for p in found["bench"]["parts"] if p["part"] == "paged attention"]
    assert attention["status"].startswith("not timed: paged_decode_attention: failing:"), attention
    assert attention["ratio"] is None and attention["roofline_fraction"] is None
    assert found["bench"]["bandwidth_bytes_per_s"] is None  # nothing to time: nothing measured
    assert {"exercises", "bench"} <= set(found)


def test_a_part_whose_exercise_fails_or_is_missing_is_not_timed():
    part = speed_parts.part_named("int8 linear")
    rows = passing_rows(["06_quantization"])
    assert speed_credit.why_not_timed(part, {(r.notebook, r.exercise): r.status for r in rows}) is None
    statuses = {(r.notebook, r.exercise): r.status for r in rows}
    statuses[("06_quantization", "quantize_int8_per_channel")] = "not started"
    assert speed_credit.why_not_timed(part, statuses) == "not timed: quantize_int8_per_channel: not started"
    assert speed_credit.why_not_timed(part, {}) == "not timed: no 06_quantization notebook checked"
    with pytest.raises(ValueError, match="no timed part 'attention'"):
        speed_parts.part_named("attention")


def test_the_spread_of_a_sample():
    spread = speed_credit.Spread.of([1.0, 2.0, 3.0, 4.0, 100.0])
    assert (spread.median, spread.low, spread.high) == (3.0, 1.0, 100.0)
    assert spread.q1 == 2.0 and spread.q3 == 4.0  # quartiles: one wild pair moves them not at all
    assert speed_credit.ratios([2.0, 3.0], [1.0, 3.0]) == [2.0, 1.0]
    with pytest.raises(ValueError, match="no values"):
        speed_credit.Spread.of([])


def test_paired_times_alternate_the_order():
    calls = []
    first = speed_parts.function_workload(lambda: calls.append("learner"), ())
    second = speed_parts.function_workload(lambda: calls.append("reference"), ())
    learner_s, reference_s = speed_credit.paired_times(first, second, pairs=4)
    assert len(learner_s) == len(reference_s) == 4 and min(learner_s + reference_s) >= 0
    assert calls == ["learner", "reference"] + ["learner", "reference", "reference", "learner"] * 2


def test_every_timed_part_reads_its_reference_from_the_table_and_counts_its_bytes():
    from decodelab.course.exercises import find

    for part in speed_parts.PARTS:
        reference = speed_parts.reference_namespace(part)
        assert set(reference) - {"__name__"} == set(part.exercises)
        assert all(find(part.notebook, name) for name in part.exercises)
    workload = speed_parts.paged_attention_workload(
        speed_parts.reference_namespace(speed_parts.part_named("paged attention"))["paged_decode_attention"], "small", 0
    )
    shapes = speed_parts.PAGED_SHAPES["small"]
    least_kv = 2 * shapes["batch"] * (3 * shapes["context"] // 4) * shapes["kv_heads"] * shapes["head_dim"] * 4
    most_kv = least_kv * 4 // 3
    q_and_out = 2 * shapes["batch"] * shapes["heads"] * shapes["head_dim"] * 4
    assert least_kv + q_and_out <= workload.bytes_moved <= most_kv + q_and_out


def _paged_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(12, 4, 2, 8, generator=g), torch.randn(12, 4, 2, 8, generator=g)
    q = torch.randn(3, 4, 8, generator=g)
    return q, keys, values, [[0, 5, 7], [2, 3], [11]], [10, 6, 3]


def test_the_speed_check_passes_the_reference():
    from decodelab.lessons.paged_kv import paged_decode_attention

    assert speed.check_speed_ratio(paged_decode_attention, paged_decode_attention, _paged_inputs, max_ratio=1.5) <= 1.5
    speed.check_paged_attention_speed(paged_decode_attention)


def test_the_speed_check_fails_a_fast_but_wrong_part():
    from decodelab.lessons.paged_kv import paged_decode_attention

    def fast_but_wrong(q, key_cache, value_cache, block_tables, context_lens):
        return torch.zeros_like(q)  # the right shape at once, none of the work

    with pytest.raises(
        AssertionError,
        match=r"fast_but_wrong: the output differs from the reference's by up to "
        r"[0-9.]+ \(allowed 0.0001\) on fresh inputs \(seed \d+\): speed is "
        r"credited only for the reference's work",
    ):
        speed.check_speed_ratio(fast_but_wrong, paged_decode_attention, _paged_inputs)
    with pytest.raises(AssertionError, match="paged attention: the output differs"):
        speed.check_paged_attention_speed(fast_but_wrong)
    with pytest.raises(ValueError, match="max_ratio must be > 0"):
        speed.check_speed_ratio(paged_decode_attention, paged_decode_attention, _paged_inputs, max_ratio=0)


def test_the_speed_check_fails_a_slow_part_with_its_ratio():
    namespace = {"torch": torch, "math": math}
    exec(LOOP_OVER_HEADS, namespace)
    with pytest.raises(
        AssertionError,
        match=r"paged attention: yours took [0-9.]+x the library's time on this machine "
        r"\(median of 5 pairs in alternating order, quartiles .*\); speed credit "
        r"needs at most 1.1x",
    ):
        speed.check_part_speed("paged attention", namespace["paged_decode_attention"], max_ratio=1.1, pairs=5)


@pytest.mark.parametrize(
    "check, part",
    [
        (speed.check_int8_linear_speed, "int8 linear"),
        (speed.check_decode_step_speed, "decode step"),
        (speed.check_scheduler_step_speed, "scheduler step"),
    ],
)
def test_each_parts_check_credits_the_library_itself(check, part):
    """What a hidden cell would pass for the part (the library's own code, built as the learner's
    would be) earns the credit: the same work, and within the ratio of itself."""
    from decodelab.course.speed_parts import part_named, reference_namespace

    timed = part_named(part)
    check(timed.build(reference_namespace(timed)))
