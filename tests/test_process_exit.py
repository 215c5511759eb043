"""How dtrain's processes exit (``dtrain.process_exit``): the launcher freezes the heap after
everything else the program does, before the interpreter's last garbage collections; a worker
ends without finalizing, so that a thread inside torch's C++ code cannot abort it."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

PROGRAM = """
import atexit, gc, sys
from pathlib import Path
from dtrain.process_exit import freeze_heap_at_exit

out = Path(sys.argv[1])
# Registered first, so it runs last: it sees what the freeze did, and that the files and
# handlers of the program still work after it.
atexit.register(lambda: out.write_text(f"{gc.get_freeze_count()} {log.closed}"))
log = open(out.with_suffix(".log"), "w")
log.write("written before exit, flushed by the close below")
atexit.register(log.close)
freeze_heap_at_exit()
freeze_heap_at_exit()  # idempotent: one freeze
print(gc.get_freeze_count())
"""


def test_the_heap_is_frozen_at_exit_only_and_the_program_exits_as_before(tmp_path: Path) -> None:
    out = tmp_path / "after_exit.txt"
    run = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "0"  # nothing frozen while the program runs
    frozen, log_closed = out.read_text().split()
    assert int(frozen) > 1000  # at exit: every object the interpreter held
    assert log_closed == "True"  # the program's own exit handlers ran
    assert out.with_suffix(".log").read_text() == "written before exit, flushed by the close below"


BUSY_AT_EXIT = """
import atexit, sys, threading
from pathlib import Path
import torch
from dtrain.process_exit import exit_without_finalizing

out = Path(sys.argv[1])
atexit.register(lambda: out.write_text("exit handlers ran"))
a = torch.randn(600, 600)
busy = threading.Event()


def spin():  # a daemon thread that is inside torch's C++ code (GIL released) at any moment
    busy.set()
    while True:
        a @ a


threading.Thread(target=spin, daemon=True).start()
busy.wait()
print("printed, not flushed")


def main():
    if sys.argv[2] == "interrupt":
        raise KeyboardInterrupt
    return 3


exit_without_finalizing(main)
"""


@pytest.mark.parametrize("how", ["code", "interrupt"])
def test_a_worker_ends_with_its_code_while_a_thread_is_inside_torch(
    tmp_path: Path, how: str
) -> None:
    # Python's finalization ends such a thread where it stands and the process aborts
    # ("terminate called without an active exception", SIGABRT) after its work was done.
    out = tmp_path / "after_exit.txt"
    run = subprocess.run(
        [sys.executable, "-c", BUSY_AT_EXIT, str(out), how],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == (3 if how == "code" else -signal.SIGINT), run.stderr
    assert run.stdout == "printed, not flushed\n"
    assert run.stderr == ""
    assert out.read_text() == "exit handlers ran"
