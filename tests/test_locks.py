"""Waits end and lock owners are known for sure (issue 20, class 2): `locks.py` names an owner by
pid, start time, boot id and host; a live but unrelated pid (after a crash or reboot) is stale,
a live owner is waited for with a message and a bound, then refused in one line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from dsparkctl import locks
from dsparkctl.errors import InputError


@pytest.fixture()
def sleeper():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


def _owner(pid, **change):
    return {"pid": pid, "start": locks._start_ticks(pid), "boot": locks._boot_id(), "host": socket.gethostname(),
            **change}


@pytest.mark.parametrize("case,content,stale", [
    ("bare pid of a live process (older format)", lambda p: str(p.pid), True),
    ("live pid, another start time", lambda p: json.dumps(_owner(p.pid, start=1)), True),
    ("live pid, before a reboot", lambda p: json.dumps(_owner(p.pid, boot="another-boot")), True),
    ("dead pid", lambda p: json.dumps(_owner(2 ** 22 + 7, start=5)), True),
    ("damaged", lambda p: '{"pid": ', True),
    ("a FIFO", None, True),
    ("live owner", lambda p: json.dumps(_owner(p.pid)), False),
    ("another host", lambda p: json.dumps(_owner(p.pid, host="elsewhere")), False),
])
def test_wait_for_a_lock(tmp_path, sleeper, case, content, stale):
    lock = tmp_path / "part_00000.lock"
    if content is None:
        os.mkfifo(lock)  # a read would block
    else:
        lock.write_text(content(sleeper))
    logs: list[str] = []
    if stale:
        locks.wait_for(lock, lambda: False, "data part 00000", log=logs.append, poll=0.01, limit_s=5)
        assert not lock.exists() and len(logs) == 1 and logs[0].startswith(f"note: removed the stale lock {lock}")
    else:
        with pytest.raises(InputError) as e:
            locks.wait_for(lock, lambda: False, "data part 00000", log=logs.append, poll=0.01, limit_s=0.1)
        line = e.value.one_line()
        assert f"data part 00000 has been locked by process {sleeper.pid} on" in line and f"delete {lock}" in line
        assert len(logs) == 1 and logs[0].startswith(f"waiting for process {sleeper.pid}") and lock.exists()


@pytest.mark.parametrize("case,pid,start,alive", [
    ("this process", lambda p: os.getpid(), None, True),
    ("a live process", lambda p: p.pid, None, True),
    ("a live process, its start time", lambda p: p.pid, lambda p: locks._start_ticks(p.pid), True),
    ("a live pid, another start time", lambda p: p.pid, lambda p: 1, False),
    ("a dead pid", lambda p: 2 ** 22 + 7, None, False),
    ("not an int (damaged)", lambda p: str(p.pid), None, False),
    ("zero", lambda p: 0, None, False),
    ("negative", lambda p: -1, None, False),
])
def test_pid_alive(sleeper, case, pid, start, alive):
    assert locks.pid_alive(pid(sleeper), start(sleeper) if start else None) is alive, case


def test_a_wait_ends_when_the_work_is_done(tmp_path, sleeper):
    lock = tmp_path / "l"
    lock.write_text(json.dumps(_owner(sleeper.pid)))
    locks.wait_for(lock, lambda: True, "x", log=lambda m: None, limit_s=0)


def test_a_run_folder_in_use_is_refused_at_once_and_a_stale_one_taken_over(tmp_path, sleeper):
    lock = tmp_path / "run.lock"
    lock.write_text(json.dumps(_owner(sleeper.pid)))
    with pytest.raises(InputError, match=f"is in use by process {sleeper.pid} on"):
        locks.refuse_if_held(lock, "the run folder r")
    lock.write_text(json.dumps(_owner(sleeper.pid, start=1)))  # the pid was reused by an unrelated process
    locks.refuse_if_held(lock, "the run folder r")
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    locks.release(lock)
    assert not lock.exists()
