"""journald priorities: when stderr is the journal stream ($JOURNAL_STREAM names stderr's
dev:inode, as systemd sets it), every line the supervisor and its workers write opens with its
syslog priority (``<3>`` for ERROR ...); otherwise lines are left alone.

The daemon test plays systemd's part with a file: stderr goes to it and $JOURNAL_STREAM names
it. It fails when the prefix is missing or wrong for any level, missing from a worker's lines,
or written when $JOURNAL_STREAM names another stream.
"""

from __future__ import annotations

import logging
import os
import re
import signal

import pytest

from modelwarden.shared.logs import (JournalPriorityFormatter, stderr_is_journal,
                                     syslog_priority)
from tests.helpers import Daemon, faulty_model, poll_until

QUICK = {"start_seconds": 0.5, "backoff_initial": 0.1, "kill_grace": 1.0}
# "<N>2026-11-30 19:00:00,000 WARNING  supervisor[12] ..." (TEXT_FORMAT, behind the prefix)
LINE = re.compile(r"^(<(\d)>)?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (\w+) +(\S+)\[\d+\] ")
EXPECTED = {"CRITICAL": "2", "ERROR": "3", "WARNING": "4", "INFO": "6", "DEBUG": "7"}


def stream_id(path) -> str:
    info = os.stat(path)
    return f"{info.st_dev}:{info.st_ino}"


def test_syslog_priorities_of_each_level():
    assert [syslog_priority(level) for level in (logging.CRITICAL, logging.ERROR, logging.WARNING,
                                                 logging.INFO, logging.DEBUG, 25, 5)] == [2, 3, 4, 6, 7, 6, 7]


def test_every_line_of_a_traceback_carries_the_priority():
    formatter = JournalPriorityFormatter(logging.Formatter("%(levelname)s %(message)s"))
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), exc_info=True)
        import sys
        record.exc_info = sys.exc_info()
    lines = formatter.format(record).split("\n")
    assert len(lines) > 3 and all(line.startswith("<3>") for line in lines), lines


def test_the_journal_is_recognised_by_the_streams_dev_and_inode(tmp_path):
    journal, other = tmp_path / "journal", tmp_path / "other"
    journal.touch()
    other.touch()
    with open(journal, "w") as stream:
        assert stderr_is_journal({"JOURNAL_STREAM": stream_id(journal)}, stream)
        assert not stderr_is_journal({"JOURNAL_STREAM": stream_id(other)}, stream)
        assert not stderr_is_journal({}, stream)
        assert not stderr_is_journal({"JOURNAL_STREAM": "garbage"}, stream)


def log_lines(daemon: Daemon) -> list[re.Match]:
    matches = [LINE.match(line) for line in daemon.log().splitlines()]
    return [match for match in matches if match]


def exercise(daemon: Daemon) -> None:
    """INFO from start-up, ERROR from a worker that cannot load its model, CRITICAL when its slot
    goes FATAL, WARNING when a serving worker is SIGKILLed."""
    daemon.wait_ready(models=["serving"])
    poll_until(lambda: "FATAL" in daemon.log(), 60, message="the broken slot FATAL")
    (pid,) = daemon.worker_pids()
    os.kill(pid, signal.SIGKILL)
    poll_until(lambda: "SIGKILL" in daemon.log(), 30, message="the SIGKILLed worker noticed")
    assert daemon.stop() == 0


def models() -> list[dict]:
    return [faulty_model("serving", workers=1, **QUICK),
            faulty_model("broken", "load_error", workers=1, max_start_failures=1, ready_min=0, **QUICK)]


@pytest.mark.slow
def test_journal_lines_carry_their_syslog_priority():
    daemon = Daemon(models())
    daemon.log_path.touch()  # the "journal stream": the daemon's stderr opens this very file
    daemon.env["JOURNAL_STREAM"] = stream_id(daemon.log_path)
    with daemon:
        exercise(daemon)
        lines = log_lines(daemon)
        text = daemon.log()
    levels = {match.group(3) for match in lines}
    assert {"CRITICAL", "ERROR", "WARNING", "INFO"} <= levels, levels
    for match in lines:
        assert match.group(2) == EXPECTED[match.group(3)], match.string
    roles = {match.group(4) for match in lines}
    assert {"supervisor", "serving#0", "broken#0"} <= roles, roles  # workers' lines too
    unprefixed = [line for line in text.splitlines() if line and not line.startswith("<")]
    assert not unprefixed, unprefixed


@pytest.mark.slow
def test_no_prefix_when_stderr_is_not_the_journal(tmp_path):
    elsewhere = tmp_path / "another-stream"
    elsewhere.touch()
    with Daemon(models(), env={"JOURNAL_STREAM": stream_id(elsewhere)}) as daemon:
        exercise(daemon)
        lines = log_lines(daemon)
    assert {"CRITICAL", "ERROR", "WARNING", "INFO"} <= {match.group(3) for match in lines}
    assert not any(match.group(1) for match in lines), [m.string for m in lines if m.group(1)]
