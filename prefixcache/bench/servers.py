"""The HTTP servers under test: a model folder both can load, and each server as a subprocess.

Both servers load the in-process model's own folder (the embedded default's converted
copy, or ``--model``) in the same dtype. The small preset's model exists only in memory:
it is saved to a temporary folder with a word-level tokenizer whose every token is a
space plus letters, so any token-id prompt has a text that encodes back to it. That
folder carries no EOS id: the servers then generate exactly ``max_tokens`` tokens, as
the in-process systems do with EOS ignored.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

#: Seconds a server may take to load its model and answer its readiness probe.
READY_TIMEOUT = 180.0
#: Seconds between terminate() and kill() when stopping a server.
STOP_TIMEOUT = 10.0


class ServerError(RuntimeError):
    """A server did not start, died, or answered with an error."""


@dataclass(slots=True)
class ModelFolder:
    path: str  # local folder (or hub id) both servers are given
    tokenizer: object  # the tokenizer the servers load from ``path``
    notes: list[str] = field(default_factory=list)
    temporary: tempfile.TemporaryDirectory | None = None

    def cleanup(self) -> None:
        if self.temporary is not None:
            self.temporary.cleanup()


def model_folder(model: torch.nn.Module, requested: str | None) -> ModelFolder:
    """Where the servers load ``model`` from, and its tokenizer."""
    from transformers import AutoTokenizer

    source = getattr(model, "name_or_path", "") or ""
    if os.path.isdir(source):
        return ModelFolder(source, AutoTokenizer.from_pretrained(source))
    if requested is not None:  # a hub id: the servers resolve it as the in-process load did (offline: cache)
        return ModelFolder(requested, AutoTokenizer.from_pretrained(requested))
    return _save_in_memory(model)


def _save_in_memory(model: torch.nn.Module) -> ModelFolder:
    from transformers import PreTrainedTokenizerFast

    tmp = tempfile.TemporaryDirectory(prefix="prefixcache-bench-model-")
    folder = Path(tmp.name)
    model.save_pretrained(folder)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_tokenizer(model.get_input_embeddings().num_embeddings))
    tokenizer.save_pretrained(folder)
    for name in ("config.json", "generation_config.json"):  # no EOS: every request runs to max_tokens
        path = folder / name
        data = json.loads(path.read_text())
        data["eos_token_id"] = None
        path.write_text(json.dumps(data, indent=1))
    note = ("in-memory model saved to a temporary folder with a word-level tokenizer (token i = ' x' + two "
            "letters) and no EOS id")
    return ModelFolder(str(folder), tokenizer, [note], temporary=tmp)


def word_tokenizer(vocab: int):
    """A ``tokenizers.Tokenizer`` whose token ``i`` is the word ``' x' + letters(i)``: text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    width = 1
    while 26**width < vocab:
        width += 1

    def word(i: int) -> str:
        letters = ""
        for _ in range(width):
            letters = chr(ord("a") + i % 26) + letters
            i //= 26
        return "\u0120x" + letters  # \u0120: byte-level BPE's visible space

    words = {word(i): i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token=word(0)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transformers_cli() -> list[str]:
    """The ``transformers`` command of this interpreter's environment."""
    script = Path(sys.executable).parent / "transformers"
    if script.exists():
        return [str(script)]
    found = shutil.which("transformers")
    if found is None:
        raise ServerError("the `transformers` command is not installed next to this Python; "
                          "pip install 'transformers[serving]'")
    return [found]


class Server:
    """One server subprocess: started on a free port, probed until ready, always stopped."""

    def __init__(self, name: str, argv: list[str], probe: str, threads: int | None = None):
        self.name, self.argv, self.probe = name, argv, probe
        self.env = dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"), PYTHONUNBUFFERED="1")
        if threads is not None:
            self.env["OMP_NUM_THREADS"] = str(threads)
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile(mode="w+b")  # noqa: SIM115 - the server's output, closed by stop()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, port: int, timeout: float | None = None) -> None:
        timeout = READY_TIMEOUT if timeout is None else timeout  # read at call time (tests shorten it)
        self.port = port
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                                     env=self.env)
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise ServerError(f"{self.name} exited with code {self.proc.returncode} before it was ready"
                                      f"{self.tail()}")
                try:
                    if client.get(self.url + self.probe).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        raise ServerError(f"{self.name} was not ready after {timeout:.0f} s{self.tail()}")

    def tail(self, chars: int = 2000) -> str:
        """The end of the server's combined stdout/stderr, for error messages."""
        self._log.flush()
        self._log.seek(0, os.SEEK_END)
        size = self._log.tell()
        self._log.seek(max(0, size - chars))
        text = self._log.read().decode("utf-8", "replace").strip()
        return f"\n--- {self.name} output (last {chars} chars) ---\n{text}" if text else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT)
        self._log.close()


def prefixcache_server(folder: str, dtype: str, port: int, workers: int, threads: int | None) -> Server:
    """``prefixcache serve``: greedy by default, no TTL, ``workers`` threads so concurrent
    requests meet in the batch loop."""
    argv = [sys.executable, "-m", "prefixcache.cli", "serve", "--model", folder, "--dtype", dtype,
            "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers), "--ttl-seconds", "none",
            "--default-temperature", "0", "--log-level", "warning"]
    if threads is not None:
        argv += ["--torch-threads", str(threads)]
    return Server("prefixcache serve", argv, "/readyz", threads)


def transformers_server(folder: str, dtype: str, port: int, *, blocks: int, block_size: int,
                        max_batch_tokens: int, threads: int | None) -> Server:
    """``transformers serve --continuous-batching`` pinned to the folder, its paged pool sized
    to the workload (its CPU default is sized from free RAM)."""
    argv = [*transformers_cli(), "serve", folder, "--continuous-batching", "--dtype", dtype, "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(port), "--cb-num-blocks", str(blocks),
            "--cb-block-size", str(block_size), "--cb-max-batch-tokens", str(max_batch_tokens),
            "--log-level", "warning"]
    return Server("transformers serve", argv, "/health", threads)
