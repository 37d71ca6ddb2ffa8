"""An engine process's requests reach the engine thread on a pipe that the thread reads itself
(``EngineRunner(inbox=...)``); what other threads queue for it (stop, a re-registration) must still
wake it while it idles on that pipe."""

from __future__ import annotations

import multiprocessing

from services.gpuworker import runner as runner_module
from services.gpuworker.kvstore_link import KVStoreLink
from services.gpuworker.runtime import build_runtime
from services.gpuworker.settings import WorkerSettings


def test_an_engine_thread_idling_on_its_inbox_wakes_for_stop(monkeypatch, kvstore_service):
    # the idle wait far longer than stop's join: only the queue's wake-up can end the thread in time
    monkeypatch.setattr(runner_module, "IDLE_WAIT_S", 120.0)
    inbox, requests = multiprocessing.Pipe(duplex=False)
    settings = WorkerSettings(kvstore=kvstore_service.address, device="cpu", kvstore_carrier="thread")
    link = KVStoreLink(settings.kvstore, timeout_s=5.0)
    runner, _facts = build_runtime(settings, link, inbox=inbox)
    runner.start()
    try:
        assert runner._thread.is_alive()
        runner.stop(timeout_s=20.0)
        assert not runner._thread.is_alive(), "stop did not wake the engine thread idling on its inbox"
    finally:
        requests.close()
        runner.courier.close()
        link.close()
