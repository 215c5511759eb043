"""dtrain's processes freeze the heap at exit (``dtrain.process_exit``): after everything else
the program does, and before the interpreter's last garbage collections."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
