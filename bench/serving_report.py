"""The figures of bench/serving_load.py: each request's outcome, a rate's summary (TTFT and TPOT p50/p99,
throughput, goodput under the SLO), the printed table, and the comparison's plot."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from decodelab.lessons.serving import percentile_or_none as percentile


@dataclass
class PlannedRequest:
    send_at: float  # seconds after the start
    prompt: str
    max_tokens: int


@dataclass
class Outcome:
    ok: bool
    ttft: float | None = None
    latency: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    counted_from_usage: bool = False  # else from the streamed chunks that carried text
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def summarize(
    rate: float,
    outcomes: list[Outcome],
    duration: float,
    ttft_slo: float,
    tpot_slo: float,
    requests: list[PlannedRequest] | None = None,
) -> dict:
    done = [o for o in outcomes if o.ok]
    ttfts, tpots = [o.ttft for o in done], [o.tpot for o in done if o.tpot is not None]
    good = [o for o in done if o.ttft <= ttft_slo and (o.tpot is None or o.tpot <= tpot_slo)]
    output_tokens = sum(o.output_tokens for o in done)
    errors = sorted({o.error for o in outcomes if o.error})
    row = {
        "rate_req_s": rate,
        "requests": len(outcomes),
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "errors": errors[:3],
        "duration_s": round(duration, 2),
        "prompt_tokens": sum(o.prompt_tokens for o in done),
        "output_tokens": output_tokens,
        "throughput_tok_s": round(output_tokens / duration, 1),
        "request_throughput_req_s": round(len(done) / duration, 3),
        "goodput_req_s": round(len(good) / duration, 3),
        "slo_attainment": round(len(good) / len(outcomes), 3),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p99_s": percentile(tpots, 99),
        "latency_p50_s": percentile([o.latency for o in done], 50),
        "latency_p99_s": percentile([o.latency for o in done], 99),
    }
    if requests is not None:  # did every request get exactly its max_tokens (no EOS stop, no cut)?
        row["output_tokens_asked"] = sum(r.max_tokens for r in requests)
        row["requests_not_given_max_tokens"] = sum(
            1 for r, o in zip(requests, outcomes) if o.ok and o.output_tokens != r.max_tokens
        )
        row["output_tokens_counted_from"] = sorted(
            {"usage" if o.counted_from_usage else "streamed chunks with text" for o in done}
        )
    return row


def print_table(rows: list[dict], label: str = "") -> None:
    def ms(value):
        return "-" if value is None else f"{value * 1000:7.0f}"

    print(
        f"{label}{'rate':>6} {'done':>5} {'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} {'p99':>7} {'tok/s':>7} "
        f"{'goodput':>8} {'in SLO':>7}   (ms; goodput in req/s)"
    )
    for r in rows:
        print(
            f"{' ' * len(label)}{r['rate_req_s']:6g} {r['completed']:5d} {ms(r['ttft_p50_s']):>9} "
            f"{ms(r['ttft_p99_s']):>7} {ms(r['tpot_p50_s']):>9} {ms(r['tpot_p99_s']):>7} "
            f"{r['throughput_tok_s']:7.1f} {r['goodput_req_s']:8.2f} {r['slo_attainment']:7.0%}"
        )


def plot(result: dict, out: Path) -> Path | None:
    """Goodput, TTFT p99 and TPOT p99 against the offered rate, both servers -> the PNG (None: no matplotlib)."""
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (`make bench-deps` installs it)")
        return None
    rows, slo = result["rates"], result["slo"]
    rates = [row["rate_req_s"] for row in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
    panels = [
        ("goodput_req_s", "goodput (req/s within the SLO)", None),
        ("ttft_p99_s", "TTFT p99 (s)", slo["ttft_s"]),
        ("tpot_p99_s", "TPOT p99 (s)", slo["tpot_s"]),
    ]
    for ax, (key, title, limit) in zip(axes, panels):
        for name in result["servers"]:
            ax.plot(rates, [row[name][key] for row in rows], marker="o", label=name)
        if limit is None:
            ax.plot(rates, rates, linestyle=":", color="grey", label="offered rate")
        else:
            ax.axhline(limit, linestyle="--", color="grey", label="SLO")
            ax.set_yscale("log")
            for axis_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
                axis_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
        ax.set_xscale("log")
        ax.set_xticks(rates, [f"{rate:g}" for rate in rates])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("offered rate (req/s, Poisson)")
        ax.set_title(title)
        ax.legend()
    llama = result["servers"]["llama.cpp"]
    fig.suptitle(
        f"{result['model']}: decodelab serve vs llama.cpp ({llama['kind']}), {llama['slots']} slot(s) each, "
        f"{result['requests']} requests a rate, {result['cpus']} CPUs"
    )
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
