"""`python -m ddp_course lab`: JupyterLab whose terminals are the course's shell.

The server is started headless the way `make lab` starts it (plus a token and a free
port), a terminal is opened through Jupyter's REST and websocket API as JupyterLab's
launcher opens one, and the shell reports its folder and which `torchrun` it finds.
"""

import json
import os
import pathlib
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from ddp_course.harness.cli import lab_command

pytest.importorskip("jupyterlab", reason="JupyterLab is in the pinned and lab extras")
websocket = pytest.importorskip("tornado.websocket")
ioloop = pytest.importorskip("tornado.ioloop")

BIN = pathlib.Path(sys.executable).parent  # .venv/bin, not resolved


def test_lab_command_allows_root_only_for_root(root):
    as_root = lab_command(root, uid=0, shell=None)
    as_user = lab_command(root, uid=1000, shell=None)
    assert "--allow-root" in as_root and "--allow-root" not in as_user
    assert f"--ServerApp.root_dir={root}" in as_user
    assert any(a.endswith("/lab/tree/notebooks/00_course_setup.ipynb") for a in as_user)


def test_make_lab_runs_the_course_command(root):
    recipe = re.search(r"^lab:.*\n((?:\t.*\n)+)", (root / "Makefile").read_text(), re.M)
    assert recipe and "-m ddp_course lab" in recipe.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(url, token, method="GET", body=None):
    request = urllib.request.Request(
        url,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return json.loads(text) if text else None


def _run_in_terminal(ws_url: str, line: str, marker: str, timeout_s: float = 30) -> str:
    """Type ``line`` into a terminal; the shell's output up to ``marker``'s second echo."""

    async def talk():
        conn = await websocket.websocket_connect(ws_url)
        await conn.write_message(json.dumps(["stdin", line + "\r"]))
        seen = ""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            message = await conn.read_message()
            if message is None:
                break
            kind, *payload = json.loads(message)
            if kind == "stdout":
                seen += payload[0]
                if re.search(marker + r"=\S+ END", seen):
                    break
        conn.close()
        return seen

    return ioloop.IOLoop.current().run_sync(talk, timeout=timeout_s + 5)


def _start_lab(tmp_path, stdout=subprocess.PIPE):
    """`python -m ddp_course lab` on a free port, once it answers; (process, url, token)."""
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    # As from a shell where the environment is not activated: the command must add it.
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and pathlib.Path(p) != BIN]
    env["PATH"] = os.pathsep.join(path)
    env["JUPYTER_CONFIG_DIR"] = str(tmp_path / "config")  # the user's settings stay out
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddp_course",
            "lab",
            "--no-browser",
            f"--port={port}",
            "--ip=127.0.0.1",
            f"--IdentityProvider.token={token}",
        ],
        cwd=tmp_path,
        env=env,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            _api(f"{url}/api/status", token)
            return process, url, token
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                output = process.communicate()[0] or ""
                pytest.fail("JupyterLab did not start:\n" + output)
            time.sleep(0.5)


@pytest.fixture
def lab_server(root, tmp_path):
    """A running `python -m ddp_course lab` on a free port; (url, token)."""
    process, url, token = _start_lab(tmp_path)
    try:
        yield url, token
    finally:
        if process.poll() is None:
            try:
                _api(f"{url}/api/shutdown", token, method="POST", body={})
                process.wait(timeout=20)
            except Exception:
                process.kill()
                process.wait()


def test_lab_terminal_runs_lesson_commands_from_the_repository_root(lab_server, root):
    url, token = lab_server
    with urllib.request.urlopen(f"{url}/?token={token}", timeout=10) as response:
        assert response.url.split("?")[0].endswith("/lab/tree/notebooks/00_course_setup.ipynb")
    listing = _api(f"{url}/api/contents/notebooks", token)
    assert "00_course_setup.ipynb" in {item["name"] for item in listing["content"]}
    # JupyterLab's launcher asks for the file browser's folder; lessons need the root.
    name = _api(f"{url}/api/terminals", token, method="POST", body={"cwd": "notebooks"})["name"]
    ws_url = f"ws://127.0.0.1:{url.rsplit(':', 1)[1]}/terminals/websocket/{name}?token={token}"
    seen = _run_in_terminal(
        ws_url,
        'echo "CWD=$(pwd) END"; echo "TORCHRUN=$(command -v torchrun) END"; '
        'echo "PY=$(command -v python) END"',
        "PY",
    )
    values = dict(re.findall(r"(CWD|TORCHRUN|PY)=(\S+) END", seen))
    assert values.get("CWD") == str(root), seen
    assert values.get("TORCHRUN") == str(BIN / "torchrun"), seen
    assert values.get("PY") == str(BIN / "python"), seen


def test_the_course_lab_asks_no_news_question(lab_server):
    # JupyterLab's first start asks whether to fetch Jupyter news; the course answers no.
    url, token = lab_server
    plugin = "@jupyterlab/apputils-extension:notification"
    settings = _api(f"{url}/lab/api/settings/{plugin}", token)
    assert settings["schema"]["properties"]["fetchNews"]["default"] == "false"


def test_sigterm_stops_jupyterlab_itself(root, tmp_path):
    # `python -m ddp_course lab` becomes JupyterLab, so the signal reaches the server.
    process, url, token = _start_lab(tmp_path, stdout=subprocess.DEVNULL)
    try:
        process.terminate()
        process.wait(timeout=30)
        with pytest.raises(OSError):
            _api(f"{url}/api/status", token)  # nothing left serving the port
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
