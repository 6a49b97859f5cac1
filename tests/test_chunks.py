"""The assembly buffer's copies on two threads: no copy job may outlive the call that started it."""
from __future__ import annotations

import threading
import time

import pytest

from kvbridge.engine.assembly_buffer import AssemblyBuffer
from kvbridge.formats.llama_state import LayoutError


def test_a_failing_assembly_waits_for_the_other_threads_jobs():
    """Before the fix, the pool thread's half kept writing into the shared buffer after the failure
    returned, i.e. into the buffer the next restore hands to the engine."""
    buffer = AssemblyBuffer()
    finished = threading.Event()

    def fails():
        raise LayoutError("a piece that does not fit")

    def slow_copy():
        time.sleep(0.3)
        finished.set()

    try:
        with pytest.raises(LayoutError):
            buffer.run_jobs([fails, slow_copy])     # even indices run here, odd ones on the pool thread
        assert finished.is_set(), "a copy job was still running after the failed assembly returned"
    finally:
        buffer.close()


def test_a_failing_pool_job_is_raised_after_both_halves_finish():
    buffer = AssemblyBuffer()
    done = []

    def slow_here():
        time.sleep(0.2)
        done.append("here")

    def fails_there():
        raise LayoutError("bad piece")

    try:
        with pytest.raises(LayoutError):
            buffer.run_jobs([slow_here, fails_there])
        assert done == ["here"]
    finally:
        buffer.close()
