"""The load generator's claim on a core (load/client_priority.py): what it sets, what it puts back, what it records
where it is not permitted, and the run-queue wait it reads."""

from __future__ import annotations

import atexit
import os

from load import client_priority


def _fake_autogroup(tmp_path, monkeypatch, nice: int = 0):
    path = tmp_path / "autogroup"
    path.write_text(f"/autogroup-42 nice {nice}\n")
    monkeypatch.setattr(client_priority, "AUTOGROUP", str(path))
    return path


def test_prioritize_sets_the_autogroup_and_the_process_and_puts_the_group_back(tmp_path, monkeypatch):
    path = _fake_autogroup(tmp_path, monkeypatch, nice=3)
    set_to, restore = [], []
    monkeypatch.setattr(os, "setpriority", lambda which, who, value: set_to.append((which, who, value)))
    monkeypatch.setattr(atexit, "register", lambda fn, *args: restore.append((fn, args)))
    applied = client_priority.prioritize(-7)
    assert applied == {"nice": -7, "autogroup": True, "process": True}
    assert path.read_text() == "-7"
    assert set_to == [(os.PRIO_PROCESS, 0, -7)]
    (fn, args), = restore  # the group is the caller's whole session: its value comes back at exit
    fn(*args)
    assert path.read_text() == "3"


def test_prioritize_says_so_where_it_is_not_permitted(tmp_path, monkeypatch):
    monkeypatch.setattr(client_priority, "AUTOGROUP", str(tmp_path / "missing" / "autogroup"))

    def refuse(*_):
        raise PermissionError("not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    applied = client_priority.prioritize()
    assert applied["autogroup"] is False and applied["process"] is False
    assert "not permitted" in applied["note"]


def test_prioritize_without_autogroups_still_sets_the_process(tmp_path, monkeypatch):
    monkeypatch.setattr(client_priority, "AUTOGROUP", str(tmp_path / "none"))
    set_to = []
    monkeypatch.setattr(os, "setpriority", lambda *a: set_to.append(a))
    applied = client_priority.prioritize(-5)
    assert applied == {"nice": -5, "autogroup": False, "process": True}
    assert set_to == [(os.PRIO_PROCESS, 0, -5)]


def test_waited_ms_reads_the_threads_run_queue_wait(tmp_path, monkeypatch):
    stat = tmp_path / "schedstat"
    stat.write_text("1500000 2500000 7\n")  # run ns, wait ns, timeslices
    monkeypatch.setattr(client_priority, "SCHEDSTAT", str(stat))
    assert client_priority.waited_ms() == 2.5
    monkeypatch.setattr(client_priority, "SCHEDSTAT", str(tmp_path / "absent"))
    assert client_priority.waited_ms() is None


def test_waited_ms_on_this_kernel_is_a_running_total():
    first = client_priority.waited_ms()
    assert first is not None, "this Linux gives no /proc/thread-self/schedstat: the results would record no waits"
    sum(i * i for i in range(200_000))
    assert client_priority.waited_ms() >= first >= 0
