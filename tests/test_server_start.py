"""How `od-moe serve` starts (issue 70): anything that fails before the server is ready (loading, warming
up, building the batch and compiling its kernels) ends it with one line and a non-zero exit, never a hang;
while the model loads the port already answers, `/health` with status "loading" and every other route a 503
with `Retry-After`, and once it is ready the same port serves."""

import threading

import pytest

import od_moe
from od_moe.server import create_app
from od_moe.server import worker as server_worker

BOUND_S = 120  # a start that has not ended by then hangs: the test fails rather than waiting for ever


@pytest.fixture(scope="module")
def engine():
    return od_moe.load(capacity="50%")


def broken_batch(*args, **kwargs):
    raise RuntimeError("kernel compile failed")


def ended(target, *args, **kwargs):
    """What `target` raised or returned, run on a thread given `BOUND_S` to end."""
    outcome = []

    def run():
        try:
            outcome.append(target(*args, **kwargs))
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    assert outcome, f"{target.__name__} hung: still running after {BOUND_S} s"
    return outcome[0]


def test_a_batch_that_cannot_be_built_fails_create_app_instead_of_hanging(monkeypatch, engine):
    monkeypatch.setattr(server_worker, "RunningBatch", broken_batch)
    raised = ended(create_app, engine, max_batch=2)
    assert isinstance(raised, RuntimeError) and "kernel compile failed" in str(raised)
