"""A hosted class, end to end: a real JupyterHub on 127.0.0.1, a student in Chromium (issue 32, item 3).

The hub runs hub/jupyterhub_config.py, the file the README tells an instructor to run, with only
what a test must change put over it: free ports, a dummy authenticator with a password instead of
PAM, two allowed users, and the exchange of a temporary class. Its proxy is configurable-http-proxy
from npm (`make setup` puts it in .venv/bin); its spawner starts each user's JupyterLab as that
user (LocalProcessSpawner), from this repository's venv.

The class is tests/test_exchange.py's: two OS users made with `useradd` (uids from 60100, homes in a
temporary folder), the exchange world-writable and sticky, its root and the course id in a site
nbgrader_config.py that every user's server reads. The instructor (root) releases 00_meet_the_model
with `nbgrader release_assignment`; then, in headless Chromium (Debian's, through Playwright):

1. the student logs in at /hub/login, lands in their own JupyterLab, opens nbgrader's assignment
   list, clicks Fetch, then Submit; the submission must land in the exchange's inbound folder,
   owned by the student's uid and named by their user name;
2. the student has no formgrader (its URL is a 404, its lab has no formgrader command), the
   instructor (group `instructors`) has both.

The users are removed afterwards (userdel --remove), on failure too. Under `make test`'s xdist
workers another test file runs beside this one: the ports are free ones (tried again if taken
meanwhile), the names, uids and folders are this run's own, only this run's processes are ended,
and every wait is sized for a loaded machine. Needs root, `useradd` and
Chromium: skipped where one is missing, except in CI (CI or DECODELAB_CI set), where it fails.
JupyterHub and configurable-http-proxy come with `make setup`: without them it fails.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from notebooks import ROOT
from test_exchange import NAME, Course, in_ci

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ARTIFACTS = ROOT / "test-artifacts" / "hub"
HUB_CONFIG = ROOT / "hub" / "jupyterhub_config.py"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
# Generous: under `pytest -n 2` another test file (a notebook, the grader) runs beside this one on
# the same cores, and the machine may be shared besides.
START_TIMEOUT = 180  # the hub and its proxy
START_TRIES = 3  # a free port found here may be taken by a neighbour before the hub binds it
SPAWN_TIMEOUT_S = 300  # a user's JupyterLab, started by the hub (the test's Spawner.start_timeout)
SPAWN_TIMEOUT_MS = (SPAWN_TIMEOUT_S + 30) * 1000  # the browser waits out the hub's own timeout
STEP_TIMEOUT_MS = 120_000  # one click's work in the lab (nbgrader's fetch or submit), a page load


# This Python may live where the class's users cannot reach it (a pyenv under /root, mode 0700):
# LocalProcessSpawner's own setuid then cannot exec it. As the exchange test does for its students,
# tests/as_user.py binds this Python's folders back read-only in a mount namespace, then drops to
# the user; the spawner is LocalProcessSpawner with that drop instead of its own. The repository's
# hub/ (each role's server and lab settings) is bound back too: a CI clone under /root is closed to
# the users, and a student's server that cannot read hub/student/ would have formgrader.
SPAWN_AS_USER = """
import pwd
import sys
from jupyterhub.spawner import LocalProcessSpawner


class AsUserSpawner(LocalProcessSpawner):
    def make_preexec_fn(self, name):
        return None  # tests/as_user.py drops to the user (uid, gid, no other groups)


readme_hook = c.Spawner.pre_spawn_hook


def pre_spawn_hook(spawner):
    readme_hook(spawner)
    spawner.cmd = [sys.executable, {as_user!r}, spawner.user.name, "--reach", {hub!r}, "--", *spawner.cmd]
    spawner.popen_kwargs = dict(cwd=pwd.getpwnam(spawner.user.name).pw_dir)  # the spawner's own chdir


c.JupyterHub.spawner_class = AsUserSpawner
c.Spawner.pre_spawn_hook = pre_spawn_hook
"""


def _requirements() -> str | None:
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "the hub test creates OS users (useradd) for its spawner: it needs root on Linux"
    missing = [tool for tool in ("useradd", "userdel") if shutil.which(tool) is None]
    if missing:
        return f"the hub test needs {' and '.join(missing)} (Debian: the passwd package)"
    return None


def _free_ports(count: int) -> list[int]:
    import socket

    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _proxy() -> str:
    found = shutil.which(
        "configurable-http-proxy", path=os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin"])
    )
    if found is None:
        pytest.fail("configurable-http-proxy is missing: `make setup` installs it from npm into .venv/bin")
    return found


def _processes_of(uid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


class Hub:
    """The running hub: its base URL, the password, the log."""

    def __init__(self, course: Course, student: str, instructor: str, attempt: int):
        self.course = course
        self.folder = course.top / f"hub-{attempt}"
        self.folder.mkdir(mode=0o700)
        self.password = secrets.token_hex(12)
        self.token = secrets.token_hex(16)  # a service's, allowed to start servers (the instructor's, early)
        port, hub_port, self.api_port = _free_ports(3)
        self.base = f"http://127.0.0.1:{port}"
        config = self.folder / "jupyterhub_config.py"
        config.write_text(
            "c = get_config()  # noqa: F821\n"
            f"load_subconfig({str(HUB_CONFIG)!r})  # noqa: F821 - the README's config, then the test's changes\n"
            "c.JupyterHub.authenticator_class = 'dummy'\n"
            f"c.DummyAuthenticator.password = {self.password!r}\n"
            "c.Authenticator.allow_all = False\n"
            f"c.Authenticator.allowed_users = {{{student!r}, {instructor!r}}}\n"
            f"c.JupyterHub.load_groups = {{'instructors': {{'users': [{instructor!r}]}}}}\n"
            f"c.JupyterHub.bind_url = {self.base!r}\n"
            "c.JupyterHub.hub_ip = '127.0.0.1'\n"
            f"c.JupyterHub.hub_port = {hub_port}\n"
            f"c.ConfigurableHTTPProxy.api_url = 'http://127.0.0.1:{self.api_port}'\n"
            f"c.ConfigurableHTTPProxy.command = [{_proxy()!r}]\n"
            f"c.ConfigurableHTTPProxy.pid_file = {str(self.folder / 'proxy.pid')!r}\n"
            f"c.JupyterHub.db_url = 'sqlite:///{self.folder / 'jupyterhub.sqlite'}'\n"
            f"c.JupyterHub.cookie_secret_file = {str(self.folder / 'cookie_secret')!r}\n"
            # the class's exchange and course id (a real class: /etc/jupyter/nbgrader_config.py)
            f"c.Spawner.environment['JUPYTER_CONFIG_PATH'] = {str(course.site)!r}\n"
            "c.Spawner.args = ['--LabApp.expose_app_in_browser=True']\n"
            f"c.Spawner.start_timeout = c.Spawner.http_timeout = {SPAWN_TIMEOUT_S}\n"
            f"c.JupyterHub.services = [{{'name': 'test', 'api_token': {self.token!r}}}]\n"
            "c.JupyterHub.load_roles = [{'name': 'test-starts-servers', 'scopes': ['servers'], 'services': ['test']}]\n"
            # the role folders are the repository's, which the users may not reach (a clone under /root)
            + SPAWN_AS_USER.format(as_user=str(ROOT / "tests" / "as_user.py"), hub=str(HUB_CONFIG.parent))
        )
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.log_path = ARTIFACTS / f"jupyterhub-{attempt}.log"
        self.log = open(self.log_path, "w")
        env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
        env.pop("PYTHONPATH", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", str(config)],
            cwd=self.folder,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_up(self) -> bool:
        """True once the hub answers; False if it exited because a port was taken meanwhile."""
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                with urllib.request.urlopen(f"{self.base}/hub/api", timeout=5) as response:
                    if response.status == 200:
                        return True
            except OSError:
                pass
            exited = self.process.poll() is not None
            if exited or time.monotonic() > deadline:
                log = self.log_path.read_text()
                if exited and "Address already in use" in log:
                    return False
                raise AssertionError(f"JupyterHub did not start in {START_TIMEOUT} s; its log:\n{log[-5000:]}")
            time.sleep(0.3)

    def start_server(self, user: str) -> None:
        """Ask the hub to start user's server now (it answers at once and starts it meanwhile)."""
        request = urllib.request.Request(
            f"{self.base}/hub/api/users/{user}/server", method="POST", headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=STEP_TIMEOUT_MS / 1000) as response:
            assert response.status in (201, 202), response.status

    def stop(self) -> None:
        """SIGTERM: the hub stops the users' servers and its proxy, then exits."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        proxy_pid = self.folder / "proxy.pid"  # the hub stops its proxy; a hub killed leaves it running
        try:
            pid = int(proxy_pid.read_text().strip())
            # only if that pid is still this hub's proxy, never a neighbour's process that reused it
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if args[args.index(b"--api-port") + 1] == str(self.api_port).encode():
                os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError, IndexError):
            pass
        self.log.close()


@pytest.fixture(scope="module")
def hub_class():
    """(course, hub, student's name, instructor's name): a class released, the hub up."""
    reason = _requirements()
    if reason:
        if in_ci():
            pytest.fail(reason + " and must run in CI")
        pytest.skip(reason)
    if shutil.which("chromium") is None:
        message = "chromium is not installed (Debian: apt-get install -y chromium); the hub test needs it"
        if in_ci():
            pytest.fail(message + " and must run in CI (.ci/run installs it)")
        pytest.skip(message)
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        pytest.fail("the hub test needs jupyterhub: `make setup` installs it (pyproject.toml's hub extra)")
    from autograder.release import generate

    top = Path(tempfile.mkdtemp(prefix="decodelab-hub-"))
    course = Course(top)
    hub = None
    try:
        course.build()
        student, instructor = course.add_student("student"), course.add_student("instructor")
        generate([NAME], out=course.course / "course")  # what `make release` writes
        course.instructor("release_assignment", NAME)
        for attempt in range(1, START_TRIES + 1):
            hub = Hub(course, student, instructor, attempt)
            if hub.wait_up():
                break
            hub.stop()
        else:
            pytest.fail(f"JupyterHub found its ports taken {START_TRIES} times; last log: {hub.log_path}")
        hub.start_server(instructor)  # while the student works: the formgrader test logs in to it
        yield course, hub, student, instructor
    finally:
        if hub is not None:
            hub.stop()
        for name in course.students.values():  # anything the hub left running as a user
            for pid in _processes_of(pwd.getpwnam(name).pw_uid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        problems = course.remove_students()
        shutil.rmtree(top, ignore_errors=True)
        assert not problems, problems


@pytest.fixture(scope="module")
def browser(hub_class):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(
            executable_path=shutil.which("chromium"), args=CHROMIUM_ARGS, headless=True, timeout=STEP_TIMEOUT_MS
        )
        yield instance
        instance.close()


def _log_in(browser, hub: Hub, user: str):
    """A fresh browser context logged in as user, on their JupyterLab -> the page."""
    context = browser.new_context()
    context.set_default_timeout(STEP_TIMEOUT_MS)  # every page load, click and wait below unless told
    page = context.new_page()
    page.goto(f"{hub.base}/hub/login")
    page.fill("#username_input", user)
    page.fill("#password_input", hub.password)
    page.click("#login_submit")
    page.wait_for_url(f"**/user/{user}/lab**", timeout=SPAWN_TIMEOUT_MS)
    page.wait_for_function(
        "() => window.jupyterapp && window.jupyterapp.commands.hasCommand('nbgrader:open-assignment-list')",
        timeout=SPAWN_TIMEOUT_MS,
    )
    return page


def test_student_fetches_and_submits_from_the_assignment_list(hub_class, browser):
    course, hub, student, instructor = hub_class
    started = time.perf_counter()
    page = _log_in(browser, hub, student)
    try:
        page.evaluate("() => window.jupyterapp.commands.execute('nbgrader:open-assignment-list')")
        fetch = page.locator("#released_assignments_list .list_item", has_text=NAME).locator("button", has_text="Fetch")
        fetch.click()
        submit = page.locator("#fetched_assignments_list .list_item", has_text=NAME).locator(
            "button", has_text="Submit"
        )
        submit.click()
        page.locator("#submitted_assignments_list .list_item", has_text=NAME).first.wait_for()
        page.screenshot(path=str(ARTIFACTS / "assignment_list.png"))
    except Exception:
        page.screenshot(path=str(ARTIFACTS / "assignment_list_failed.png"))
        raise
    print(f"hub: log in, fetch and submit in {time.perf_counter() - started:.0f} s")

    user = pwd.getpwnam(student)
    fetched = course.home("student") / NAME / f"{NAME}.ipynb"
    assert fetched.stat().st_uid == user.pw_uid, "the fetch ran as someone else than the student"
    inbound = course.exchange / course.course_id / "inbound"
    submissions = [p for p in inbound.iterdir() if p.name.startswith(f"{student}+{NAME}+")]
    assert len(submissions) == 1, sorted(p.name for p in inbound.iterdir())
    submitted = submissions[0]
    assert submitted.stat().st_uid == user.pw_uid
    assert (submitted / f"{NAME}.ipynb").read_bytes() == fetched.read_bytes()
    assert (submitted / "timestamp.txt").exists()


def test_formgrader_is_the_instructors_only(hub_class, browser):
    _, hub, student, instructor = hub_class
    for user, expected in ((student, 404), (instructor, 200)):
        page = _log_in(browser, hub, user)
        response = page.request.get(f"{hub.base}/user/{user}/formgrader", timeout=STEP_TIMEOUT_MS)
        assert response.status == expected, (user, response.status)
        # the lab side too: hub/student/labconfig/page_config.json disables the formgrader plugin
        in_lab = page.evaluate("() => window.jupyterapp.commands.hasCommand('nbgrader:open-formgrader')")
        assert in_lab == (expected == 200), (user, in_lab)
        page.context.close()
