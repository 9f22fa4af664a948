"""The workers' lives end with the planner's: a launcher killed with SIGKILL takes its workers (and the
resource tracker) with it, Ctrl-C pressed any number of times is one line and exit 130, and a worker killed
by SIGKILL is said to be out of memory only when the kernel's OOM killer did it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from planner.models import Workload
from planner.platform import launch
from planner.platform.launch import run_distributed
from planner.platform.link import NAMESPACE_PREFIX, list_namespaces, privilege_problem, remove_stale_namespaces
from planner.platform.oom import OomWatch, oom_kill_count, oom_killed_in_kernel_log
from planner.types import DistributedError
from tests.factories import synthetic_plan, synthetic_profile

pytestmark = pytest.mark.spawns  # its tests start their own workers (tests/pool.py says which must)

ROOT = Path(__file__).resolve().parents[1]
needs_root = pytest.mark.skipif(privilege_problem() is not None, reason=f"no emulated link here: {privilege_problem()}")

#: A launcher of two workers that run `sleeps_in_workers` (argv: the folder for their pid files, a --link rate
#: or "none").
LAUNCHER = textwrap.dedent("""
    import sys
    from planner.platform.launch import run_distributed
    from planner.platform.link import parse_rate
    from tests.test_lifecycle import sleeps_in_workers

    link = None if sys.argv[2] == "none" else parse_rate(sys.argv[2])
    run_distributed(sleeps_in_workers, 2, sys.argv[1], timeout=600, link=link)
""")


def sleeps_in_workers(rank: int, world_size: int, folder: str) -> None:
    pid_file = Path(folder, f"worker{rank}.pid")
    pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
    pid_file.with_suffix(".tmp").rename(pid_file)  # whole: the test reads it as soon as it appears
    time.sleep(600)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of `pid` from /proc, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, ppid = text.rsplit(")", 1)[1].split()[:2]  # the name before ")" may hold spaces
    return state, int(ppid)


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[1] == pid:
                kids.append(int(entry.name))
    return kids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _workers(pid: int) -> list[int]:
    """The spawned workers among `pid`'s children (not the resource tracker)."""
    return [kid for kid in _children(pid) if "spawn_main" in _cmdline(kid)]


def _survivors(pids: list[int], within_s: float) -> list[int]:
    """Those of `pids` still alive after waiting up to `within_s` for them all to end."""
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _end(pids: list[int], folder: Path | None = None) -> None:
    """Kill what is left of the processes `pids` and those that wrote a pid file in `folder`."""
    if folder is not None:
        pids = pids + [int(p.read_text()) for p in folder.glob("worker*.pid")]
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _namespaces_of(pid: int) -> list[str]:
    return [n for n in list_namespaces() if n.startswith(f"{NAMESPACE_PREFIX}-{pid}-")]


# -- item 1: workers die with a killed launcher ---------------------------------------------------------------------
@pytest.mark.parametrize("link", ["none", pytest.param("1gbit", marks=needs_root)])
def test_workers_and_the_resource_tracker_die_with_a_launcher_killed_by_sigkill(tmp_path: Path, link: str) -> None:
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path), link], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while len(list(tmp_path.glob("worker*.pid"))) < 2 and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(list(tmp_path.glob("worker*.pid"))) == 2, "the workers did not start"
        workers = [int(p.read_text()) for p in tmp_path.glob("worker*.pid")]
        children = _children(launcher.pid)  # the workers and multiprocessing's resource tracker
        assert set(workers) < set(children)
        launcher.kill()
        launcher.wait()
        assert _survivors(children, within_s=10) == [], [_cmdline(p) for p in children if _alive(p)]
        if link != "none":  # what the next run does first: the killed run's namespaces are removed
            assert _namespaces_of(launcher.pid) != []
            remove_stale_namespaces()
            assert _namespaces_of(launcher.pid) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        _end(children, tmp_path)


def test_a_worker_still_starting_when_its_launcher_is_killed_exits_instead_of_running(tmp_path: Path) -> None:
    """The launcher dies before the worker could ask to die with it: the worker notices and never runs `fn`."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path), "none"], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not _workers(launcher.pid) and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        children = _children(launcher.pid)
        launcher.kill()  # the first worker is importing its modules, long before it runs anything
        launcher.wait()
        assert any("spawn_main" in _cmdline(p) for p in children), "no worker started"
        assert _survivors(children, within_s=90) == [], [_cmdline(p) for p in children if _alive(p)]
        assert list(tmp_path.glob("worker*.pid")) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        _end(children, tmp_path)


#: A launcher file whose workers take a minute to start after importing the package: a spawned worker runs its
#: launcher's main file again (as __mp_main__) before anything of its own, as it runs the `planner` script.
SLOW_STARTING = textwrap.dedent("""
    import sys
    import time

    import planner

    if __name__ == "__mp_main__":  # in a worker, still starting
        time.sleep(60)
    if __name__ == "__main__":
        from planner.platform.launch import run_distributed
        from tests.test_lifecycle import sleeps_in_workers

        run_distributed(sleeps_in_workers, 2, sys.argv[1], timeout=600)
""")


def test_a_worker_dies_with_its_launcher_from_its_first_import_of_the_package(tmp_path: Path) -> None:
    """Not only once its modules are imported (torch takes seconds, on a busy machine half a minute): the worker
    asks as the package is imported (`planner._lifeline`), so it is gone long before its start-up would end."""
    script = tmp_path / "launcher.py"
    script.write_text(SLOW_STARTING)
    launcher = subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not _workers(launcher.pid) and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(3)  # the first worker is past `import planner`, in its minute of start-up
        children = _children(launcher.pid)
        assert any("spawn_main" in _cmdline(p) for p in children), "no worker started"
        launcher.kill()
        launcher.wait()
        assert _survivors(children, within_s=10) == [], [_cmdline(p) for p in children if _alive(p)]
        assert list(tmp_path.glob("worker*.pid")) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        _end(children, tmp_path)


def test_two_threads_starting_workers_at_once_leave_no_launcher_pid_behind() -> None:
    """Two jobs launched from two threads (as crossed-over jobs are) each set and put back the launcher's pid: the
    second must not put back what the first set, or every process started later (torchrun's workers) would take
    this one for its launcher."""
    import threading

    from planner._lifeline import LAUNCHER_ENV

    assert LAUNCHER_ENV not in os.environ
    inside, second_tried = threading.Event(), threading.Event()

    def first() -> None:
        with launch._launcher_named():
            inside.set()
            second_tried.wait(5)
            time.sleep(0.2)  # the second thread is starting its worker meanwhile (or waiting to)

    def second() -> None:
        inside.wait(5)
        second_tried.set()
        with launch._launcher_named():
            time.sleep(0.5)  # still starting when the first has finished

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert LAUNCHER_ENV not in os.environ


def test_a_process_that_is_not_the_launchers_child_ignores_a_launcher_pid() -> None:
    """A launcher pid that reached another process (not a child of that launcher) neither kills it nor arms it."""
    from planner._lifeline import LAUNCHER_ENV

    done = subprocess.run([sys.executable, "-c", "import os, planner; print(os.environ.get('PLANNER_LAUNCHER_PID'))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, LAUNCHER_ENV: "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip() == "None", (done.returncode, done.stderr)


# -- item 5: Ctrl-C, however many times, is one line and exit 130 ---------------------------------------------------
#: A progress bar's last state, as a bench leaves it on a stream that is not a terminal.
_PROGRESS = re.compile(r"(K-FAC )?bench steps\b.* \d+/\d+ \d+:\d\d:\d\d")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plan and a profile of the built-in mlp for two workers."""
    folder = tmp_path_factory.mktemp("lifecycle")
    synthetic_plan("mlp").save(folder / "plan.json")
    synthetic_profile("mlp", world_size=2).save(folder / "prof.json")
    return folder


def _command(name: str, inputs: Path, out: Path) -> list[str]:
    """A `planner` command line of `name` that runs its workers for minutes."""
    if name == "bench":
        return ["bench", "--plan", str(inputs / "plan.json"), "--steps", "100000", "--peers", "none"]
    return ["tune", str(inputs / "prof.json"), "--model", "mlp", "--trials", "1000", "--steps", "3", "--rungs", "1",
            "--warmup", "1", "--compare-steps", "3", "-o", str(out / "tuned.json")]


@pytest.mark.parametrize("first_after_s", [0.0, 3.0])
@pytest.mark.parametrize("command", ["bench", "tune"])
def test_ctrl_c_pressed_again_and_again_is_one_line_and_exit_130(tmp_path: Path, inputs: Path, command: str,
                                                                    first_after_s: float) -> None:
    """As a terminal does, every Ctrl-C goes to the whole foreground process group (the planner and its workers),
    from the moment a worker starts (or a few seconds later) until the planner has exited."""
    err = tmp_path / "stderr"
    with err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "planner", *_command(command, inputs, tmp_path)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not workers and proc.poll() is None and time.monotonic() < deadline:
            workers = _workers(proc.pid)
            time.sleep(0.01)
        assert workers, f"no worker started: {err.read_text()}"
        time.sleep(first_after_s)
        presses = 0
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            os.killpg(proc.pid, signal.SIGINT)
            presses += 1
            time.sleep(0.05)
        assert proc.poll() is not None, "the planner did not exit on Ctrl-C"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        _end(workers)
    text = err.read_text()
    lines = [ln for ln in text.splitlines() if ln.strip() and not _PROGRESS.fullmatch(ln.strip())]
    assert presses >= 2
    assert proc.returncode == 130 and lines == ["planner: interrupted"], (proc.returncode, text)
    for noise in ("Traceback", "Exception ignored", "Fatal Python error", "KeyboardInterrupt"):
        assert noise not in text


@pytest.mark.parametrize("entry", ["script", "module"])
def test_ctrl_c_while_the_command_is_still_importing_is_one_line_and_exit_130(tmp_path: Path, entry: str) -> None:
    """Before the command runs, its modules and torch take seconds to import: Ctrl-C then (again and again) is the
    same one line and exit 130, through the `planner` script and `python -m planner` alike."""
    script = Path(sys.executable).with_name("planner")
    if entry == "script" and not script.exists():
        pytest.skip("the planner script is not installed beside this interpreter")
    argv = [str(script)] if entry == "script" else [sys.executable, "-m", "planner"]
    # Python reports each import as it completes (PYTHONPROFILEIMPORTTIME): the first press comes once the
    # `planner.commands` package is in, that is once `console` has begun importing the commands; a press while the
    # interpreter itself is still starting (its `site`) is not the project's to answer.
    proc = subprocess.Popen([*argv, "models"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    assert proc.stderr is not None
    stderr: list[str] = []
    importing = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            stderr.append(line)
            if line.rsplit("|", 1)[-1].strip() == "planner.commands":
                importing.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert importing.wait(60), "".join(stderr)
    presses = 0
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        os.killpg(proc.pid, signal.SIGINT)
        presses += 1
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    reader.join(10)
    text = "".join(ln for ln in stderr if not ln.startswith("import time:"))
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert presses >= 1
    assert proc.returncode == 130 and lines == ["planner: interrupted"], (proc.returncode, text)


# -- item 6: "out of memory" only when the OOM killer did it --------------------------------------------------------
def kills_itself(rank: int, world_size: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)


def _short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher waits only 0.5 s, not `FAILURE_GRACE_S`, for the other workers once one died: rank 0 of
    `kills_itself` sleeps on and never reports, so the grace is seconds the outcome does not depend on (as
    `PLANNER_WITH_SHORT_GRACE` below)."""
    monkeypatch.setattr(launch, "FAILURE_GRACE_S", 0.5)


def _death_message(monkeypatch: pytest.MonkeyPatch, counts: list[int | None]) -> str:
    """The error of a run whose rank 1 is killed by SIGKILL while the OOM-kill counter reads `counts` in turn."""
    _short_grace(monkeypatch)
    readings = iter(counts)
    monkeypatch.setattr(launch, "OomWatch", lambda: OomWatch(count=lambda: next(readings),
                                                             kernel_log=lambda pid, since: None))
    with pytest.raises(DistributedError) as caught:
        run_distributed(kills_itself, 2, timeout=120)
    return str(caught.value)


def test_a_worker_killed_while_the_oom_kill_counter_rose_is_out_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's watch, made as the workers start, read again when one dies."""
    message = _death_message(monkeypatch, [4, 5])
    assert message.startswith("worker rank 1 was killed by SIGKILL: out of memory (the kernel's OOM killer)")
    assert "--batch-size" in message


@pytest.mark.parametrize(("counts", "said"), [([4, 4], "was killed by SIGKILL"),
                                              ([None, None], "was killed by SIGKILL (whether by the kernel's OOM "
                                                             "killer is not readable here: `dmesg` says)")])
def test_a_sigkill_is_not_called_out_of_memory_when_the_counter_did_not_rise_or_nothing_says(
        counts: list[int | None], said: str) -> None:
    """The same death read as the launcher reads it (`_death`, as in the test above), without a launch."""
    readings = iter(counts)
    watch = OomWatch(count=lambda: next(readings), kernel_log=lambda pid, since: None)
    assert launch._death(types.SimpleNamespace(exitcode=-signal.SIGKILL, pid=12345), watch) == said


def test_a_real_sigkill_by_hand_is_not_out_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpatched: whatever this machine lets the launcher read, a SIGKILL sent by a process is no OOM kill."""
    _short_grace(monkeypatch)
    with pytest.raises(DistributedError, match=r"^worker rank 1 was killed by SIGKILL") as caught:
        run_distributed(kills_itself, 2, timeout=120)
    assert "out of memory" not in str(caught.value)


@pytest.mark.parametrize(("lines", "files", "count"), [
    (["0::/a/b"], {"a/b/memory.events": "low 0\nhigh 0\nmax 2\noom 1\noom_kill 3\noom_group_kill 0\n"}, 3),
    (["4:memory:/x/y", "0::/"], {"memory/x/y/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"}, 2),
    (["0::/"], {}, None),  # the v2 root group has no memory.events
    (["4:memory:/x"], {"memory/x/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\n"}, None),  # an old kernel
])
def test_the_oom_kill_counter_is_read_from_cgroup_v2_or_v1(tmp_path: Path, lines: list[str],
                                                           files: dict[str, str], count: int | None) -> None:
    proc_cgroup = tmp_path / "cgroup"
    proc_cgroup.write_text("\n".join(["9:name=systemd:/", *lines]) + "\n")
    for name, text in files.items():
        (tmp_path / "root" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "root" / name).write_text(text)
    assert oom_kill_count(proc_cgroup, tmp_path / "root") == count


def test_the_kernel_log_names_an_oom_kill_of_that_pid_since_the_watch_began(tmp_path: Path) -> None:
    now_us = int(time.monotonic() * 1e6)
    log = tmp_path / "kmsg"
    log.write_text(
        f"6,1,{now_us - 3_600_000_000},-;Out of memory: Killed process 4242 (python) total-vm:1kB\n"  # an hour ago
        f"6,2,{now_us},-;Memory cgroup out of memory: Killed process 4343 (python) total-vm:1kB\n"
        f"6,3,{now_us},-;Killed process 4444 by hand\n"
    )
    since = time.monotonic() - 1
    assert oom_killed_in_kernel_log(4343, since, log) is True
    assert oom_killed_in_kernel_log(4242, since, log) is False
    assert oom_killed_in_kernel_log(4444, since, log) is False
    assert oom_killed_in_kernel_log(4343, since, tmp_path / "missing") is None


def test_the_watch_trusts_the_counter_before_the_kernel_log() -> None:
    readings: list[Any] = [1, 1]
    watch = OomWatch(count=lambda: readings.pop(0), kernel_log=lambda pid, since: True)
    assert watch.killed(123) is False
    watch = OomWatch(count=lambda: None, kernel_log=lambda pid, since: True)
    assert watch.killed(123) is True


# -- a hung worker -------------------------------------------------------------------------------------------------
class _HangsInWorkers(nn.Module):
    """Rank 1 stops for good at its third forward pass (a deadlock in the user's code, a lost peer)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if dist.is_initialized() and dist.get_rank() == 1 and self.calls >= 3:
            time.sleep(600)
        return self.fc(x)


def hangs_in_workers() -> Workload:
    """`--model tests.test_lifecycle:hangs_in_workers`."""
    return Workload(name="hangs", module=_HangsInWorkers(), batch_size=4,
                    make_batch=lambda n, g: (torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)),
                    loss_fn=nn.functional.mse_loss)


#: The `planner` command (`python -m planner`) with a shorter grace after a worker's failure than the launcher's
#: `FAILURE_GRACE_S`: a hung worker never reports, and the launcher kills it only after the grace, seconds the
#: outcome does not depend on (the hung worker sends nothing either way).
PLANNER_WITH_SHORT_GRACE = ("import sys; from planner.platform import launch; launch.FAILURE_GRACE_S = 0.5; "
                            "from planner.__main__ import console; sys.exit(console())")


def test_a_profile_whose_worker_hangs_ends_in_one_line_naming_the_phase(tmp_path: Path) -> None:
    """The waiting worker's collective times out after --timeout, and the line names where it was (the progress
    lines a log gets meanwhile: tests/test_uncertainty.py)."""
    out = tmp_path / "prof.json"
    proc = subprocess.run([sys.executable, "-c", PLANNER_WITH_SHORT_GRACE, "profile", "--quick", "--model",
                           "tests.test_lifecycle:hangs_in_workers", "--nproc", "2", "--timeout", "4", "-o", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    # the progress bars as a stream that is not a terminal gets them at the end ("layers of ...  1/101 0:00:04"), and
    # a phase past LOG_EVERY_S (a loaded machine) its lines meanwhile ("[0:10] layers of ...: 1/101")
    progress = [ln for ln in proc.stderr.splitlines() if re.search(r" \d+/\d+ \d+:\d\d:\d\d$", ln)
                or re.fullmatch(r"\[\d+:\d\d\] .+: \d+/(\d+|\?)( done)?", ln)]
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip() and ln not in progress]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert "worker rank 0 failed (during: layers of tests.test_lifecycle:hangs_in_workers)" in errors[0], errors
    assert "Timed out" in errors[0] and "Traceback" not in proc.stderr
    assert not out.exists()


def test_a_ctrl_c_while_a_worker_starts_is_taken_once_the_start_is_done() -> None:
    """With another thread in the process (gloo's, a progress bar's), a Ctrl-C while SIGINT is blocked in the main
    thread goes to that thread, and Python would raise it in the main thread halfway through `Process.start()`:
    the worker then read half its start-up data ("EOFError: Ran out of input") and outlived the launcher."""
    from planner.platform.launch import _interrupts_held

    bystander = threading.Event()
    thread = threading.Thread(target=bystander.wait, args=(30,), daemon=True)  # SIGINT not blocked in it
    thread.start()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    finished = False
    try:
        with pytest.raises(KeyboardInterrupt), _interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(20):  # as the start does (a fork, a pipe's write): the GIL dropped and taken back,
                time.sleep(0.01)  # where the main thread sees the signal that the other thread took
            finished = True
        assert finished
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
        bystander.set()
        thread.join()


_HELD_DEFAULTS = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    if sys.argv[2] == "runtime":
        import planner.runtime  # as a training script imports it: before its process group
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()  # its first use imports torch._dynamo, and through it torch.distributed.nn.functional
    import torch.distributed.nn.functional as collectives
    from torch.distributed.distributed_c10d import ProcessGroup
    print(sorted(name for name, f in vars(collectives).items() if callable(f)
                 and any(isinstance(d, ProcessGroup) for d in getattr(f, "__defaults__", None) or ())))
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("imports", ["torch only", "runtime"])
def test_a_script_importing_the_runtime_leaves_no_process_group_for_the_interpreters_exit_to_free(
        tmp_path: Path, imports: str) -> None:
    """A process group freed only as the interpreter exits aborts it ("terminate called without an active
    exception", 10 of 30 torchrun exits under load). torch's own collectives in torch.distributed.nn.functional hold
    the default group as a default argument when first imported after it was made, as a script's optimizer does;
    with the runtime imported first (as every script using it does) they hold None."""
    done = subprocess.run([sys.executable, "-c", _HELD_DEFAULTS, str(tmp_path / "rendezvous"), imports], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    held = done.stdout.strip().splitlines()[-1]
    if imports == "runtime":
        assert held == "[]"
    else:  # the hazard itself, so that the check above can fail
        assert "'all_reduce'" in held
