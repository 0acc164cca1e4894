"""What the plugin's tests and benchmark share: a random Llama saved like a Hugging Face model
(with a byte-level tokenizer built locally: nothing is downloaded), a `kvstore sidecar` child
process configured for it, and the vLLM settings that use the connector.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HOT_PAGES = 4   # the sidecar's hot tier: unused (pages move through warm), but it must hold a page

# the shape of a model: tiny (tests) and small (~100M parameters, the benchmark)
MODELS = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=384),
    "small": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=4, vocab_size=8192),
}


def make_model(directory: Path, size: str = "tiny", seed: int = 0, max_len: int = 16384) -> Path:
    """A random Llama (float32) and a byte-level tokenizer, saved as a Hugging Face model directory."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(seed)
    config = LlamaConfig(**MODELS[size], max_position_embeddings=max_len, rms_norm_eps=1e-5,
                         rope_theta=10000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                         torch_dtype="float32")
    model = LlamaForCausalLM(config)
    with torch.no_grad():   # larger logit gaps than the default init: greedy choices that are not near-ties
        model.lm_head.weight.normal_(0.0, 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{ch: i + 3 for i, ch in enumerate(sorted(alphabet))}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(directory)
    return directory


def model_shape(directory: Path) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


def page_bytes(model_dir: Path, dtype: str, block_size: int) -> int:
    """The bytes of one kvstore page (one vLLM block of every layer) of this model."""
    from kvstore.pages.shapes import load_shape
    return load_shape(str(model_dir)).kv_spec(dtype, block_size).page_bytes


def connector_config(socket: Path | str, **extra) -> dict:
    """vLLM's kv_transfer_config for the connector."""
    return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore_vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"socket": str(socket), "retry_s": 0.5, **extra}}


class Sidecar:
    """`python -m kvstore sidecar` for a model directory, pages of `block_size` tokens, float32 KV;
    its hot pool holds HOT_PAGES pages of that model (overrides are config keys, e.g. hot.pool)."""

    def __init__(self, model_dir: Path, data_dir: Path, socket: Path, block_size: int = 128,
                 warm_bytes: str = "256MiB", cold_bytes: str = "1GiB", **overrides):
        self.model_dir, self.data_dir, self.socket = model_dir, Path(data_dir), Path(socket)
        self.settings = {"model": str(model_dir), "kv_dtype": "float32", "page_size": block_size,
                         "warm.bytes": warm_bytes, "cold.max_bytes": cold_bytes, **overrides}
        self.settings.setdefault("hot.pool", HOT_PAGES * page_bytes(model_dir, self.settings["kv_dtype"],
                                                                    int(self.settings["page_size"])))
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        args = [sys.executable, "-m", "kvstore", "sidecar", "--data-dir", str(self.data_dir),
                "--socket", str(self.socket), "--admin-port", "0"]
        for key, value in self.settings.items():
            args += ["--set", f"{key}={value}"]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.data_dir / "sidecar.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        lines: queue.Queue = queue.Queue()

        def read() -> None:
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)
        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 120
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise RuntimeError(f"kvstore sidecar not ready in 120 s:\n{self.log()}") from None
            if line is None:
                raise RuntimeError(f"kvstore sidecar exited with {self.proc.wait()}:\n{self.log()}")
            if line.startswith("kvstore sidecar: admin API on "):
                self.admin_url = line.split(" on ", 1)[1].strip()
            if line.startswith("kvstore sidecar: ready on "):
                return

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM: the sidecar writes its hot and warm pages to cold and exits."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stats(self) -> dict:
        """The admin API's /v1/stats (per tier: pages, hits, misses, ...)."""
        import urllib.request
        with urllib.request.urlopen(f"{self.admin_url}/v1/stats", timeout=30) as r:
            return json.loads(r.read())
