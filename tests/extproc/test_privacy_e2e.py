"""Prompt text never leaves the request path: not in spans, router logs, metrics or Envoy's log."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gorgo.harness.procs import wait_for
from tests.support.e2e import GorgoMetrics, chat, start_stack, stop_stack

pytestmark = pytest.mark.envoy
SECRET = "zq-secret-marker-7f3a"


def test_prompt_text_is_not_exported(tmp_path: Path) -> None:
    st = start_stack(tmp_path, n=2)
    try:
        ids = []
        for body in (chat(f"my password is {SECRET} " * 20),
                     {"model": "m", "messages": [{"role": "user", "content": SECRET}],
                      "stream": "not-a-bool"},
                     b'{"messages": [' + SECRET.encode()):
            status, headers, _, _ = st.post(body)
            if status == 200:
                ids.append(headers["x-gorgo-decision-id"])
        assert ids
        assert wait_for(lambda: any(s.get("gorgo.decision_id") == ids[0]
                                    for s in st.sink.spans), 15)
        time.sleep(0.5)
        for span in st.sink.spans:
            assert not any(SECRET in v for v in span.values()), span
        assert SECRET not in GorgoMetrics(st).text
        assert SECRET not in "".join(st.extproc.lines)
        assert SECRET not in st.envoy.log_tail(10**7)
    finally:
        stop_stack(st)
