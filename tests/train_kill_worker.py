"""`dspark train` with a crash at a chosen point, run by tests/test_train_kill.py (also under torchrun).

    python tests/train_kill_worker.py FAULT N train ARGS...

FAULT "none" runs `dspark train ARGS` as it is; "mid-state" SIGKILLs this process while it writes its N-th
train state (half of the file's bytes on disk); "before-json" SIGKILLs it once its N-th train state's
tensors are in place but before the state's JSON copy is written. Only rank 0 writes train states.
"""
import os
import signal
import sys
from pathlib import Path

import dspark.atomic as atomic
from dspark.cli import main


def arm(fault: str, nth: int) -> None:
    """Wrap the writers dspark.atomic uses so that this process kills itself at the chosen point."""
    real_save, real_write = atomic.save_file, atomic._write_file
    states = [0]

    def save_file(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        if Path(filename).name.startswith(".train_state.safetensors."):
            states[0] += 1
            if fault == "mid-state" and states[0] == nth:
                os.truncate(filename, os.path.getsize(filename) // 2)
                os.kill(os.getpid(), signal.SIGKILL)

    def write_file(path: Path, data: bytes) -> None:
        if fault == "before-json" and states[0] == nth and path.name.startswith(".train_state.json."):
            os.kill(os.getpid(), signal.SIGKILL)
        real_write(path, data)

    atomic.save_file, atomic._write_file = save_file, write_file


if __name__ == "__main__":
    arm(sys.argv[1], int(sys.argv[2]))
    sys.exit(main(sys.argv[3:]))
