"""The signal witness: ready before any worker starts, one answer per copy received."""

from __future__ import annotations

import os
import signal

import pytest

from dist_launch.workers.signal_witness import SignalWitness

pytestmark = pytest.mark.processes


def test_a_signal_sent_once_the_witness_is_ready_is_seen_once() -> None:
    witness = SignalWitness([signal.SIGTERM, signal.SIGUSR1])
    try:
        assert witness.wait_ready(30.0)
        # Before readiness, this copy could have killed the witness (its default action).
        os.kill(witness.process.pid, signal.SIGTERM)
        assert witness.saw(signal.SIGTERM, wait=30.0)
        assert witness.process.poll() is None
        assert not witness.saw(signal.SIGTERM, wait=0.1)  # one copy, one answer
        assert not witness.saw(signal.SIGUSR1, wait=0.0)
    finally:
        witness.close()


def test_a_witness_that_died_is_not_ready() -> None:
    witness = SignalWitness([signal.SIGTERM])
    try:
        witness.process.kill()
        witness.process.wait(30.0)
        assert not witness.wait_ready(30.0)
    finally:
        witness.close()
