"""Must-show 7: ``make demo`` (= ``python -m kvfleet_server.demo``) starts kvfleet-server on the real model on
127.0.0.1, asks a chat question with the openai client, prints the answer and stops the server cleanly."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_serves_one_chat_answer_and_stops_cleanly():
    out = subprocess.run([sys.executable, "-m", "kvfleet_server.demo"], capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "--host 127.0.0.1" in out.stdout
    assert "/health 200" in out.stdout
    answer = [line for line in out.stdout.splitlines() if line.startswith("smollm2> ")]
    assert answer and "Paris" in answer[0]
    assert "exit status 0" in out.stdout
    assert "draining" in out.stderr  # the server's log: SIGTERM went through the graceful drain
