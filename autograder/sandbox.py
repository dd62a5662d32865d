"""The learner's kernel in a sandbox: its own uid, user/network/mount/IPC namespaces, cgroup
limits, a scratch directory holding nothing but the submitted notebook.

    grader (root) --Popen--> python -m autograder.sandbox SPEC -- python -m ipykernel_launcher -f CONN
                             (as root: cgroups, rlimits, mounts; then setuid, new user ns; exec)

The grader talks to the kernel over IPC (unix) sockets in a directory beside the scratch
directory: the kernel's network namespace has only a loopback interface that is down.

What the launcher does, in order, before it execs the kernel:
1. joins a fresh pids, memory and cpu cgroup (v1 or v2) when one can be made (at most one core),
   else falls back to RLIMIT_NPROC (per uid: each slot has its own uid) and RLIMIT_DATA;
2. sets RLIMIT_CPU (CPU seconds for the notebook), RLIMIT_FSIZE (largest file it may write),
   RLIMIT_CORE 0;
3. new mount, network and IPC namespaces; fresh tmpfs on /tmp, /var/tmp and /dev/shm; the
   submissions, the grader's work folder, the feedback folder hidden under empty tmpfs, the CSV
   and gradebook under an empty file of mode 0; folders the kernel needs but cannot traverse (a Python under
   /root) bound back read-only; its own sandbox folder bound back at the same path;
4. drops to the worker's unprivileged uid/gid (no supplementary groups, no new privileges),
   enters a user namespace of its own that maps only that uid, and execs the kernel with a
   clean environment in its scratch directory.

The grader side: `SandboxKernelManager` (a jupyter_client AsyncKernelManager that launches
through this module with the ipc transport, always the grader's own Python kernel) and
`Sandbox` (makes and removes the per-kernel folders and cgroups, kills what is left).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import signal
import stat
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x08000000, 0x10000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
UID_BASE = 61000  # a kernel in slot N (autograder/slots.py, host-wide) runs as uid/gid UID_BASE + N
CGROUP_PARENT = "decodelab-grade"


class SandboxUnavailable(RuntimeError):
    """The machine cannot sandbox kernels (not Linux, not root, no namespaces)."""


@dataclass
class Limits:
    memory_bytes: int = 4 * 2**30
    max_processes: int = 128
    cpu_seconds: int = 3600
    file_bytes: int = 64 * 2**20


@dataclass
class Spec:
    """What the launcher needs; travels as JSON on its command line."""

    uid: int
    scratch: str
    ipc_dir: str
    limits: dict
    hide: list = field(default_factory=list)  # folders/files the kernel must not see
    readable: list = field(default_factory=list)  # folders the kernel must read (Python, cache, repo)
    env: dict = field(default_factory=dict)
    cgroup: str = ""
    discard_stdio: bool = True  # the kernel's own stdout/stderr to /dev/null


# --------------------------------------------------------------------------- checks


def unavailable_reason() -> str | None:
    """Why the sandbox cannot run here, or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"the grading sandbox needs Linux namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return (
            "the grading sandbox needs root (it runs each kernel as its own unprivileged uid, "
            "in its own namespaces and cgroup); run as root, or pass --no-sandbox to grade "
            "without isolation"
        )
    return None


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(libc, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(
        libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        f"mount {source} on {target}",
    )


# --------------------------------------------------------------------------- cgroups


def _cgroup_roots() -> dict[str, Path]:
    """controller -> the folder where we may make child cgroups ("pids", "memory"), v1 or v2."""
    roots: dict[str, Path] = {}
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return roots
    for line in mounts:
        parts = line.split()
        if len(parts) < 4:
            continue
        where, fstype, options = Path(parts[1]), parts[2], parts[3].split(",")
        if fstype == "cgroup":
            for controller in ("pids", "memory", "cpu"):
                if controller in options and os.access(where, os.W_OK):
                    roots.setdefault(controller, where)
        elif fstype == "cgroup2" and os.access(where, os.W_OK):
            try:
                available = (where / "cgroup.controllers").read_text().split()
            except OSError:
                continue
            for controller in ("pids", "memory", "cpu"):
                if controller in available:
                    roots.setdefault(controller, where)
    return roots


def cgroup_paths(name: str) -> dict[str, Path]:
    return {c: root / CGROUP_PARENT / name for c, root in _cgroup_roots().items()}


def _is_v2(path: Path) -> bool:
    return (path.parent / "cgroup.controllers").exists() or (path / "cgroup.controllers").exists()


def join_cgroups(name: str, limits: Limits) -> list[str]:
    """Make and join the kernel's cgroups; returns the controllers that limit it."""
    joined = []
    for controller, path in cgroup_paths(name).items():
        try:
            path.parent.mkdir(exist_ok=True)
            if _is_v2(path):
                try:
                    (path.parent.parent / "cgroup.subtree_control").write_text(f"+{controller}")
                    (path.parent / "cgroup.subtree_control").write_text(f"+{controller}")
                except OSError:
                    pass
            path.mkdir(exist_ok=True)
            if controller == "pids":
                (path / "pids.max").write_text(str(limits.max_processes))
            elif controller == "cpu":  # one core's worth: a spinning kernel cannot starve the others
                if (path / "cpu.cfs_quota_us").exists():
                    (path / "cpu.cfs_period_us").write_text("100000")
                    (path / "cpu.cfs_quota_us").write_text("100000")
                else:
                    (path / "cpu.max").write_text("100000 100000")
            elif (path / "memory.limit_in_bytes").exists():  # v1
                (path / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
                with_swap = path / "memory.memsw.limit_in_bytes"
                if with_swap.exists():
                    try:
                        with_swap.write_text(str(limits.memory_bytes))
                    except OSError:
                        pass
            else:  # v2
                (path / "memory.max").write_text(str(limits.memory_bytes))
                if (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
            (path / "cgroup.procs").write_text(str(os.getpid()))
            joined.append(controller)
        except OSError:
            continue
    return joined


def remove_stale_cgroups() -> None:
    """Empty cgroups left by a grader that was killed (named <student>-<worker pid>)."""
    for root in _cgroup_roots().values():
        parent = root / CGROUP_PARENT
        if not parent.is_dir():
            continue
        for child in parent.iterdir():
            if not child.is_dir():
                continue
            try:
                os.kill(int(child.name.rpartition("-")[2]), 0)
                continue  # its worker still runs: not stale
            except ValueError:
                continue
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            for pid in _alive_in(child):  # what a killed grader's kernel left running
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            for _ in range(50):
                try:
                    child.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)


def cgroup_oom_killed(name: str) -> bool:
    """Did the memory cgroup of this kernel kill something for memory?"""
    path = cgroup_paths(name).get("memory")
    if path is None:
        return False
    for file in ("memory.oom_control", "memory.events"):
        try:
            for line in (path / file).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and int(value) > 0:
                    return True
        except (OSError, ValueError):
            continue
    try:
        return int((path / "memory.failcnt").read_text()) > 0 and not _alive_in(path)
    except (OSError, ValueError):
        return False


def _alive_in(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def kill_uid(uid: int) -> None:
    """End every process of this kernel uid. The uid belongs to one slot, held by one grader
    process on the host (autograder/slots.py): a child that setuid to it and kill(-1) ends every
    process of that uid (the pids cgroup may be missing; forks can escape a process group)."""
    if os.geteuid() != 0:
        return
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(uid)
            os.setuid(uid)
            for _ in range(3):
                os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        os._exit(0)
    os.waitpid(pid, 0)


def kill_all(uid: int, cgroup: str) -> None:
    """Kill everything the kernel left behind: its cgroups' processes and the uid's processes."""
    for path in cgroup_paths(cgroup).values():
        for _ in range(50):
            pids = _alive_in(path)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.02)
    kill_uid(uid)
    for path in cgroup_paths(cgroup).values():
        for _ in range(50):
            try:
                path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.02)


# --------------------------------------------------------------------------- the launcher (runs as root, then drops)


def _traversable_by_others(path: Path) -> bool:
    for folder in [path, *path.parents]:
        try:
            mode = folder.stat().st_mode
        except OSError:
            return False
        if not mode & stat.S_IXOTH:
            return False
    return True


def _first_closed_ancestor(path: Path) -> Path | None:
    """The outermost folder on the way to path that others cannot traverse."""
    for folder in reversed([path, *path.parents]):
        try:
            if not folder.stat().st_mode & stat.S_IXOTH:
                return folder
        except OSError:
            return None
    return None


def _under(path: Path, folders) -> bool:
    return any(path == f or f in path.parents for f in folders)


def _setup_mounts(libc, spec: Spec) -> None:
    sandbox = Path(spec.scratch).parent
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC), "unshare(mount, net, ipc)")
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount leaks back to the host
    # Bind sources opened (in the new namespace) before anything is hidden; /proc/self/fd/N
    # still reaches them afterwards.
    readable = [Path(p) for p in dict.fromkeys(spec.readable) if Path(p).exists()]
    fds = {str(sandbox): os.open(sandbox, os.O_PATH | os.O_DIRECTORY)}
    blank = os.open(sandbox / "blank", os.O_PATH)  # root's, mode 0: what hidden files become
    closed = {}
    for path in readable:
        if not _traversable_by_others(path):
            top = _first_closed_ancestor(path)
            if top is not None:
                closed.setdefault(top, []).append(path)
                fds[str(path)] = os.open(path, os.O_PATH | os.O_DIRECTORY)
    for path in readable:
        fds.setdefault(str(path), os.open(path, os.O_PATH | os.O_DIRECTORY))
    hidden: list[Path] = []
    scratch_fs = "mode=1777,size=256m"
    for tmp in ("/tmp", "/var/tmp", "/dev/shm"):
        if Path(tmp).is_dir() and not Path(tmp).is_symlink():
            _mount(libc, "tmpfs", tmp, "tmpfs", MS_NOSUID | MS_NODEV, scratch_fs)
            hidden.append(Path(tmp))
    # Readable folders the fresh /tmp just covered (a checkout or a venv under /tmp) come back
    # read-only, outermost first; what must stay hidden inside them is hidden next.
    rebound: list[Path] = []
    for path in sorted(readable, key=lambda p: len(p.parts)):
        if _under(path, hidden) and not _under(path, rebound):
            _bind(libc, fds[str(path)], path, readonly=True)
            rebound.append(path)
    for item in spec.hide:
        path = Path(item)
        if not path.exists() or (_under(path, hidden) and not _under(path, rebound)):
            continue
        if path.is_dir():
            _mount(libc, "tmpfs", str(path), "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
            hidden.append(path)
        else:
            _mount(libc, f"/proc/self/fd/{blank}", str(path), None, MS_BIND)
    for top, paths in closed.items():
        if not _under(top, hidden):
            _mount(libc, "tmpfs", str(top), "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
            hidden.append(top)
        for path in paths:
            _bind(libc, fds[str(path)], path, readonly=True)
    # Its own sandbox folder (scratch + ipc), at the same path as the grader sees it.
    _bind(libc, fds[str(sandbox)], sandbox, readonly=False)


def _bind(libc, fd: int, target: Path, readonly: bool) -> None:
    target.mkdir(parents=True, exist_ok=True)
    _mount(libc, f"/proc/self/fd/{fd}", str(target), None, MS_BIND | MS_REC)
    if readonly:
        _mount(libc, None, str(target), None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def launch(spec: Spec, argv: list[str]) -> None:
    """Runs in the launcher process (root): confine it, then exec the kernel."""
    libc = _libc()
    limits = Limits(**spec.limits)
    joined = join_cgroups(spec.cgroup, limits) if spec.cgroup else []
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 5))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    if "pids" not in joined:  # per uid: each slot (autograder/slots.py) has a uid of its own
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
    if "memory" not in joined:
        resource.setrlimit(resource.RLIMIT_DATA, (limits.memory_bytes, limits.memory_bytes))
    _setup_mounts(libc, spec)
    uid = spec.uid
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    _check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(dumpable)")  # to write its own uid_map
    _check(libc.unshare(CLONE_NEWUSER), "unshare(user)")
    Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1\n")
    Path("/proc/self/setgroups").write_text("deny\n")
    Path("/proc/self/gid_map").write_text(f"{uid} {uid} 1\n")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(pdeathsig)")
    os.chdir(spec.scratch)
    os.umask(0o077)
    # The kernel's own stdout/stderr (not the cells': those go over IPC) are not the grader's.
    if spec.discard_stdio:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file past RLIMIT_FSIZE fails to grow (EFBIG)
    os.execve(argv[0], argv, spec.env)


def kernel_env(extra: dict | None = None, kit: Path | None = None) -> dict[str, str]:
    """The kernel's whole environment: nothing of the grader's leaks in but what is listed.
    `kit`: the folder of copied grader modules it imports autograder from (default: the repository)."""
    from decodelab.paths import cache_dir

    env = {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
        "PYTHONPATH": os.pathsep.join([str(kit or ROOT), str(ROOT / "lib")]),
        "HOME": "/tmp",
        "TMPDIR": "/tmp",
        "IPYTHONDIR": "/tmp/.ipython",
        "MPLCONFIGDIR": "/tmp/.matplotlib",
        "JUPYTER_PLATFORM_DIRS": "1",
        "JUPYTER_RUNTIME_DIR": "/tmp/.jupyter",
        "DECODELAB_CACHE": str(cache_dir()),
        "NBGRADER_EXECUTION": "autograde",
        "OMP_WAIT_POLICY": "PASSIVE",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
    }
    for key in ("DECODELAB_FAST",):
        if os.environ.get(key):
            env[key] = os.environ[key]
    env.update(extra or {})
    return env


# --------------------------------------------------------------------------- grader side

# What a kernel imports of autograder/ (the hidden tests and their runner); nothing else of the
# repository (solutions/, the grader, .git) is visible to it.
KERNEL_MODULES = ("__init__.py", "run.py", "checks")


def copy_kernel_modules(kit: Path) -> None:
    """kit/autograder/: KERNEL_MODULES copied from the repository, readable by every uid."""
    package = kit / "autograder"
    if package.exists():
        shutil.rmtree(kit)
    package.mkdir(parents=True)
    for name in KERNEL_MODULES:
        source = ROOT / "autograder" / name
        if source.is_dir():
            shutil.copytree(source, package / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, package / name)
    for folder, dirs, files in os.walk(kit):
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644)


def repository_hidden(readable: list[str]) -> list[str]:
    """Every top-level entry of the repository that holds nothing the kernel reads: all but
    lib/ and a folder that holds a readable path (a virtual environment inside the checkout).
    Links are left alone (a mount on one would land on its target)."""
    keep = {ROOT / "lib"} | {
        ROOT / Path(p).relative_to(ROOT).parts[0] for p in readable if Path(p) != ROOT and ROOT in Path(p).parents
    }
    return sorted(str(p) for p in ROOT.iterdir() if p not in keep and not p.is_symlink())


def share_model_cache() -> list[str]:
    """Make the prepared models readable by the kernels' uids (the converter may leave its
    weights 0600, root's own); returns the files it opened up."""
    from decodelab.paths import cache_dir

    opened = []
    root = cache_dir()
    if not root.is_dir():
        return opened
    for path in [root, *root.rglob("*")]:
        try:
            mode = path.stat().st_mode
            want = mode | (stat.S_IRGRP | stat.S_IROTH) | ((stat.S_IXGRP | stat.S_IXOTH) if path.is_dir() else 0)
            if want != mode and not path.is_symlink():
                os.chmod(path, stat.S_IMODE(want))
                opened.append(str(path))
        except OSError:
            continue
    return opened


class Sandbox:
    """One kernel's folders and limits: <work>/kernels/<name>/{scratch,ipc}."""

    def __init__(self, work: Path, name: str, slot: int, limits: Limits, hide: list[Path], enabled: bool = True):
        self.enabled = enabled
        self.uid = UID_BASE + slot
        self.limits = limits
        self.cgroup = f"{name}-{os.getpid()}"
        self.folder = Path(work) / "kernels" / self.cgroup
        self.scratch, self.ipc_dir = self.folder / "scratch", self.folder / "ipc"
        self.hide = [str(p) for p in hide]

    @property
    def kit(self) -> Path:
        """The grader modules the kernel imports (KERNEL_MODULES), copied here for it alone."""
        return self.folder / "kit"

    def prepare(self, notebook_name: str, notebook_bytes: bytes) -> None:
        if self.enabled:  # what a killed grader that held this slot before may have left running
            kill_uid(self.uid)
        if self.folder.exists():
            shutil.rmtree(self.folder)
        self.folder.mkdir(parents=True)
        os.chmod(self.folder, 0o711)
        for folder in (self.scratch, self.ipc_dir):
            folder.mkdir(mode=0o700)
            os.chmod(folder, 0o700)
            if self.enabled:
                os.chown(folder, self.uid, self.uid)
        blank = self.folder / "blank"
        blank.touch()
        os.chmod(blank, 0)
        target = self.scratch / notebook_name
        target.write_bytes(notebook_bytes)
        if self.enabled:
            os.chown(target, self.uid, self.uid)
        copy_kernel_modules(self.kit)

    def spec(self) -> Spec:
        from decodelab.paths import cache_dir

        readable = [sys.base_prefix, sys.prefix, str(ROOT / "lib"), str(self.kit), str(cache_dir())]
        return Spec(
            uid=self.uid,
            scratch=str(self.scratch),
            ipc_dir=str(self.ipc_dir),
            limits=asdict(self.limits),
            hide=self.hide + repository_hidden(readable),
            readable=readable,
            env=kernel_env(kit=self.kit),
            cgroup=self.cgroup,
        )

    def oom_killed(self) -> bool:
        return self.enabled and cgroup_oom_killed(self.cgroup)

    def cleanup(self) -> None:
        if self.enabled:
            kill_all(self.uid, self.cgroup)
        shutil.rmtree(self.folder, ignore_errors=True)


def kernel_manager_class():
    """SandboxKernelManager, built lazily (jupyter_client is heavy to import)."""
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import Any as AnyTrait

    class SandboxKernelManager(AsyncKernelManager):
        """Always the grader's own Python kernel, over ipc sockets, through the launcher."""

        sandbox = AnyTrait(None)

        def format_kernel_cmd(self, extra_arguments=None):
            kernel = [sys.executable, "-m", "ipykernel_launcher", "-f", self.connection_file, *(extra_arguments or [])]
            box: Sandbox | None = self.sandbox
            if box is None or not box.enabled:
                return kernel
            # The connection file is root's: give it to the kernel's uid (its folder is 0700 anyway).
            os.chown(self.connection_file, box.uid, box.uid)
            return launcher_command(box) + kernel

        async def _async_pre_start_kernel(self, **kw):
            # Unsandboxed (--no-sandbox), the kernel still gets the grader's absolute import paths.
            box: Sandbox | None = self.sandbox
            if box is not None and not box.enabled:
                env = dict(os.environ)
                env.update(
                    {
                        k: v
                        for k, v in kernel_env().items()
                        if k not in ("HOME", "TMPDIR", "IPYTHONDIR", "MPLCONFIGDIR", "JUPYTER_RUNTIME_DIR")
                    }
                )
                kw["env"] = env
            return await super()._async_pre_start_kernel(**kw)

    return SandboxKernelManager


def launcher_command(box: Sandbox, spec: Spec | None = None) -> list[str]:
    """This file run as a script, isolated (-I): stdlib only, no PYTHONPATH, nothing from the cwd."""
    return [sys.executable, "-I", str(Path(__file__).resolve()), json.dumps(asdict(spec or box.spec())), "--"]


def configure_kernel_manager(km, box: Sandbox) -> None:
    km.sandbox = box
    if box.enabled:
        km.transport = "ipc"
        km.ip = str(box.ipc_dir / "kernel")
    km.connection_file = str(box.ipc_dir / "kernel.json")


def preflight(work: Path, limits: Limits, hide: list[Path], slot: int | None = None) -> None:
    """Start one sandboxed Python that checks its own confinement; raise SandboxUnavailable if
    the machine cannot do it. `slot`: one this process holds; None takes one for the check."""
    import subprocess

    from autograder import slots
    from decodelab.paths import cache_dir

    if slot is None and unavailable_reason() is None:
        held = slots.acquire()
        try:
            return preflight(work, limits, hide, held.number)
        finally:
            held.release()

    reason = unavailable_reason()
    if reason:
        raise SandboxUnavailable(reason)
    share_model_cache()
    remove_stale_cgroups()
    box = Sandbox(work, "preflight", slot or 0, limits, hide)
    box.prepare("probe.ipynb", b"{}")
    probe = (
        "import os, socket, sys\n"
        "assert os.getuid() != 0, 'still root'\n"
        "try:\n    socket.create_connection(('127.0.0.1', 9), timeout=1); sys.exit('network reachable')\n"
        "except OSError: pass\n"
        "assert sorted(os.listdir('.')) == ['probe.ipynb'], os.listdir('.')\n"
        "import importlib.util, pathlib, autograder.run\n"
        "assert importlib.util.find_spec('torch') and importlib.util.find_spec('decodelab'), 'no torch/decodelab'\n"
        f"for f in pathlib.Path({str(cache_dir())!r}).rglob('*.safetensors'):\n"
        "    f.open('rb').read(8)  # the prepared model is readable\n"
        f"assert not list(pathlib.Path({str(ROOT / 'solutions')!r}).glob('*/*.ipynb')), 'solutions/ readable'\n"
        "print('sandbox ok')\n"
    )
    spec = box.spec()
    spec.discard_stdio = False
    cmd = launcher_command(box, spec) + [sys.executable, "-c", probe]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    finally:
        box.cleanup()
    if result.returncode != 0 or "sandbox ok" not in result.stdout:
        raise SandboxUnavailable(
            "the kernel sandbox does not work on this machine (user/network/mount "
            "namespaces or setuid refused): "
            + (result.stderr.strip()[-800:] or result.stdout[-800:])
            + "\npass --no-sandbox to grade without isolation"
        )


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m autograder.sandbox SPEC_JSON -- COMMAND...")
    try:
        launch(Spec(**json.loads(argv[0])), argv[2:])
    except Exception as exc:  # noqa: BLE001 - the grader reads this on the kernel's stderr
        print(f"autograder.sandbox: cannot start the kernel: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(70)


if __name__ == "__main__":
    main(sys.argv[1:])
