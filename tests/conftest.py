import logging
import os

import pytest

# torch_npu (or any other out-of-tree backend) must never be auto-imported in tests.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


@pytest.fixture(autouse=True)
def _engram_logs_reach_caplog():
    """An in-process train() runs init_logging, which stops propagation and writes to the stdout
    of the test that ran it; later tests' caplog needs the records to propagate again."""
    from engram.runtime.logs import LOGGERS

    for name in LOGGERS:
        log = logging.getLogger(name)
        for h in list(log.handlers):
            log.removeHandler(h)
        log.propagate = True
        log.setLevel(logging.NOTSET)
    yield
