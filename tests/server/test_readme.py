"""Must-show 1 of issue 17: the README's "Serve a model" commands, pasted as they are into a shell of the
repository (after `make test`'s venv exists), work: the server command starts the bundled model, and the
openai snippet, run as written, gets an answer from it under the name it uses ("smollm2").

The only edit is the port: 8000 is replaced by a free one, because other test processes share this machine."""

import re
import subprocess
from pathlib import Path

import pytest

from server_fixtures import ServerProcess, free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _blocks(lang: str) -> list[str]:
    section = ROOT.joinpath("README.md").read_text().split("## Serve a model", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


def test_readme_server_command_and_openai_snippet_work_as_written(tmp_path):
    from kvfleet_server.demo import wait_until_ready

    command = _blocks("bash")[0].split("#", 1)[0].strip()
    snippet = _blocks("python")[0]
    assert command == ".venv/bin/kvfleet-server --model smollm2 --port 8000"
    assert 'model="smollm2"' in snippet and "127.0.0.1:8000" in snippet
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:  # a file, not a pipe: a chatty server can never block on it
        proc = subprocess.Popen(["bash", "-c", f"exec {command.replace('8000', str(port))}"],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    server = ServerProcess(proc, port, str(log_path))
    try:
        wait_until_ready(proc, server.url, timeout_s=300)
        out = subprocess.run([str(ROOT / ".venv/bin/python"), "-c", snippet.replace("8000", str(port))],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip(), "the snippet printed no answer"
    finally:
        rc = server.stop(60)
    assert rc == 0, server.log()
