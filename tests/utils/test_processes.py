"""kvserve's child processes (utils/processes.py): start, hand-shake, clean-up, with real
spawned interpreters."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import zmq

from kvserve.utils.processes import (
    ChildResources,
    pipe,
    spawn,
    startup_error,
    stop,
    wait_for_handshake,
)

# libc called with the GIL held (PyDLL): no other thread of ours runs meanwhile.
_LIBC_HOLDING_GIL = ctypes.PyDLL(None, use_errno=True)
_P_PID, _WEXITED, _WNOHANG, _WNOWAIT = 1, 4, 1, 0x01000000
_SI_PID_OFFSET = 16 if ctypes.sizeof(ctypes.c_void_p) == 8 else 12  # Linux siginfo_t


def _exited_holding_gil(pid: int) -> str:
    """Whether ``pid`` has exited ("running", "zombie", or "reaped" by some thread's
    waitpid), looked at without reaping it and without letting go of the GIL."""
    info = ctypes.create_string_buffer(128)
    ctypes.set_errno(0)
    if _LIBC_HOLDING_GIL.waitid(_P_PID, pid, info, _WEXITED | _WNOHANG | _WNOWAIT) != 0:
        assert ctypes.get_errno() == errno.ECHILD
        return "reaped"
    si_pid = int.from_bytes(info.raw[_SI_PID_OFFSET : _SI_PID_OFFSET + 4], sys.byteorder)
    return "zombie" if si_pid == pid else "running"


def _asleep(thread: threading.Thread) -> bool:
    with open(f"/proc/self/task/{thread.native_id}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "S"


def _say_ready(writer: Connection) -> None:
    writer.send_bytes(os.environ["OMP_NUM_THREADS"].encode())
    time.sleep(60)  # stays up until stopped


def _die_at_start(writer: Connection) -> None:
    print("cannot open the model file: no such file", file=sys.stderr)
    sys.exit(3)


def _never_answer(writer: Connection) -> None:
    time.sleep(60)


def test_the_handshake_carries_the_child_message_and_its_thread_share() -> None:
    before = os.environ.get("OMP_NUM_THREADS")
    reader, writer = pipe()
    proc = spawn(_say_ready, (writer,), "Ready", num_threads=1)
    writer.close()
    try:
        assert wait_for_handshake(reader, proc, 60, "ready child") == b"1"
        assert reader.closed
        assert os.environ.get("OMP_NUM_THREADS") == before  # only the child's environment
    finally:
        stop([proc])
    assert not proc.is_alive()


def test_a_child_that_dies_at_start_is_reported_at_once_with_its_exit_code() -> None:
    reader, writer = pipe()
    proc = spawn(_die_at_start, (writer,), "Dies")
    writer.close()
    started = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"dying child exited during startup \(exit code 3\)"
    ) as e:
        wait_for_handshake(reader, proc, 600, "dying child")
    assert time.monotonic() - started < 60  # not the 600 s timeout
    # What it wrote on stderr says why; the parent's stderr saw it too.
    assert "cannot open the model file: no such file" in str(e.value)


_UNGUARDED_SCRIPT = """
from kvserve import LLM

llm = LLM(tensor_parallel_size=2, max_model_len=128)
print(llm.generate(["Hello"])[0].outputs[0].text)
"""


def test_a_script_without_the_main_guard_fails_at_once_naming_the_guard(tmp_path: Path) -> None:
    """Spawned workers import the main script again, which starts kvserve again in each:
    the user gets the fix, not a 600 s start-up timeout."""
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()
    failure = next(line for line in last if line.startswith("RuntimeError: worker"))
    assert "exited during startup (exit code 1)" in failure
    assert 'if __name__ == "__main__":' in failure
    assert "did not start within" not in done.stderr


def test_a_silent_child_times_out_and_is_stopped() -> None:
    reader, writer = pipe()
    proc = spawn(_never_answer, (writer,), "Silent")
    writer.close()
    with pytest.raises(TimeoutError, match=r"silent child did not start within 0\.5 s"):
        wait_for_handshake(reader, proc, 0.5, "silent child")
    stop([proc], grace_s=5)
    assert proc.exitcode is not None


def test_startup_errors_keep_their_type_where_the_caller_can_act_on_it() -> None:
    error = startup_error("ValueError", "bad flag")
    assert type(error) is ValueError and str(error) == "bad flag"
    assert type(startup_error("KeyError", "x")) is RuntimeError
    assert type(startup_error(None, "x")) is RuntimeError


def test_child_resources_release_everything_once(tmp_path: object) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind("tcp://127.0.0.1:*")
    reader, writer = pipe()
    proc = spawn(_say_ready, (writer,), "Ready")
    writer.close()
    wait_for_handshake(reader, proc, 60, "ready child")
    r, w = os.pipe()
    tmpdir = str(tmp_path) + "/sockets"
    os.mkdir(tmpdir)
    resources = ChildResources(ctx, [sock], [proc], tmpdir=tmpdir, fds=[r, w])
    resources()
    resources()  # a second call (the finalizer after an explicit shutdown) does nothing
    assert not proc.is_alive() and sock.closed and ctx.closed
    assert not os.path.exists(tmpdir)
    with pytest.raises(OSError):
        os.fstat(r)


def test_a_child_another_thread_is_reaping_is_never_reported_alive() -> None:
    """A client's output thread joins its core when the core's sentinel fires while the
    core's owner joins it too, or asks is_alive(): multiprocessing's own poll told the
    loser of the two waitpid calls that the dead child was running. Made certain here:
    the joining thread is left no GIL between its waitpid and storing the exit code."""
    proc = spawn(time.sleep, (60,), "Reaped")
    joining = threading.Event()

    def join() -> None:
        joining.set()
        proc.join()

    reaper = threading.Thread(target=join, daemon=True)
    interval = sys.getswitchinterval()
    try:
        reaper.start()
        joining.wait()
        asleep = 0
        while asleep < 3:  # the GIL is free meanwhile: the reaper sleeps in its wait
            time.sleep(0.01)
            asleep = asleep + 1 if _asleep(reaper) else 0
        sys.setswitchinterval(60)  # from here the reaper runs only when we block
        proc.kill()
        deadline = time.monotonic() + 60
        while _exited_holding_gil(proc.pid or 0) == "running" and time.monotonic() < deadline:
            _LIBC_HOLDING_GIL.usleep(10_000)
        # A reaper blocked in waitpid reaps it now, with no GIL to store the exit code.
        deadline = time.monotonic() + 0.5
        while _exited_holding_gil(proc.pid or 0) != "reaped" and time.monotonic() < deadline:
            _LIBC_HOLDING_GIL.usleep(10_000)
        assert not proc.is_alive()
    finally:
        sys.setswitchinterval(interval)
        proc.kill()
    reaper.join(10)
    assert proc.exitcode == -signal.SIGKILL
