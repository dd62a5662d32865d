"""nbgrader's Execute for the class grader: a sandboxed kernel, bookkeeping from the kernel's
execute replies, a time limit per cell and per notebook, a cap on each cell's output.

Imported by `autograder.submission` when a submission runs (nbgrader and nbclient load only then).
What it records for the grader, after `preprocess`:

* ``replies``: cell index -> the execute reply's status ("ok" / "error"): what scoring trusts;
* ``timed_out``: cells interrupted at their time limit; ``not_run``: cells skipped, and why;
* ``stopped``: "crashed" or "timeout" once the kernel is gone (later cells are not run);
* ``events``: what happened, in words, for the notes column;
* ``truncated``: cells whose output was cut at ``settings.output_limit`` bytes.

Before each test cell it drops the kernel's imported test helpers (`RESET_HELPERS`), so that an
answer cell cannot patch them.
"""

from __future__ import annotations

import asyncio
import json
import signal
from time import monotonic

from jupyter_core.utils import ensure_async, run_sync
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbformat import NotebookNode
from nbgrader.preprocessors import Execute

from autograder import sandbox
from autograder.cells import is_test_cell, meta

# Dropped from the kernel before each test cell, so that the test imports them afresh.
RESET_HELPERS = (
    "import sys as _grader_sys\n"
    "for _grader_m in [m for m in _grader_sys.modules if m == 'autograder' or m.startswith('autograder.')"
    " or m == 'decodelab.course.checking']:\n"
    "    del _grader_sys.modules[_grader_m]\n"
    "del _grader_sys\n"
)


class SandboxedExecute(Execute):
    """nbgrader's Execute with a sandboxed kernel, reply-based bookkeeping, time and output caps.
    Call `setup(box, settings)` once before `preprocess`."""

    # ------------------------------------------------------------------ set-up and kernel

    def setup(self, box, settings) -> None:
        """box: the submission's `sandbox.Sandbox`; settings: the grader's `Settings`."""
        self.box, self.settings = box, settings
        self.timeout = int(settings.cell_timeout)
        self.startup_timeout = 120
        self.iopub_timeout = 10  # after an interrupt, the grace before the kernel is stopped
        self.replies: dict[int, str] = {}  # cell index -> execute reply status
        self.timed_out: set[int] = set()
        self.not_run: dict[int, str] = {}  # cell index -> why
        self.stopped: str | None = None  # "crashed" / "timeout" once the kernel is gone
        self.events: list[str] = []
        self.truncated: set[int] = set()
        self.deadline = monotonic() + settings.notebook_timeout
        self._current = -1

    def preprocess(self, nb, resources=None, km=None):
        self._bytes: dict[int, int] = {}
        return super().preprocess(nb, resources, km)

    def create_kernel_manager(self):
        self.km = sandbox.kernel_manager_class()(kernel_name="python3", config=self.config)
        sandbox.configure_kernel_manager(self.km, self.box)
        return self.km

    async def _stop_kernel(self) -> None:
        try:
            await ensure_async(self.km.shutdown_kernel(now=True))
        except Exception:  # noqa: BLE001 - it may be gone already
            pass

    def _exit_reason(self) -> str:
        """Why the kernel died, in words: the sandbox's memory limit, a signal, an exit code."""
        process = getattr(getattr(self.km, "provisioner", None), "process", None)
        code = process.poll() if process is not None else None
        if self.box.oom_killed():
            gib = self.box.limits.memory_bytes / 2**30
            return f"killed for memory (over {gib:.1f} GiB)"
        if code is None:
            return "stopped responding"
        if code < 0:
            name = signal.Signals(-code).name
            return "killed at its CPU-time limit" if name == "SIGXCPU" else f"killed by {name}"
        return f"exited with code {code}"

    # ------------------------------------------------------------------ nbclient's hooks

    async def _async_handle_timeout(self, timeout, cell=None):
        self.timed_out.add(self._current)
        return await super()._async_handle_timeout(timeout, cell)

    def on_cell_executed(self, **kwargs):
        super().on_cell_executed(**kwargs)
        self.replies[kwargs["cell_index"]] = kwargs["execute_reply"]["content"]["status"]

    def output(self, outs, msg, display_id, cell_index):
        """Keep a cell's output up to settings.output_limit bytes (errors always), then one line saying so."""
        content = msg.get("content", {})
        size = len(json.dumps(content.get("data") or content.get("text") or content.get("traceback") or ""))
        self._bytes[cell_index] = self._bytes.get(cell_index, 0) + size
        if self._bytes[cell_index] > self.settings.output_limit and msg["msg_type"] != "error":
            if cell_index not in self.truncated:
                self.truncated.add(cell_index)
                outs.append(
                    NotebookNode(
                        output_type="stream",
                        name="stdout",
                        text=(f"\n[the grader cut this cell's output at {self.settings.output_limit:,} bytes]\n"),
                    )
                )
            return None
        return super().output(outs, msg, display_id, cell_index)

    # ------------------------------------------------------------------ one cell

    async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):
        if cell.cell_type != "code" or not cell.source.strip() or self._skipped(cell, cell_index):
            return cell
        self.timeout = max(1, int(min(self.settings.cell_timeout, self.deadline - monotonic())))
        self._current = cell_index
        try:
            if is_test_cell(cell):
                await self._reset_helpers()
            return await super().async_execute_cell(cell, cell_index, execution_count, store_history)
        except DeadKernelError:
            return self._kernel_died(cell, cell_index)
        except CellTimeoutError:  # no reply even after the interrupt: stop the kernel
            return await self._kernel_stopped(cell, cell_index)
        finally:
            self._note_interrupt(cell_index)

    execute_cell = run_sync(async_execute_cell)

    def _skipped(self, cell, cell_index: int) -> bool:
        """True (and the cell not run) once the kernel is gone or the notebook's time is up."""
        if self.stopped:
            self.not_run[cell_index] = self.stopped
            cell.outputs = []
            return True
        if self.deadline - monotonic() < 1:
            self.stopped = "timeout"
            self.events.append(
                f"the notebook ran past its {self.settings.notebook_timeout:g} s limit before {self._label(cell_index)}"
            )
            self.not_run[cell_index] = "timeout"
            return True
        return False

    async def _reset_helpers(self) -> None:
        msg_id = await ensure_async(self.kc.execute(RESET_HELPERS, silent=True, store_history=False))
        try:
            await asyncio.wait_for(self._wait_reply(msg_id), timeout=30)
        except asyncio.TimeoutError:
            pass

    async def _wait_reply(self, msg_id):
        while True:
            msg = await ensure_async(self.kc.shell_channel.get_msg(timeout=None))
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg

    def _kernel_died(self, cell, cell_index: int):
        """The kernel died in this cell: at its time limit (timeout), or killed or exited (crashed)."""
        if cell_index in self.timed_out:
            self.stopped = "timeout"
            self.events.append(f"{self._label(cell_index)} ran past {self.timeout} s; the kernel died")
        else:
            reason = self._exit_reason()
            self.stopped = "timeout" if "CPU-time" in reason else "crashed"
            self.events.append(f"the kernel died in {self._label(cell_index)}: {reason}")
        return self._failed(cell, cell_index, "KernelDied")

    async def _kernel_stopped(self, cell, cell_index: int):
        """The cell ignored the interrupt at its time limit: stop the kernel."""
        self.timed_out.add(cell_index)
        self.stopped = "timeout"
        self.events.append(
            f"{self._label(cell_index)} ran past {self.timeout} s and ignored the interrupt: the kernel was stopped"
        )
        await self._stop_kernel()
        return self._failed(cell, cell_index, "CellTimeoutError")

    def _failed(self, cell, cell_index: int, ename: str):
        """Record the cell as an error whose message is the last event."""
        self.replies[cell_index] = "error"
        cell.outputs.append(NotebookNode(output_type="error", ename=ename, evalue=self.events[-1], traceback=[]))
        return cell

    def _note_interrupt(self, cell_index: int) -> None:
        """A cell interrupted at its time limit that still replied: say so once."""
        if cell_index in self.timed_out and not any(
            "ran past" in e and self._label(cell_index) in e for e in self.events
        ):
            self.events.append(f"{self._label(cell_index)} ran past {self.timeout} s: interrupted")

    def _label(self, index: int) -> str:
        gid = meta(self.nb.cells[index]).get("grade_id")
        return f"cell {index}" + (f" ({gid})" if gid else "")
