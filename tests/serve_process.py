"""`paged-hf serve` as a real process around a tiny random model saved in a folder (tests of the server's
lifecycle and of `paged-hf bench --serve`)."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import torch
from conftest import tiny_model
from tiny_server import free_port, tiny_tokenizer

MODEL = "tiny"


def save_tiny_model(folder, chat_template_prefix: str = "") -> str:
    """The tiny random Llama and its word-level tokenizer, saved as an HF folder (`chat_template_prefix`: put in
    front of the chat template, e.g. a slow loop)."""
    model = tiny_model("llama", dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = chat_template_prefix + tokenizer.chat_template
    tokenizer.save_pretrained(folder)
    return str(folder)


class ServerProcess:
    """`python -m paged_hf serve` on a free port; `url`, `process`; stopped (killed if need be) on exit."""

    def __init__(self, folder: str, *flags: str, timeout: float = 120):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "paged_hf", "serve", "--model", folder, "--served-model-name", MODEL,
                "--port", str(self.port), "--log-level", "warning", "--num-blocks", "256", "--max-model-len", "512",
                *flags]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
        atexit.register(self._kill)  # also when the test run itself is interrupted
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, self.process.stdout.read()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)

    def signal(self, sig=signal.SIGTERM) -> None:
        self.process.send_signal(sig)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._kill()
        self.process.wait(30)

    def _kill(self) -> None:
        """The server and every process it started: torchrun's ranks run in sessions of their own, so killing the
        server's process group alone would leave them serving (and holding memory) after the test."""
        if self.process.poll() is not None:
            return
        import psutil  # noqa: PLC0415 - the bench extra

        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        os.killpg(self.process.pid, signal.SIGKILL)
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass


def complete_greedy(url: str, model: str, prompt: str, stream: bool, max_tokens: int = 12) -> str:
    """A greedy completion's text from a running server, streamed (the events' texts joined) or not."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if not stream:
        response = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def kill_rank_mid_stream(server: "ServerProcess", rank: str = "1") -> str:
    """Kill torchrun's rank `rank` while a stream runs on every rank: the stream ends (never hangs), the server
    exits with an error within 20 s -> its output."""
    import psutil  # noqa: PLC0415 - the bench extra

    ranks = {proc.environ().get("RANK"): proc for proc in psutil.Process(server.process.pid).children()}
    assert set(ranks) == {"0", "1"}, ranks
    body = {"model": MODEL, "prompt": "the a of", "max_tokens": 500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # the request runs on both ranks
        ranks[rank].kill()
        killed = time.monotonic()
        try:
            list(lines)  # ends (an error event, or the connection closes), never hangs
        except httpx.HTTPError:
            pass
    server.process.wait(timeout=30)
    assert time.monotonic() - killed < 20
    assert server.process.returncode != 0
    return server.process.stdout.read()
