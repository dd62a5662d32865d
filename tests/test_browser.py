"""The notebooks in a real JupyterLab, driven by a real browser (Playwright + Debian's Chromium).

For each notebook in tests/notebooks.py READY: start JupyterLab as `make lab` does (from the
repository root, the root on JUPYTER_CONFIG_PATH) on a free localhost port with a token, open
the solution notebook (a copy), run all cells, and check that no cell failed, that every
plotly figure and the widgets rendered, and that moving a slider redraws the widget's plot.
Clicking the first hint button shows the exercise's first rung and counts it in
.decodelab_hints.json beside the notebook. For the first notebook, the nbgrader Validate button
must report success. Screenshots go to
test-artifacts/browser/ (gitignored).

Chromium comes from the system (`apt-get install chromium`; .ci/run installs it in CI), never
from `playwright install`. Outside CI the test skips when it is missing; in CI it fails.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from notebooks import READY, ROOT, SOLUTIONS, kernel_env, read

pytestmark = pytest.mark.slow

ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
VALIDATE_IN_BROWSER = READY[:1]  # the Validate button re-runs a whole notebook: once is proof enough
RUN_TIMEOUT_MS = 600_000

# Lab settings for a test: every cell stays in the page (no windowing), no news or update checks.
USER_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
}

NOTEBOOK_STATE = """() => {
  const app = window.jupyterapp;
  const panel = app && app.shell.currentWidget;
  const kernel = panel && panel.sessionContext && panel.sessionContext.session && panel.sessionContext.session.kernel;
  if (!kernel || !panel.content) return null;
  const cells = panel.content.widgets.filter(c => c.model.type === 'code');
  const errors = [];
  cells.forEach((cell, i) => {
    const outputs = cell.model.outputs;
    for (let j = 0; j < outputs.length; j++) {
      const out = outputs.get(j).toJSON();
      if (out.output_type === 'error') errors.push(`code cell ${i}: ${out.ename}: ${out.evalue}`);
      if (out.output_type === 'stream' && out.name === 'stderr') errors.push(`code cell ${i} wrote to stderr: ${out.text}`);
    }
  });
  let plots = 0, widgets = 0;
  cells.forEach(cell => {
    const outputs = cell.model.outputs;
    for (let j = 0; j < outputs.length; j++) {
      const data = outputs.get(j).toJSON().data || {};
      if ('application/vnd.plotly.v1+json' in data) plots += 1;
      if ('application/vnd.jupyter.widget-view+json' in data) widgets += 1;
    }
  });
  return {status: kernel.status, executed: cells.filter(c => c.model.executionCount !== null).length,
          total: cells.length, errors, plots, widgets};
}"""


def in_ci() -> bool:
    return bool(os.environ.get("CI") or os.environ.get("DECODELAB_CI"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def chromium():
    path = shutil.which("chromium")
    if path is None:
        message = "chromium is not installed (Debian: apt-get install -y chromium); the browser test needs it"
        if in_ci():
            pytest.fail(message + " and must run in CI (.ci/run installs it)")
        pytest.skip(message)
    pytest.importorskip("playwright.sync_api", reason="the browser test needs the python package playwright")
    return path


@pytest.fixture(scope="module")
def lab(chromium, tmp_path_factory):
    """(base url, token, root folder) of a JupyterLab serving copies of the READY solution notebooks."""
    root = tmp_path_factory.mktemp("lab-root")
    for name in READY:
        shutil.copytree(SOLUTIONS / name, root / name, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    home = tmp_path_factory.mktemp("lab-home")
    for relative, values in USER_SETTINGS.items():
        path = home / "user-settings" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = free_port(), secrets.token_hex(16)
    env = kernel_env(
        JUPYTER_CONFIG_PATH=str(ROOT),
        JUPYTER_CONFIG_DIR=str(home / "config"),
        JUPYTERLAB_SETTINGS_DIR=str(home / "user-settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
        JUPYTER_RUNTIME_DIR=str(home / "runtime"),
    )
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log = open(ARTIFACTS / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--LabApp.expose_app_in_browser=True",
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not start; see {ARTIFACTS / 'jupyterlab.log'}")
            time.sleep(0.5)
        yield base, token, root
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def browser(chromium):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        yield instance
        instance.close()


def _run_all(page, name: str) -> dict:
    page.wait_for_function(
        f"() => {{ const s = ({NOTEBOOK_STATE})(); return s && s.status === 'idle'; }}", timeout=120_000
    )
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    page.wait_for_function(
        f"() => {{ const s = ({NOTEBOOK_STATE})(); return s && s.status === 'idle' && "
        f"(s.executed === s.total || s.errors.length > 0); }}",
        timeout=RUN_TIMEOUT_MS,
        polling=1000,
    )
    return page.evaluate(f"({NOTEBOOK_STATE})()")


def _widget_output(page, panel):
    """The output area holding the first slider widget and its FigureWidget (`has` locators
    are relative to the filtered element, hence `page`)."""
    return (
        panel.locator(".jp-OutputArea-output")
        .filter(has=page.locator(".widget-slider"))
        .filter(has=page.locator(".js-plotly-plot"))
        .first
    )


def _click_first_hint(page, panel, name: str, folder: Path) -> None:
    """The first hint button of the notebook reveals rung 1 of its exercise, and the click is counted."""
    import re

    from decodelab.course.hints import COUNTER_FILE, hints_for

    source = "\n".join(cell.source for cell in read(SOLUTIONS / name / f"{name}.ipynb").cells)
    exercise = re.search(rf'hint_button\("{name}", "(ex_\w+)"\)', source).group(1)
    first_rung = re.sub(r"\s+", " ", hints_for(name, exercise)[0].replace("`", "")).strip()
    button = panel.locator(
        f'button[title="hints for {exercise}, one at a time"]'
    ).first  # a locator re-resolves: not by its label
    button.scroll_into_view_if_needed()
    box = button.locator("xpath=ancestor::div[contains(@class, 'widget-vbox')][1]")
    button.click()
    deadline = time.monotonic() + 60
    while first_rung[:60] not in re.sub(r"\s+", " ", box.inner_text()) and time.monotonic() < deadline:
        page.wait_for_timeout(250)
    box.screenshot(path=str(ARTIFACTS / f"{name}-4c-hint.png"))
    shown = re.sub(r"\s+", " ", box.inner_text())
    assert first_rung[:60] in shown, (
        f"{name}: the hint button of {exercise} did not show rung 1; the box says {shown!r}"
    )
    assert "Show hint 2 of" in shown or "No more hints" in shown, f"{name}: the button did not move on: {shown!r}"
    counts = json.loads((folder / COUNTER_FILE).read_text())
    assert counts.get(name, {}).get(exercise) == 1, f"{name}: the click was not counted: {counts}"


@pytest.mark.parametrize("name", READY)
def test_notebook_runs_and_widgets_respond(name, lab, browser):
    base, token, root = lab
    started = time.perf_counter()
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(120_000)  # a busy 2-core machine renders slowly
    try:
        # A workspace of its own (reset): only this notebook is open.
        page.goto(f"{base}/lab/workspaces/{name}/tree/{name}/{name}.ipynb?reset&token={token}")
        panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
        panel.locator(".jp-MarkdownCell .jp-RenderedMarkdown h1").first.wait_for()
        page.screenshot(path=str(ARTIFACTS / f"{name}-0-opened.png"))
        state = _run_all(page, name)
        page.screenshot(path=str(ARTIFACTS / f"{name}-1-after-run.png"))
        assert not state["errors"], f"{name}: cells failed in JupyterLab:\n  " + "\n  ".join(state["errors"])
        assert state["executed"] == state["total"], f"{name}: only {state['executed']} of {state['total']} cells ran"
        assert state["plots"] >= 1 and state["widgets"] >= 1, f"{name}: expected plots and a widget, got {state}"

        # Every plotly figure drew its SVG (the static ones and the widget's FigureWidget).
        plots = panel.locator(".js-plotly-plot")
        plots.last.wait_for(timeout=60_000)
        assert plots.count() >= state["plots"] + 1, (
            f"{name}: {plots.count()} plotly plots on the page, {state['plots']} figures + a FigureWidget expected"
        )
        for i in range(plots.count()):
            plot = plots.nth(i)
            plot.scroll_into_view_if_needed()
            box = plot.locator(".main-svg").first.bounding_box()
            assert box and box["width"] > 200 and box["height"] > 200, f"{name}: plot {i} did not render ({box})"
            plot.screenshot(path=str(ARTIFACTS / f"{name}-2-plot-{i}.png"))

        # Moving the widget's first slider redraws its plot (the title states the new setting).
        widget = _widget_output(page, panel)
        widget.scroll_into_view_if_needed()
        title = widget.locator(".js-plotly-plot .gtitle").first
        before = title.text_content()
        widget.screenshot(path=str(ARTIFACTS / f"{name}-3-widget-before.png"))
        handle = widget.locator(".widget-slider .noUi-handle").first
        handle.focus()
        for _ in range(3):
            page.keyboard.press("ArrowRight")
        deadline = time.monotonic() + 60
        while title.text_content() == before and time.monotonic() < deadline:
            page.wait_for_timeout(250)
        after = title.text_content()
        widget.screenshot(path=str(ARTIFACTS / f"{name}-4-widget-after-slider.png"))
        assert after != before, f"{name}: moving the slider did not redraw the plot (title stayed {before!r})"

        button = widget.locator("button", has_text="sample a reply")
        if button.count():  # the engine, with the notebook's sample hook, writes a reply into the widget
            reply = widget.locator(".widget-html").last
            placeholder = reply.inner_text()
            button.click()
            deadline = time.monotonic() + 180
            while reply.inner_text() == placeholder and time.monotonic() < deadline:
                page.wait_for_timeout(500)
            widget.screenshot(path=str(ARTIFACTS / f"{name}-4b-widget-reply.png"))
            assert reply.inner_text().strip() not in ("", placeholder), f"{name}: no reply appeared"

        _click_first_hint(page, panel, name, root / name)

        if name in VALIDATE_IN_BROWSER:
            panel.locator(".validate-button jp-button, .validate-button button").first.click()
            dialog = page.locator(".jp-Dialog")
            dialog.wait_for(timeout=RUN_TIMEOUT_MS)
            dialog.locator(".validation-success, .validation-failed, pre").first.wait_for(timeout=RUN_TIMEOUT_MS)
            dialog.screenshot(path=str(ARTIFACTS / f"{name}-5-validate.png"))
            text = dialog.inner_text()
            assert "Success! Your notebook passes all the tests." in text, f"{name}: Validate said:\n{text[:3000]}"
    finally:
        page.evaluate(
            "() => window.jupyterapp && window.jupyterapp.shell.currentWidget && "
            "window.jupyterapp.shell.currentWidget.sessionContext.shutdown()"
        )
        page.close()
        print(f"{name}: browser run {time.perf_counter() - started:.1f} s")
